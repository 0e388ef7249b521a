"""The quantized Triton products (``edgespec.kernels.quant.triton_quant_gemv``) against their torch reference
(``edgespec.kernels.quant.quant_ref.matmul_ref``) on CUDA; skipped cleanly without a GPU or Triton.

Tolerance: relative error ``||out - ref|| / ||ref||`` below 1e-2 for bf16 activations (the kernels round each
dequantized weight to bf16 for the tensor-core tile, or multiply in fp32 on the one-row path; the reference
multiplies in fp32), 5e-3 for fp16. Outputs are poisoned with NaN through the caching allocator first, so an
unwritten element fails.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from edgespec.kernels.quant.quant_ref import pack

_READY = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _READY, reason="needs a CUDA device and Triton")]

DEV = "cuda"
TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
FORMATS = ("int4", "nvfp4", "fp8_block")
# int4 and nvfp4: the previous byte tile for 2..16 rows, and a wide pair tile
PAIR_LAUNCHES = ({"SPLIT_K": 2, "DOT": 1, "PAIRS": 0}, {"SPLIT_K": 1, "DOT": 1, "PAIRS": 1, "BLOCK_N": 256})
# the launches of this module's own tiles, where quant_config would pick a weight-major one (triton_quant_wide)
OWN = {"T": 0}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def poison() -> None:
    t = torch.full((1 << 24,), float("nan"), device=DEV)
    del t


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(256, 512), (200, 384), (1000, 1280), (4096, 2048)])
def test_rows_1_to_16(fmt: str, shape: tuple[int, int]) -> None:
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    torch.manual_seed(sum(shape))
    n, k = shape
    p = pack(fmt, torch.randn(n, k, device=DEV) * 0.05)
    for rows in range(1, 17):
        x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
        poison()
        out = quant_matmul(p, x)
        assert out.shape == (rows, n) and out.dtype == x.dtype
        assert rel_err(out, p.matmul_ref(x)) < TOL[x.dtype], (fmt, shape, rows)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_split_and_launches(fmt: str, dtype: torch.dtype) -> None:
    """Every launch family (one-row CUDA-core paths: int4 words and bytes; tensor-core path; K split) with a
    bias, in both dtypes."""
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    torch.manual_seed(3)
    n, k = 320, 1024
    p = pack(fmt, torch.randn(n, k, device=DEV) * 0.05)
    bias = torch.randn(n, device=DEV, dtype=dtype)
    for rows in (1, 7, 16):
        x = torch.randn(rows, k, device=DEV, dtype=dtype)
        ref = p.matmul_ref(x, bias)
        for cfg in ({"SPLIT_K": 1, "DOT": 0}, {"SPLIT_K": 1, "DOT": 1}, {"SPLIT_K": 4, "DOT": 1},
                    {"SPLIT_K": 8, "DOT": 0, "BLOCK_N": 32}, {"SPLIT_K": 2, "DOT": 0, "WORDS": 0},
                    {"SPLIT_K": 1, "DOT": 0, "H2": 0}, {"SPLIT_K": 3, "DOT": 0, "H2": 1, "BLOCK_N": 64},
                    {"SPLIT_K": 2, "DOT": 1, "PDL": 0}, *PAIR_LAUNCHES * (fmt != "fp8_block")):
            poison()
            assert rel_err(quant_matmul(p, x, bias, config={**OWN, **cfg}), ref) < TOL[dtype], (fmt, rows, cfg)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wide_rows_17_to_64_read_each_weight_once(fmt: str, dtype: torch.dtype, monkeypatch) -> None:
    """17..64 rows (tree verifies) run the fused one-row-block tile, never dequantize-then-GEMM, with and without
    a bias and a K split, against the torch reference."""
    import edgespec.kernels.quant.triton_quant_gemv as qg

    def no_dequant(*a, **k):
        raise AssertionError("17..64 rows went to dequantize-then-GEMM")

    monkeypatch.setattr(qg, "dequant_gemm", no_dequant)
    torch.manual_seed(11)
    n, k = 640, 1024
    p = pack(fmt, torch.randn(n, k, device=DEV) * 0.05)
    bias = torch.randn(n, device=DEV, dtype=dtype)
    for rows in (17, 24, 31, 32, 33, 48, 63, 64):
        x = torch.randn(rows, k, device=DEV, dtype=dtype)
        cfg = qg.quant_config(fmt, n, k, rows, 132)
        assert cfg["BLOCK_M"] >= rows and cfg["DOT"] == 1, (fmt, rows, cfg)
        for b, extra in ((None, {}), (bias, {"SPLIT_K": 4}), (bias, {"XPAIR": 1, "BLOCK_N": 64, **OWN})):
            poison()
            out = qg.quant_matmul(p, x, b, config=extra)
            assert out.shape == (rows, n) and out.dtype == dtype
            assert rel_err(out, p.matmul_ref(x, b)) < TOL[dtype], (fmt, rows, extra)


def test_pair_order_is_the_tile_permutation() -> None:
    """``pair_order`` puts input 8w + 4h + p at column 8w + 2p + h, the order ``_pair_columns`` lays weights in."""
    from edgespec.kernels.quant.triton_quant_tiles import pair_order
    x = torch.arange(3 * 64, device=DEV).reshape(3, 64)
    xp = pair_order(x)
    for w, p, h in ((0, 0, 1), (2, 3, 0), (7, 1, 1), (5, 2, 1)):
        assert torch.equal(xp[:, 8 * w + 2 * p + h], x[:, 8 * w + 4 * h + p])


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_host_paired_x_equals_in_register_permutation(fmt: str, rows: int) -> None:
    """``XPAIR``: the pair tiles reading x permuted once on the host give the same bits as the tiles permuting it
    in registers (the same products in the same order)."""
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    torch.manual_seed(rows)
    p = pack(fmt, torch.randn(384, 1024, device=DEV) * 0.05)
    x = torch.randn(rows, 1024, device=DEV, dtype=torch.bfloat16)
    base = {"DOT": 1, "PAIRS": 1, "SPLIT_K": 1, **OWN}
    assert torch.equal(quant_matmul(p, x, config={**base, "XPAIR": 1}), quant_matmul(p, x, config={**base, "XPAIR": 0}))


@pytest.mark.parametrize("fmt", FORMATS)
def test_wide_rows_equal_row_by_row_products(fmt: str) -> None:
    """A row of a 64-row call is the product of that row: each output row depends on its own input row only
    (rows past M are masked, not mixed in), checked against the same rows sent as one 16-row call."""
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    torch.manual_seed(5)
    p = pack(fmt, torch.randn(384, 768, device=DEV) * 0.05)
    x = torch.randn(64, 768, device=DEV, dtype=torch.bfloat16)
    wide = quant_matmul(p, x)
    for lo in (0, 16, 48):
        narrow = quant_matmul(p, x[lo:lo + 16])
        assert rel_err(wide[lo:lo + 16], narrow) < 1e-2, (fmt, lo)
    assert rel_err(quant_matmul(p, x[:40]), wide[:40]) < 1e-2


def test_int4_fp16_pair_products_large_inputs() -> None:
    """The one-row int4 kernel multiplies in fp16 pairs with x scaled by 2^-4: inputs in the thousands (LLM
    activation outliers) stay finite and within tolerance."""
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    p = pack("int4", torch.randn(256, 1024, device=DEV) * 0.05)
    x = torch.randn(1, 1024, device=DEV) * 3.0
    x[0, ::97] = 4000.0
    x = x.to(torch.bfloat16)
    out = quant_matmul(p, x, config={"DOT": 0, "H2": 1})
    assert torch.isfinite(out).all()
    assert rel_err(out, p.matmul_ref(x)) < 1e-2


def test_fp8_ragged_k() -> None:
    """Block-FP8 with in_features not a multiple of 128 (a partial last scale block)."""
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    p = pack("fp8_block", torch.randn(200, 320, device=DEV) * 0.05)
    for rows in (1, 3, 16, 40):
        x = torch.randn(rows, 320, device=DEV, dtype=torch.bfloat16)
        assert rel_err(quant_matmul(p, x), p.matmul_ref(x)) < 1e-2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [17, 63, 64, 100, 512])
def test_prefill_rows(fmt: str, rows: int) -> None:
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    torch.manual_seed(rows)
    p = pack(fmt, torch.randn(384, 768, device=DEV) * 0.05)
    x = torch.randn(rows, 768, device=DEV, dtype=torch.bfloat16)
    poison()
    assert rel_err(quant_matmul(p, x), p.matmul_ref(x)) < 1e-2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_band_equals_reference_rows(fmt: str, dtype: torch.dtype) -> None:
    """The prefill path's Triton dequantization is the format's ``dequantize_rows`` bit for bit, for whole
    matrices, bands starting mid-matrix and a ragged last block (fp8 K not a multiple of 128)."""
    from edgespec.kernels.quant.triton_quant_prefill import dequantize_band
    torch.manual_seed(7)
    k = 320 if fmt == "fp8_block" else 384
    p = pack(fmt, torch.randn(300, k, device=DEV) * 0.05, group_size=64 if fmt == "int4" else 128)
    for start, stop in ((0, 300), (128, 300), (0, 128), (256, 300)):
        poison()
        assert torch.equal(dequantize_band(p, start, stop, dtype), p.dequantize_rows(start, stop, dtype)), \
            (fmt, start, stop)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_gemm_bands_and_bias(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A matrix taller than one band is multiplied band by band into the right output columns, with a bias;
    forcing either many-row path (``DEQUANT`` 0/1) gives the reference result."""
    from edgespec.kernels.quant import triton_quant_prefill
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    torch.manual_seed(11)
    p = pack(fmt, torch.randn(1000, 512, device=DEV) * 0.05)
    x = torch.randn(96, 512, device=DEV, dtype=torch.bfloat16)
    bias = torch.randn(1000, device=DEV, dtype=torch.bfloat16)
    ref = p.matmul_ref(x, bias)
    monkeypatch.setattr(triton_quant_prefill, "BAND_ELEMENTS", 256 * 512)     # bands of 256 rows: 4 bands
    assert triton_quant_prefill.band_rows(1000, 512) == 256
    poison()
    assert rel_err(quant_matmul(p, x, bias), ref) < 1e-2
    for forced in (0, 1):
        assert rel_err(quant_matmul(p, x, bias, config={"DEQUANT": forced}), ref) < 1e-2, forced


