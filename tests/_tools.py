"""The scripts of ``tools/`` as modules, for the tests that check them (the tools are scripts, not a package)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@functools.cache
def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` loaded once as a module."""
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
