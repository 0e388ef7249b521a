"""Which product ``linear`` runs (``linear_route``), at each boundary the dispatcher draws: the GEMV's one row, the
skinny GEMM's 2-16 rows, its width rule under ``skinny=wide``, cuBLAS beyond, OpenBLAS or torch on the CPU, packed
weights their own. The rule is a pure function, so every boundary is checked here on the CPU; ``route_log`` shows
``linear`` itself takes the route the rule names (here on the CPU paths; tests/kernels/test_kernels_gpu.py on CUDA)."""

from __future__ import annotations

import pytest
import torch

import edgespec.weights.gguf  # noqa: F401  (registers the GGUF formats)
import edgespec.weights.gguf_kquants  # noqa: F401  (registers the K-quant formats)
from edgespec.kernels.options import KernelOptions
from edgespec.kernels.quant import linear as L
from edgespec.kernels.quant.linear import route_log
from edgespec.kernels.quant.route import KQUANT_GEMV_ROWS, RouteFacts, linear_route
from edgespec.weights.requantize import quantize_weight

CUDA = RouteFacts(cuda=True, triton=True, sms=132)
SHAPE = (2560, 1024)


@pytest.mark.parametrize("rows,route", [(0, "cublas"), (1, "gemv"), (2, "skinny"), (15, "skinny"),
                                        (16, "skinny"), (17, "cublas"), (64, "cublas")])
def test_rows_pick_gemv_skinny_or_cublas(rows: int, route: str) -> None:
    for fmt in ("bfloat16", "float16"):
        assert linear_route(rows, fmt, SHAPE, CUDA) == route, (rows, fmt)


def test_skinny_wide_keeps_matrices_under_one_block_per_sm_on_cublas() -> None:
    wide = RouteFacts(cuda=True, triton=True, sms=132, options=KernelOptions(skinny="wide"))
    assert linear_route(4, "bfloat16", (64 * 131, 1024), wide) == "cublas"         # 131 row blocks < 132 SMs
    assert linear_route(4, "bfloat16", (64 * 131 + 1, 1024), wide) == "skinny"     # 132 blocks (the last partial)
    assert linear_route(4, "bfloat16", (64 * 132, 1024), wide) == "skinny"
    assert linear_route(1, "bfloat16", (64, 1024), wide) == "gemv"                 # one row: the width rule is moot
    assert linear_route(4, "bfloat16", (64, 1024), CUDA) == "skinny"               # skinny=all: every width


@pytest.mark.parametrize("facts", [
    RouteFacts(cuda=True, triton=False, sms=132),                                   # no Triton here
    RouteFacts(cuda=True, triton=True, sms=132, options=KernelOptions(no_triton=True)),
    RouteFacts(cuda=True, triton=True, sms=132, grad=True),                         # autograd: torch's backward
    RouteFacts(cuda=True, triton=True, sms=132, row_major=False),                   # a strided weight
])
def test_what_keeps_a_few_rows_off_the_triton_kernels(facts: RouteFacts) -> None:
    assert {linear_route(rows, "bfloat16", SHAPE, facts) for rows in (1, 2, 16)} == {"cublas"}


def test_only_bf16_and_fp16_take_the_triton_kernels() -> None:
    for fmt in ("float32", "mixed", "float64"):
        assert {linear_route(rows, fmt, SHAPE, CUDA) for rows in (1, 2, 16)} == {"cublas"}, fmt


def test_cpu_routes() -> None:
    blas = RouteFacts(cuda=False, cpu_blas=True)
    assert {linear_route(rows, "float32", SHAPE, blas) for rows in (1, 8, 9, 500)} == {"blas"}
    assert linear_route(1, "float32", SHAPE, RouteFacts(cuda=False)) == "torch"     # BLAS path off
    assert linear_route(1, "float32", SHAPE, RouteFacts(cuda=False, cpu_blas=True, grad=True)) == "torch"
    assert linear_route(1, "bfloat16", SHAPE, blas) == "torch"
    assert linear_route(1, "mixed", SHAPE, blas) == "torch"
    native = RouteFacts(cuda=False, cpu_blas=True, cpu_native=True)
    assert [linear_route(rows, "float32", SHAPE, native) for rows in (1, 8, 9)] == ["native", "native", "blas"]
    assert linear_route(1, "float32", SHAPE, RouteFacts(cuda=False, cpu_native=True, grad=True)) == "torch"
    assert linear_route(1, "bfloat16", SHAPE, native) == "torch"


