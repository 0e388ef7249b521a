"""The package's imports form no cycle, and run down the layers of docs/architecture.md.

Every import counts: at module level or inside a function (a reference's lazy import of its Triton twin too),
absolute or relative, ``import a.b`` or ``from a import b``. A Triton twin and its torch reference share what both
need through a third module (e.g. ``edgespec.kernels.recurrent.gdn_common``), never by importing each other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Installed package name -> folder in the repository (pyproject package-dir).
PACKAGES = {"edgespec": ROOT / "edgespec", "edgespec.arch": ROOT / "arch", "edgespec.serving": ROOT / "serving"}


def package_modules() -> dict[str, Path]:
    """Every module of the installed package by dotted name."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def absolute_module(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The dotted module a ``from ... import`` names, relative levels resolved against ``importer``."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(path: Path, known: dict[str, Path], importer: str = "") -> set[str]:
    """Package modules ``path`` (module ``importer``) imports: ``from a.b import c`` counts a.b.c if it is a
    module, else a.b; ``import a.b`` counts a.b."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = absolute_module(node, importer, path.name == "__init__.py")
            submodules = {f"{module}.{a.name}" for a in node.names} & known.keys()
            out |= submodules or ({module} & known.keys())
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names} & known.keys()
    return out


def import_graph() -> dict[str, set[str]]:
    """``module -> the package modules it imports`` over the whole installed package."""
    modules = package_modules()
    return {m: imports_of(p, modules, m) - {m} for m, p in modules.items()}


def cycle_groups(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of modules that all reach each other through imports (the strongly connected components of more
    than one module, by Tarjan's algorithm): every import cycle lies inside one of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in sorted(graph.get(m, ())):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            group = set()
            while not group or m not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1:
                groups.append(group)

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(groups, key=min)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import cycle (first == last) through each of :func:`cycle_groups`; [] when the graph has none."""
    return [_cycle_in(graph, group) for group in cycle_groups(graph)]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle through the first module of ``group`` (a strongly connected component): breadth-first
    search inside the group from that module back to it."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while start not in came_from:
        frontier = [came_from.setdefault(n, m) and n for m in frontier for n in sorted(graph[m] & group)
                    if n not in came_from]
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(came_from[path[-1]])
    return path[::-1]


def test_find_cycles_lists_every_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    two = {"a": {"b"}, "b": {"a", "c"}, "c": set(), "x": {"y"}, "y": {"z"}, "z": {"x", "c"}}
    assert find_cycles(two) == [["a", "b", "a"], ["x", "y", "z", "x"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_lazy_imports_count(tmp_path: Path) -> None:
    """A relative import and an import inside a function are edges like any other."""
    mod = tmp_path / "ref.py"
    mod.write_text("from .sibling import x\n\ndef f():\n    from edgespec.k.triton_twin import y\n")
    known = {"edgespec.k.ref": mod, "edgespec.k.sibling": mod, "edgespec.k.triton_twin": mod}
    assert imports_of(mod, known, "edgespec.k.ref") == {"edgespec.k.sibling", "edgespec.k.triton_twin"}
    # in a package's __init__, "." is the package itself (serving/__init__.py: from . import app)
    node = ast.parse("from . import app").body[0]
    assert absolute_module(node, "edgespec.serving", is_package=True) == "edgespec.serving"
    assert absolute_module(node, "edgespec.serving.worker", is_package=False) == "edgespec.serving"


def test_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "edgespec.kernels.recurrent.triton_gdn" in graph and "edgespec.arch.base" in graph
    # the Triton twin and its reference share their helpers through a third module
    assert "edgespec.kernels.recurrent.gdn_common" in graph["edgespec.kernels.recurrent.triton_gdn"]
    assert "edgespec.kernels.recurrent.triton_gdn" in graph["edgespec.kernels.recurrent.gdn"]   # the lazy import
    assert "edgespec.serving.errors" in graph["edgespec.serving.protocol"]                       # a relative one
    groups = cycle_groups(graph)
    assert not groups, "import cycles:\n" + "\n".join(
        f"{' -> '.join(_cycle_in(graph, g))} (modules that reach each other: {', '.join(sorted(g))})" for g in groups)


# Imports that run from a lower layer of docs/architecture.md's table up to a higher one, each with its reason.
# (importer prefix, imported module) -> reason; an importer prefix covers a module and its submodules.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("edgespec.kernels", "edgespec.cache.kv"):
        "the attention, RoPE-write and CPU-step kernels take the KVCache object (its tensors, FP8 scales and "
        "block layout) instead of plain tensors",
    ("edgespec.weights.gguf", "edgespec.kernels.cpu.gguf_native"):
        "a GGUF block weight's product on the CPU is the compiled kernel of kernels/cpu/gguf_cpu.c, called from its "
        "own matmul: unlike the Triton products (given to a packed weight by the arch hooks as packed.kernel) it "
        "must run for any caller, hooks or not (the native loader's checks, the fp32 GGUF tests)",
    ("edgespec.weights.gguf_kquants", "edgespec.kernels.quant.triton_kquant_decode"):
        "a K-quant embedding table's row lookup on CUDA is one Triton decode launch, called (lazily) from the "
        "weight's own rows(): the arch hooks hand a packed weight its product kernel, not its embedding lookup",
    ("edgespec.engine", "edgespec.distill.request_log"):
        "the engine writes the request log; the log's format lives with distill, its reader",
    ("edgespec.bench.session", "edgespec.distill.request_log"):
        "the session bench replays a request log; the log's format lives with distill, its reader",
}


def layer_table() -> dict[str, int]:
    """``part -> layer`` from the "Import layers" table of docs/architecture.md."""
    text = (ROOT / "docs/architecture.md").read_text()
    section = text.split("## Import layers", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `([\w.]+)` \|", section, flags=re.MULTILINE)
    return {part: int(layer) for layer, part in rows}


def part_of(module: str) -> str:
    """The layer-table part a module belongs to: ``edgespec.kernels.quant.linear`` -> ``kernels``."""
    return module.split(".")[1] if "." in module else module


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[tuple[str, str]]:
    """Imports from a module to one of a higher layer that ALLOWED_UPWARD does not list."""
    found = []
    for module, imported in graph.items():
        for other in imported:
            if layers[part_of(other)] <= layers[part_of(module)]:
                continue
            if not any(module.startswith(a) and other == b for a, b in ALLOWED_UPWARD):
                found.append((module, other))
    return sorted(found)


def test_layers_are_what_the_architecture_page_states() -> None:
    modules = package_modules()
    layers = layer_table()
    assert layers["errors"] < layers["kernels"] < layers["models"] < layers["arch"] < layers["engine"]
    assert {part_of(m) for m in modules} == set(layers), "every part of the package has a row, and no more"
    graph = import_graph()
    wrong = upward_imports(graph, layers)
    assert not wrong, "imports up the layers of docs/architecture.md: " + ", ".join(f"{a} -> {b}" for a, b in wrong)
    used = {(a, b) for a, b in ALLOWED_UPWARD if any(m.startswith(a) and b in graph[m] for m in graph)}
    assert used == set(ALLOWED_UPWARD), f"listed but no longer imported: {set(ALLOWED_UPWARD) - used}"


def test_an_upward_import_is_reported() -> None:
    layers = {"kernels": 1, "engine": 2}
    graph = {"edgespec.kernels.x": {"edgespec.engine"}, "edgespec.engine": {"edgespec.kernels.x"}}
    assert upward_imports(graph, layers) == [("edgespec.kernels.x", "edgespec.engine")]
