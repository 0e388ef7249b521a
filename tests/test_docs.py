"""docs/configuration.md must list every setting as edgespec/config.py defines it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_doc_is_current():
    spec = importlib.util.spec_from_file_location("gen_config_doc", ROOT / "tools/gen_config_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (ROOT / "docs/configuration.md").read_text() == mod.render(), "run: python tools/gen_config_doc.py"
