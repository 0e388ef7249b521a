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


def package_imports(tree: ast.AST) -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from edgespec... import name`` in ``tree`` (module level or in functions)."""
    return [(node.module, alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and not node.level
            and node.module.split(".")[0] == "edgespec" for alias in node.names]


def _edgespec_missing(e: ModuleNotFoundError) -> bool:
    """Whether the module not found is ours (moved or renamed), not a third-party dependency."""
    return (e.name or "").split(".")[0] == "edgespec"


def missing_package_names(pairs: list[tuple[str, str]]) -> list[str]:
    """The ``module:name`` pairs that do not resolve: a module moved or renamed, or a name it no longer defines.
    A module whose own third-party dependency is missing here (e.g. Triton on a CPU box) is not judged."""
    import importlib

    missing = []
    for module, name in pairs:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if _edgespec_missing(e):
                missing.append(f"{module} (no such module)")
            continue
        except ImportError:
            continue
        if name != "*" and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError as e:
                if _edgespec_missing(e):
                    missing.append(f"{module}:{name}")
            except ImportError:
                continue
    return missing


def test_every_package_import_of_a_script_resolves() -> None:
    """A script is run by hand on a lent GPU, far from CI: an import of a moved module must fail here, not there
    (tools/tree_cost.py still imported ``edgespec.loading.synthetic`` after the move to ``edgespec.bench.shapes``)."""
    wrong = {str(p.relative_to(ROOT)): missing_package_names(package_imports(ast.parse(p.read_text())))
             for p in scripts()}
    assert not {k: v for k, v in wrong.items() if v}


def test_the_resolve_check_sees_a_moved_module() -> None:
    planted = ast.parse("from edgespec.loading.synthetic import SHAPES\nfrom edgespec.bench.shapes import NOPE\n"
                        "from edgespec.bench.shapes import SHAPES\n")
    assert missing_package_names(package_imports(planted)) == ["edgespec.loading.synthetic (no such module)",
                                                               "edgespec.bench.shapes:NOPE"]
