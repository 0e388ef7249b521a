"""The wheel carries every subpackage and the data files the runtime reads (an editable install hides a package
missing from pyproject: the source tree is on the path)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_python_package_of_the_tree_is_declared():
    declared = set(_setuptools()["packages"])
    dirs = _setuptools()["package-dir"]
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found - declared == set(), f"packages missing from pyproject.toml: {sorted(found - declared)}"


def test_runtime_data_files_are_package_data():
    data = _setuptools()["package-data"]
    assert "*.c" in data["edgespec.kernels.cpu"] and (ROOT / "edgespec/kernels/cpu/gguf_cpu.c").is_file()
    # the per-ISA kernels' headers are compiled with them (edgespec.kernels.cpu.gguf_native.HEADERS)
    from edgespec.kernels.cpu.gguf_native import HEADERS
    assert "*.h" in data["edgespec.kernels.cpu"] and all((ROOT / "edgespec/kernels/cpu" / h).is_file() for h in HEADERS)
    assert "*.yaml" in data["edgespec.data"]
    drafter = ROOT / "edgespec/data/drafters/smollm2-135m-dflash"
    assert {"*/*.json", "*/*.safetensors"} <= set(data["edgespec.data.drafters"])
    assert (drafter / "config.json").is_file() and list(drafter.glob("*.safetensors"))


def test_version_is_the_installed_distributions() -> None:
    """One version: pyproject's, read back from the installed metadata (the server and doctor report it)."""
    from importlib.metadata import version

    import edgespec

    assert edgespec.__version__ == version("edgespec") != "0+unknown"


def test_no_built_artefacts_are_tracked() -> None:
    """Compiled helpers are built per machine (edgespec.kernels.cpu.gguf_native), never committed."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "*.so", "*.o", "*.dylib"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked == []
