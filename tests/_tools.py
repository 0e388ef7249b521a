"""The scripts of ``tools/`` and ``lab/`` as modules, for the tests that check them (scripts, not a package)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` (or ``lab/<name>.py``) loaded once as a module."""
    path = ROOT / "tools" / f"{name}.py"
    if not path.exists():
        path = ROOT / "lab" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", path)
    module = importlib.util.module_from_spec(spec)
    # As when the script runs: its own folder first on the path, so a lab script's helpers (lab/sass_loop.py) import
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module
