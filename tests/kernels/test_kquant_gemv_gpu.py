"""The CUDA-core K-quant GEMV for 1..4 rows (``edgespec.kernels.quant.triton_kquant_gemv``) and the K-quant embedding
lookup on CUDA; skipped cleanly without a GPU or Triton.

Oracles: the CPU decode of the same bytes (the torch reference, bit-equal to gguf-py's ``dequantize`` in
tests/weights/test_gguf_kquants.py). One-hot fp32 activation rows make the product return each weight as the kernel
decoded it, which must equal the CPU's fp32 weight bit for bit, at every row count 1..4, on odd shapes and at every
K split; random fp32 rows agree with the float64 product of the reference weights within 2e-6 relative (fp32 sums in
another order); a row gives the same bits at 1, 2, 3 and 4 rows; a captured CUDA graph replays the eager bits;
``linear`` and the weight's kernel route the rows ``KQUANT_GEMV_ROWS`` names there; bad inputs are named.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from edgespec.weights.gguf_kquants import K_FORMATS, random_kquant

_READY = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _READY, reason="needs a CUDA device and Triton")]

DEV = "cuda"
KINDS = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# (out, in): a row count no block width divides, an odd number of super-blocks (Q6_K rows then not word aligned),
# one super-block, and a peer-like width
SHAPES = [(97, 1280), (130, 256), (64, 768), (300, 3072)]


def _kquant(kind: str, rows: int, cols: int, seed: int = 0):
    """The same random super-blocks as a CPU weight and a CUDA weight."""
    raw = torch.from_numpy(random_kquant(rows, cols, kind, np.random.default_rng(seed)))
    cls = K_FORMATS[KINDS[kind]]
    return cls(raw.clone(), rows, cols, torch.float32), cls(raw.to(DEV), rows, cols, torch.bfloat16)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_gemv_decode_is_the_cpu_decode_bit_for_bit_at_every_row_count(kind: str, shape: tuple[int, int]) -> None:
    from edgespec.kernels.quant.triton_kquant_gemv import kquant_gemv
    rows, cols = shape
    cpu, gpu = _kquant(kind, rows, cols)
    ref = cpu.dequantize(torch.float32).t()                       # [in, out]
    eye = torch.eye(cols, device=DEV)
    for m in (1, 2, 3, 4):
        got = torch.cat([kquant_gemv(gpu, eye[i:i + m]) for i in range(0, cols - m + 1, m)])
        assert torch.equal(got.cpu(), ref[:got.shape[0]]), (m, "one-hot rows")
    nb = cols // 256
    for split in sorted({1, nb, max(1, nb // 2)}):           # every K split sums exact zeros beside the weight
        got = torch.cat([kquant_gemv(gpu, eye[i:i + 4], launch={"SPLIT_K": split, "BLOCK_N": 32})
                         for i in range(0, cols, 4)])
        assert torch.equal(got.cpu(), ref), ("split", split)


@pytest.mark.parametrize("kind", KINDS)
def test_gemv_fp32_products_and_row_count_independence(kind: str) -> None:
    from edgespec.kernels.quant.triton_kquant_gemv import kquant_gemv
    cpu, gpu = _kquant(kind, 333, 2816, seed=2)                    # 11 super-blocks, 333 rows
    w = cpu.dequantize(torch.float32).double().to(DEV)
    x = torch.randn(4, 2816, device=DEV)
    bias = torch.randn(333, device=DEV)
    ref = x.double() @ w.t()
    assert _rel(kquant_gemv(gpu, x), ref) < 2e-6
    assert _rel(kquant_gemv(gpu, x[:2], bias), ref[:2] + bias.double()) < 2e-6
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        four = kquant_gemv(gpu, xd)
        assert four.dtype == dtype
        for m in (1, 2, 3):                      # each row: the same bits alone or beside others
            assert torch.equal(kquant_gemv(gpu, xd[:m]), four[:m]), (dtype, m)
        assert torch.equal(kquant_gemv(gpu, xd[3:4]), four[3:4]), dtype
        lo = 2e-6 if dtype == torch.float32 else 8e-3
        assert _rel(four, xd.double() @ w.t()) < lo, dtype


@pytest.mark.parametrize("kind,gemv_rows", [("Q4_K", 1), ("Q6_K", 4)])
def test_kquant_matmul_and_linear_route_the_gemv_rows(kind: str, gemv_rows: int) -> None:
    """``kquant_matmul`` (the weight's kernel) and ``linear`` send the rows ``KQUANT_GEMV_ROWS`` names to the
    GEMV and more to the tiles: the bits show which ran (``TILES=1`` forces the tiles)."""
    from edgespec.arch.detect import select_hooks
    from edgespec.kernels.quant.linear import linear, route_log
    from edgespec.kernels.quant.route import KQUANT_GEMV_ROWS
    from edgespec.kernels.quant.triton_kquant import kquant_matmul
    from edgespec.kernels.quant.triton_kquant_gemv import kquant_gemv
    _, gpu = _kquant(kind, 512, 1024, seed=3)
    assert KQUANT_GEMV_ROWS[gpu.format] == gemv_rows
    x = torch.randn(8, 1024, device=DEV, dtype=torch.bfloat16)
    more = gemv_rows + 1
    with torch.inference_mode():
        for m in (1, gemv_rows):
            assert torch.equal(kquant_matmul(gpu, x[:m]), kquant_gemv(gpu, x[:m])), m
            tiles = kquant_matmul(gpu, x[:m], config={"TILES": 1})
            assert _rel(tiles, kquant_gemv(gpu, x[:m]).float()) < 1e-2, m
        assert torch.equal(kquant_matmul(gpu, x[:more]), kquant_matmul(gpu, x[:more], config={"TILES": 1}))
        assert select_hooks("rtx", torch.device(DEV)).choose_weight_kernels(gpu) == 1
        with route_log() as log:
            y_gemv = linear(x[:gemv_rows], gpu)
            y_more = linear(x[:more], gpu)
        assert log == {"kquant_gemv": 1, "packed": 1}
        assert torch.equal(y_gemv, kquant_gemv(gpu, x[:gemv_rows]))
        assert torch.equal(y_more, kquant_matmul(gpu, x[:more], config={"TILES": 1}))
        gpu.kernel = None                              # no Triton product chosen: the reference, never the GEMV
        with route_log() as log:
            linear(x[:1], gpu)
        assert log == {"packed": 1}


@pytest.mark.parametrize("kind", KINDS)
def test_gemv_replays_in_a_cuda_graph_bit_for_bit(kind: str) -> None:
    from edgespec.kernels.quant.triton_kquant_gemv import kquant_gemv
    _, gpu = _kquant(kind, 700, 1536, seed=4)
    x = torch.randn(3, 1536, device=DEV, dtype=torch.bfloat16)
    bias = torch.randn(700, device=DEV, dtype=torch.bfloat16)
    kquant_gemv(gpu, x, bias)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = kquant_gemv(gpu, x, bias)
    for seed in (5, 6):
        x.copy_(torch.randn(x.shape, generator=torch.Generator(DEV).manual_seed(seed), device=DEV))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, kquant_gemv(gpu, x, bias)), seed


@pytest.mark.parametrize("kind", KINDS)
def test_embedding_rows_on_cuda_are_the_reference_rows(kind: str) -> None:
    from edgespec.kernels.quant.triton_kquant import choose_kquant_kernel
    from edgespec.kernels.quant.triton_kquant_decode import kquant_rows
    cpu, gpu = _kquant(kind, 300, 768, seed=7)
    gpu.kernel = choose_kquant_kernel(gpu)
    assert gpu.kernel is not None
    index = torch.tensor([[0, 299, 17], [17, 5, 256]], device=DEV)
    ref = cpu.dequantize(torch.float32)[index.cpu()].to(torch.bfloat16)
    assert torch.equal(kquant_rows(gpu, index).cpu(), ref)
    assert torch.equal(gpu.rows(index).cpu(), ref)                       # the lookup takes the kernel
    assert torch.equal(gpu.rows(index.int()).cpu(), ref)
    assert kquant_rows(gpu, index[:, :0]).shape == (2, 0, 768)
    with pytest.raises(ValueError, match="int32 or int64"):
        kquant_rows(gpu, index.float())


def test_bad_gemv_inputs_are_named() -> None:
    from edgespec.kernels.quant.triton_kquant_gemv import kquant_gemv
    _, gpu = _kquant("Q6_K", 64, 512)
    x = torch.randn(5, 512, device=DEV)
    with pytest.raises(ValueError, match=r"5 rows, give 1\.\.4"):
        kquant_gemv(gpu, x)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        kquant_gemv(gpu, x[:1].double())
    with pytest.raises(ValueError, match=r"must be \[rows, 512\]"):
        kquant_gemv(gpu, torch.randn(1, 256, device=DEV))
    with pytest.raises(ValueError, match="contiguous rows"):
        kquant_gemv(gpu, torch.randn(512, 2, device=DEV).t())