def test_packed_formats_take_their_own_product() -> None:
    # "int4" is a torch dtype name too: the packed format must win.
    for fmt in ("int4", "nvfp4", "fp8_block", "gguf_q4_0"):
        for facts in (CUDA, RouteFacts(cuda=False, cpu_blas=True)):
            assert linear_route(1, fmt, SHAPE, facts) == "packed"


@pytest.mark.parametrize("rows,q4,q6", [(0, "packed", "packed"), (1, "kquant_gemv", "kquant_gemv"),
                                       (2, "packed", "kquant_gemv"), (4, "packed", "kquant_gemv"),
                                       (5, "packed", "packed"), (16, "packed", "packed"), (512, "packed", "packed")])
def test_kquant_rows_pick_the_cuda_core_gemv_or_their_tiles(rows: int, q4: str, q6: str) -> None:
    """GGUF K-quants on their Triton products: one row (decode) takes the CUDA-core GEMV, Q6_K up to four rows
    (short verifies: where it measured faster than the tiles); more rows the weight's own tensor-core tiles or
    prefill path."""
    assert KQUANT_GEMV_ROWS == {"gguf_q4_k": 1, "gguf_q5_k": 1, "gguf_q6_k": 4}
    for fmt, route in (("gguf_q4_k", q4), ("gguf_q5_k", q4), ("gguf_q6_k", q6)):
        assert linear_route(rows, fmt, (3072, 3072), CUDA) == route, (rows, fmt)


@pytest.mark.parametrize("facts", [
    RouteFacts(cuda=False, cpu_blas=True),                                          # the CPU: the compiled product
    RouteFacts(cuda=True, triton=False, sms=132),                                   # no Triton kernel chosen
    RouteFacts(cuda=True, triton=True, sms=132, options=KernelOptions(no_triton=True)),
    RouteFacts(cuda=True, triton=True, sms=132, grad=True),                         # autograd: the reference
])
def test_what_keeps_kquant_rows_off_the_gemv(facts: RouteFacts) -> None:
    assert {linear_route(rows, "gguf_q4_k", (3072, 3072), facts) for rows in (1, 4)} == {"packed"}


def test_other_packed_formats_never_take_the_kquant_gemv() -> None:
    for fmt in ("int4", "nvfp4", "fp8_block", "gguf_q4_0", "gguf_q8_0"):
        assert linear_route(1, fmt, SHAPE, CUDA) == "packed", fmt


def test_bad_route_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="'q4_k_m'"):
        linear_route(1, "q4_k_m", SHAPE, CUDA)
    with pytest.raises(ValueError, match="rows >= 0"):
        linear_route(-1, "bfloat16", SHAPE, CUDA)
    with pytest.raises(ValueError, match=r"shape \(2560,\)"):
        linear_route(1, "bfloat16", (2560,), CUDA)


def test_linear_takes_the_route_the_rule_names_on_the_cpu() -> None:
    """``route_log`` counts what ``linear`` really ran: the compiled product for a few fp32 rows, OpenBLAS for more
    while it is active, torch under autograd or with it off, a packed weight its own product; outputs agree with the
    reference either way."""
    from edgespec.kernels.cpu import gguf_native

    x, w = torch.randn(3, 64), torch.randn(96, 64)
    L.configure_cpu()
    try:
        with torch.inference_mode(), route_log() as log:
            native = L.linear(x, w)
            blas = L.linear(torch.cat([x, x, x]), w)[:3]
        assert log == ({"native": 1, "blas": 1} if gguf_native.library() is not None else {"blas": 2})
        torch.testing.assert_close(native, blas, rtol=1e-5, atol=1e-5)
        with route_log() as log:
            with torch.enable_grad():
                L.linear(x, w.requires_grad_())
            w.requires_grad_(False)
        assert log == {"torch": 1}
    finally:
        L.configure_cpu(False)
    with torch.inference_mode(), route_log() as log:
        plain = L.linear(x, w)
        L.linear(x, quantize_weight("int4", w))
    # with OpenBLAS off a few fp32 rows still take the compiled product (it does not depend on BLAS)
    assert log == {"native" if gguf_native.library() is not None else "torch": 1, "packed": 1}
    torch.testing.assert_close(blas, plain, rtol=1e-5, atol=1e-5)
    with route_log() as log:
        pass
    assert not log                                          # nothing counted outside a block
