"""lab/int4_repack_sass.py: the FP8 repack candidate of int4 groups (e4m3 ``q - z``, the group scale after each
group's MMA) compiles for sm_110a with the FP8 block-scaled MMA in its main loop, no spill at 16 rows, and the loop
applies the group scale on the CUDA cores. Skipped without Triton or a ptxas that knows sm_110a."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from _tools import load_tool

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


@pytest.mark.timeout(300)
def test_repack_candidate_compiles_for_thor(capsys) -> None:
    from edgespec.bench.compile_targets import ensure_ptxas
    from edgespec.device_checks import ptxas_targets
    ptxas = ensure_ptxas()
    if ptxas is None or "sm_110a" not in ptxas_targets(Path(ptxas))[1]:
        pytest.skip("no ptxas that knows sm_110a (pip install nvidia-cuda-nvcc, or set TRITON_PTXAS_PATH)")
    assert load_tool("int4_repack_sass").main(["--rows", "16", "--top", "40"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.split()[:2] == ["16", "32"])
    rows, cols, regs, spill, loop, per_weight = line.split()[:6]
    assert int(spill) == 0 and int(loop) > 0 and 0 < float(per_weight) < 4.0
    assert "UTCQMMA" in line and "FFMA" in line           # the FP8 block-scaled MMA; the group scale after it
