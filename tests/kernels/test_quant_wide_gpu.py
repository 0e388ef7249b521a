"""The weight-major tiles of the packed products (``edgespec.kernels.quant.triton_quant_wide``, the ``T`` launches of
``quant_matmul``) against the torch reference (``quant_ref.matmul_ref``) on CUDA, with the tolerances of
``test_quant_kernels_gpu``; skipped cleanly without a GPU or Triton. Outputs are poisoned with NaN first, so an
unwritten element fails."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_quant_kernels_gpu import poison, rel_err  # the same checks as the activation-major tiles'

from edgespec.kernels.quant.quant_ref import RawPacked, pack

_READY = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _READY, reason="needs a CUDA device and Triton")]

DEV = "cuda"
TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
FORMATS = ("int4", "nvfp4", "fp8_block")



@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_major_tile_every_row_count(fmt: str, dtype: torch.dtype) -> None:
    """1..64 rows, with and without a bias and a K split, ragged output widths, both activation types."""
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    torch.manual_seed(7)
    for n, k in ((640, 1024), (200, 384), (4096, 2048)):
        p = pack(fmt, torch.randn(n, k, device=DEV) * 0.05)
        bias = torch.randn(n, device=DEV, dtype=dtype)
        for rows in (1, 5, 16, 33, 64):
            x = torch.randn(rows, k, device=DEV, dtype=dtype)
            for b, cfg in ((bias, {"T": 1, "BLOCK_N": 64, "SPLIT_K": 3}),
                           (None, {"T": 1, "BLOCK_N": 128, "num_warps": 8, "PDL": 1})):
                launch = {"num_warps": 4, "num_stages": 3, **cfg}
                poison()
                out = quant_matmul(p, x, b, config=launch)
                assert out.shape == (rows, n) and out.dtype == dtype
                assert rel_err(out, p.matmul_ref(x, b)) < TOL[dtype], (fmt, n, k, rows, launch)


@pytest.mark.parametrize("group", [32, 64, 256])
def test_int4_weight_major_group_sizes(group: int) -> None:
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    torch.manual_seed(group)
    p = pack("int4", torch.randn(384, 1024, device=DEV) * 0.05, group_size=group)
    for rows in (1, 16, 64):
        x = torch.randn(rows, 1024, device=DEV, dtype=torch.bfloat16)
        out = quant_matmul(p, x, config={"T": 1, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3})
        assert rel_err(out, p.matmul_ref(x)) < 1e-2, (group, rows)


def test_no_decode_launch_is_not_the_product() -> None:
    """``NO_DECODE`` (timing only) feeds raw words to the MMA: its output must differ from the product, so a sweep
    that reports it as a real launch would be caught by its reference check."""
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    p = pack("int4", torch.randn(256, 512, device=DEV) * 0.05)
    x = torch.randn(16, 512, device=DEV, dtype=torch.bfloat16)
    out = quant_matmul(p, x, config={"T": 1, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "NO_DECODE": 1})
    assert not (rel_err(out.float().nan_to_num(), p.matmul_ref(x)) < 1e-2)


def test_misaligned_nvfp4_scales_fall_back_to_the_activation_major_tile() -> None:
    """The nvfp4 tile reads eight scales as one int64; scales at an odd address (a slice of a larger buffer) are
    refused by the tile (None) and ``quant_matmul`` falls back to the other tile, still right."""
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    from edgespec.kernels.quant.triton_quant_wide import wide_t_matmul
    p = pack("nvfp4", torch.randn(256, 512, device=DEV) * 0.05)
    s = p.weight_scale
    wide = torch.empty((s.shape[0], s.shape[1] + 1), dtype=s.dtype, device=DEV)
    wide[:, 1:] = s
    odd = RawPacked("nvfp4", 256, 512, {"weight": p.weight, "weight_scale": wide[:, 1:],
                                        "weight_scale_2": p.weight_scale_2}, 16)
    x = torch.randn(16, 512, device=DEV, dtype=torch.bfloat16)
    cfg = {"T": 1, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
    assert wide_t_matmul(odd, x, None, cfg, 132) is None
    assert rel_err(quant_matmul(odd, x, config=cfg), p.matmul_ref(x)) < 1e-2


def test_weight_major_tile_refuses_more_than_64_rows() -> None:
    from edgespec.kernels.quant.triton_quant_wide import wide_t_matmul
    p = pack("int4", torch.randn(256, 512, device=DEV) * 0.05)
    x = torch.randn(65, 512, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="65 rows, at most 64"):
        wide_t_matmul(p, x, None, {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3}, 132)
