"""docs/configuration.md must list every setting as edgespec/config.py defines it."""

from __future__ import annotations

from pathlib import Path

from _tools import load_tool

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_doc_is_current():
    mod = load_tool("gen_config_doc")
    assert (ROOT / "docs/configuration.md").read_text() == mod.render(), "run: python tools/gen_config_doc.py"
