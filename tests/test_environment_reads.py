"""The product reads the process environment only at its documented edge: ``edgespec/environment.py`` (each
variable by name, with what it does) and the settings layers of ``edgespec/config.py``; every other module takes
its values as arguments or from its library's own API (Triton's knobs, torch.distributed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from edgespec import environment
from edgespec.config import ENV_NOT_SETTINGS

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("edgespec", "arch", "serving")
# The modules that may read the environment, with why.
EDGE = {
    "edgespec/environment.py": "the named, documented reads (environment.READS)",
    "edgespec/config.py": "the settings layers: EDGESPEC_<NAME> and EDGESPEC_CONFIG",
}
_READERS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def environment_reads(source: str) -> list[int]:
    """Lines of ``source`` that touch the process environment: ``os.environ`` / ``os.getenv`` (any spelling of
    the module), those names imported from ``os``, or ``os`` imported through ``__import__``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in _READERS:
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and {a.name for a in node.names} & _READERS:
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__"
              and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "os"):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_scan_sees_every_spelling() -> None:
    source = ("import os\nfrom os import getenv\na = os.environ.get('X')\nb = os.getenv('Y')\n"
              "c = __import__('os').environ['Z']\nimport os as o\nd = o.environ\ne = 'os.environ in a string'\n")
    assert environment_reads(source) == [2, 3, 4, 5, 5, 7]


def test_only_the_edge_reads_the_environment() -> None:
    found = {}
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = environment_reads(path.read_text())
            if lines:
                found[path.relative_to(ROOT).as_posix()] = lines
    outside = {path: lines for path, lines in found.items() if path not in EDGE}
    assert not outside, (f"environment reads outside the edge modules (lines): {outside}; take the value as an "
                         "argument, use the library's own API, or read it by name through edgespec.environment")
    stale = sorted(set(EDGE) - set(found))
    assert not stale, f"{stale} no longer read the environment: drop them from EDGE"


def test_reads_are_named_and_documented() -> None:
    with pytest.raises(KeyError, match="UNLISTED_VARIABLE is not in edgespec.environment.READS"):
        environment.read("UNLISTED_VARIABLE")
    prefixed = {name for name in environment.READS if name.startswith("EDGESPEC_")}
    assert prefixed <= set(ENV_NOT_SETTINGS), "an EDGESPEC_* read that config.ENV_NOT_SETTINGS does not list"
    doc = (ROOT / "docs/configuration.md").read_text()
    for name in environment.READS:
        assert f"| `{name}` |" in doc, f"{name} is not in docs/configuration.md (python tools/gen_config_doc.py)"


def test_a_named_read_returns_the_value(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from edgespec.paths import cache_root

    monkeypatch.delenv("EDGESPEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert environment.read("XDG_CACHE_HOME") == str(tmp_path)
    assert cache_root() == tmp_path / "edgespec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert environment.read("XDG_CACHE_HOME") is None