def test_row_result_independent_of_batch_within_verify() -> None:
    """Within the 2..16-row launch a row's result does not depend on how many rows ride along; one int4 row sent
    through the pair tile (the default for vocabulary-wide matrices) equals the same row of the 16-row verify."""
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    for fmt in FORMATS:
        p = pack(fmt, torch.randn(512, 1024, device=DEV) * 0.05)
        x = torch.randn(16, 1024, device=DEV, dtype=torch.bfloat16)
        full = quant_matmul(p, x)
        for rows in (2, 5, 9):
            assert torch.equal(quant_matmul(p, x[:rows]), full[:rows]), (fmt, rows)
        if fmt == "int4":
            assert torch.equal(quant_matmul(p, x[:1], config={"DOT": 1, "PAIRS": 1}), full[:1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nvfp4_pair_tile_every_code_and_scale(dtype: torch.dtype) -> None:
    """The NVFP4 tiles place each e2m1 code into a 16-bit float (the 0.5 code a subnormal) and multiply it by the
    block scale before the mma: every code against every e4m3 scale magnitude (subnormal scales too) gives the
    reference product to the rounding of the output."""
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    torch.manual_seed(5)
    n, k = 256, 1024
    p = pack("nvfp4", torch.randn(n, k, device=DEV) * 0.05)
    codes = torch.arange(256, dtype=torch.int32, device=DEV).to(torch.uint8)        # both nibbles: all 16 codes
    p.weight.copy_(codes.repeat(n * k // 2 // 256).view(n, k // 2))
    scale_bits = torch.arange(n * k // 16, device=DEV, dtype=torch.int32) % 127        # e4m3 0x00..0x7E
    p.weight_scale.copy_(scale_bits.to(torch.uint8).view(torch.float8_e4m3fn).view(n, k // 16))
    # the pair tile of this module, and the weight-major tile of triton_quant_wide (the same placement, block
    # scales read as one int64 per row and tile)
    for launch in ({"DOT": 1, "PAIRS": 1, **OWN}, {"T": 1, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}):
        for rows in (2, 16, 40):
            x = torch.randn(rows, k, device=DEV, dtype=dtype)
            poison()
            out = quant_matmul(p, x, config=launch)
            ref = p.matmul_ref(x)
            assert rel_err(out, ref) < TOL[dtype] / 2.5, (rows, launch)    # exact weights: the output's rounding


@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_pair_tile_groups(group: int, dtype: torch.dtype) -> None:
    """The pair-ordered int4 tile for every group size, both activation types, the extreme codes (q - z = +-15)
    and a ragged last row block."""
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    torch.manual_seed(group)
    p = pack("int4", torch.randn(333, 1024, device=DEV) * 0.05, group_size=group)
    p.qweight[:7] = 0xFF                       # q = 15 in every nibble of the first rows
    p.zeros[:3] = 0                            # ... against z = 0: +15
    p.qweight[7:9] = 0x00                      # q = 0 ...
    p.zeros[7:9] = 15                          # ... against z = 15: -15
    for rows in (1, 3, 16):
        x = torch.randn(rows, 1024, device=DEV, dtype=dtype)
        poison()
        assert rel_err(quant_matmul(p, x, config={"PAIRS": 1, "DOT": 1}), p.matmul_ref(x)) < TOL[dtype], \
            (group, rows)


def test_choose_kernel_and_graph_capture() -> None:
    """The chosen kernel runs inside a CUDA graph and replays to the reference result."""
    from edgespec.kernels.quant.triton_quant_gemv import choose_quant_kernel, prepare_for_kernel
    for fmt in FORMATS:
        p = prepare_for_kernel(pack(fmt, torch.randn(256, 512, device=DEV) * 0.05))
        kern = choose_quant_kernel(p)
        if fmt == "fp8_block" and torch.cuda.get_device_capability() < (8, 9):
            assert kern is None
            continue
        assert kern is not None
        x = torch.randn(4, 512, device=DEV, dtype=torch.bfloat16)
        kern(p, x, None)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = kern(p, x, None)
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, p.matmul_ref(x)) < 1e-2
    assert choose_quant_kernel(pack("int4", torch.randn(64, 256))) is None      # CPU weight: no kernel
