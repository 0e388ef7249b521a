"""Launch shapes of the weight-major tiles (``edgespec.kernels.quant.triton_quant_wide``), on the CPU: K splits sized by
waves of programs (the narrow 4B matrices), and which matrices the tile takes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from edgespec.kernels.quant.quant_ref import RawPacked  # noqa: E402
from edgespec.kernels.quant.triton_quant_tiles import wave_splits  # noqa: E402
from edgespec.kernels.quant.triton_quant_wide import t_tile_applies  # noqa: E402


def test_wave_splits_reach_the_wanted_programs_with_even_splits() -> None:
    # 4B down projection 2560x9216 at 64 weight rows per program: 40 row blocks, 72 tiles, 2 waves of 132 SMs
    d = wave_splits(40, 72, 264)
    assert 72 % d == 0 and 40 * d >= 264 and d == 8          # the smallest divisor that reaches 264
    assert wave_splits(400, 72, 264) == 1                      # enough row blocks: no split
    # 76 tiles (divisors 1, 2, 4, 19, 38, 76): 19 reaches the programs with 4 tiles per split
    assert wave_splits(40, 76, 264) == 19
    # too few tiles to reach the programs: the most splits that keep 4 tiles each
    assert wave_splits(2, 20, 264) == 5
    assert wave_splits(1, 3, 264) == 1                         # fewer tiles than the minimum: one split


def test_t_tile_takes_aligned_matrices_only() -> None:
    fp8 = RawPacked("fp8_block", 256, 384, {"weight": torch.zeros(256, 384, dtype=torch.float8_e4m3fn),
                                            "weight_scale_inv": torch.ones(2, 3)}, 128)
    assert t_tile_applies(fp8, 128) and t_tile_applies(fp8, 64)
    assert not t_tile_applies(fp8, 256)                       # one scale block per program
    ragged = RawPacked("fp8_block", 256, 320, {"weight": torch.zeros(256, 320, dtype=torch.float8_e4m3fn),
                                               "weight_scale_inv": torch.ones(2, 3)}, 128)
    assert not t_tile_applies(ragged, 128)                    # K not whole 128-input tiles
    s = torch.zeros(64, 17, dtype=torch.float8_e4m3fn)
    nv = RawPacked("nvfp4", 64, 256, {"weight": torch.zeros(64, 128, dtype=torch.uint8), "weight_scale": s[:, 1:],
                                      "weight_scale_2": torch.ones(())}, 16)
    assert not t_tile_applies(nv, 128)                        # scales not 8-byte aligned: the other tile runs
