"""The package's imports form no cycle: a Triton module depends on its torch reference, never both ways.

Imports inside functions count too, except a lazy import of a Triton/Gluon module: a reference reaches its twin
that way, inside the dispatch function, because Triton may be absent (CPU) and must not load with the reference."""

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


def needs_triton(module: str) -> bool:
    leaf = module.rsplit(".", 1)[-1]
    return leaf.startswith(("triton_", "gluon_"))


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """Package modules ``path`` imports (``from a.b import c`` counts a.b.c if it is a module, else a.b), leaving
    out lazy (function-level) imports of Triton modules."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out: set[str] = set()
    for node in ast.walk(tree):
        found: set[str] = set()
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("edgespec") and not node.level:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            found = submodules or ({node.module} & known.keys())
        elif isinstance(node, ast.Import):
            found = {a.name for a in node.names} & known.keys()
        if id(node) not in top:
            found = {m for m in found if not needs_triton(m)}
        out |= found
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_find_cycle_reports_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_package_has_no_import_cycle() -> None:
    modules = package_modules()
    assert "edgespec.kernels.recurrent.triton_gdn" in modules and "edgespec.arch.base" in modules
    graph = {m: imports_of(p, modules) - {m} for m, p in modules.items()}
    # the Triton twin uses its reference
    assert "edgespec.kernels.recurrent.gdn" in graph["edgespec.kernels.recurrent.triton_gdn"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


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
    graph = {m: imports_of(p, modules) - {m} for m, p in modules.items()}
    wrong = upward_imports(graph, layers)
    assert not wrong, "imports up the layers of docs/architecture.md: " + ", ".join(f"{a} -> {b}" for a, b in wrong)
    used = {(a, b) for a, b in ALLOWED_UPWARD if any(m.startswith(a) and b in graph[m] for m in graph)}
    assert used == set(ALLOWED_UPWARD), f"listed but no longer imported: {set(ALLOWED_UPWARD) - used}"


def test_an_upward_import_is_reported() -> None:
    layers = {"kernels": 1, "engine": 2}
    graph = {"edgespec.kernels.x": {"edgespec.engine"}, "edgespec.engine": {"edgespec.kernels.x"}}
    assert upward_imports(graph, layers) == [("edgespec.kernels.x", "edgespec.engine")]
