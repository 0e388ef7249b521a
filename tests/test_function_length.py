"""No function of the package runs over 80 lines (issue 33): a long function is several steps that want names.

Triton/Gluon kernel bodies are exempt (one kernel is one launch: splitting it would cost launches or registers);
the others left long are listed with why, and the list must shrink, not grow."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("edgespec", "arch", "serving")
MAX_LINES = 80
# "path:function" -> why it is still long.
LEFT_LONG = {
}


def _is_kernel(node: ast.FunctionDef) -> bool:
    """``@triton.jit`` / ``@gluon.jit`` (with or without arguments)."""
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def long_functions(root: Path = ROOT) -> dict[str, int]:
    """``path:function`` -> lines, for every non-kernel function over MAX_LINES."""
    found = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_LINES:
                        found[f"{path.relative_to(root)}:{node.name}"] = lines
    return found


def test_no_function_over_80_lines() -> None:
    found = long_functions()
    new = {k: v for k, v in found.items() if k not in LEFT_LONG}
    assert not new, f"functions over {MAX_LINES} lines: {new}"
    assert set(LEFT_LONG) <= set(found), f"no longer long, drop from LEFT_LONG: {set(LEFT_LONG) - set(found)}"


def test_a_long_function_is_found(tmp_path: Path) -> None:
    (tmp_path / "edgespec").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "edgespec" / "m.py").write_text(f"def f():\n{body}\n\n\n@triton.jit\ndef k():\n{body}\n")
    for folder in FOLDERS[1:]:
        (tmp_path / folder).mkdir()
    assert long_functions(tmp_path) == {"edgespec/m.py:f": MAX_LINES + 1}
