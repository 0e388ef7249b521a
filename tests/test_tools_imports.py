"""The scripts of ``tools/`` and ``lab/`` use the package, not each other: none imports a ``tools/`` script, and
none edits ``sys.path`` to reach a sibling script (its own folder, ``tools/`` or ``lab/``). Helpers they share live
in the package (``edgespec/bench/kernel_timing.py``, ``edgespec/bench/random_drafter.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_DIRS = ("tools", "lab")


def scripts() -> list[Path]:
    return sorted(p for d in SCRIPT_DIRS for p in (ROOT / d).glob("*.py"))


def imported_modules(tree: ast.AST) -> set[str]:
    """Top-level names of every module ``tree`` imports (at module level or inside functions)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


def sibling_path_edits(source: str) -> list[str]:
    """The ``sys.path.insert/append`` arguments of ``source`` that add the script's own folder, ``tools/`` or
    ``lab/`` (the repository root, ``tests/`` or a user-given folder are fine)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("insert", "append") and ast.unparse(node.func.value) == "sys.path"):
            continue
        arg = ast.unparse(node.args[-1])
        if arg.endswith((".parent)", ".parent")) or any(f"'{d}'" in arg or f'"{d}"' in arg for d in SCRIPT_DIRS):
            found.append(arg)
    return found


def test_no_script_imports_a_tools_script() -> None:
    tools = {p.stem for p in (ROOT / "tools").glob("*.py")}
    assert {"kernel_bench", "make_drafter"} <= tools
    wrong = {f"{p.relative_to(ROOT)}: {sorted(imported_modules(ast.parse(p.read_text())) & tools)}"
             for p in scripts() if imported_modules(ast.parse(p.read_text())) & tools}
    assert not wrong, "scripts importing a tools/ script (move the shared code into the package): " + str(wrong)


def test_no_script_puts_a_sibling_folder_on_sys_path() -> None:
    wrong = {str(p.relative_to(ROOT)): sibling_path_edits(p.read_text()) for p in scripts()}
    assert not {k: v for k, v in wrong.items() if v}


def test_the_checks_see_a_planted_sibling_import() -> None:
    planted = ("import sys\nfrom pathlib import Path\n"
               "sys.path.insert(0, str(Path(__file__).resolve().parent))\n"
               "sys.path.append(str(Path(__file__).resolve().parents[1] / 'tools'))\n"
               "sys.path.insert(0, str(Path(__file__).resolve().parents[1]))\n"
               "def f():\n    from kernel_bench import make_cache\n")
    assert sibling_path_edits(planted) == ["str(Path(__file__).resolve().parent)",
                                           "str(Path(__file__).resolve().parents[1] / 'tools')"]
    assert "kernel_bench" in imported_modules(ast.parse(planted))
