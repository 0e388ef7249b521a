"""Triton kernels against their pure-torch references, on CUDA (skipped cleanly without a GPU or Triton).

Every check draws fresh random inputs (never zeros), poisons outputs with NaN before the run (in-place state
and slot tensors directly, freshly allocated outputs through the caching allocator), and compares by relative
error ``||out - ref|| / ||ref||``: fp32 paths to ~1e-4, bf16/fp16 paths to 1e-2. State and checkpoint slots
are checked as well as outputs. ``tools/kernel_bench.py`` runs this file before timing.
"""

from __future__ import annotations

import importlib.util
import zlib

import pytest
import torch
from _tools import load_tool

from edgespec.arch.graphs import capture_graph
from edgespec.cache.kv import KVCache
from edgespec.kernels.attention.attention import attention_ref, cached_attention
from edgespec.kernels.pointwise.norm import gated_rms_norm_ref, rms_norm_ref
from edgespec.kernels.recurrent.conv import causal_conv1d_ref
from edgespec.kernels.recurrent.gdn import gdn_chunked_ref, gdn_recurrent_ref

_READY = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _READY, reason="needs a CUDA device and Triton")]

DEV = "cuda"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere gives NaN, which fails every ``<`` check."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def poison_allocator() -> None:
    """Fill freed blocks of torch's caching allocator with NaN so the next outputs start as NaN, not zeros.

    Large (>1 MB) and small allocations come from different pools; poison both. Any element a kernel forgets
    to write then shows up as NaN in the comparison.
    """
    big = [torch.full((64 << 18,), float("nan"), device=DEV) for _ in range(2)]         # 2 x 64 MB
    small = [torch.full((n,), float("nan"), device=DEV)
             for n in (1 << 17, 1 << 14, 1 << 10) for _ in range(16)]
    del big, small


@pytest.fixture(autouse=True)
def _fresh_seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


# ------------------------------------------------------------------------------------------- attention

def make_cache(max_len: int, n_kv: int, hd: int, length: int, dtype: torch.dtype, fp8: bool) -> KVCache:
    """A cache holding ``length`` random rows, with outlier tokens and heads (which FP8 scales absorb)."""
    cache = KVCache(max_len, n_kv, hd, dtype, DEV, fp8=fp8)
    k = torch.randn(length, n_kv, hd, device=DEV)
    v = torch.randn(length, n_kv, hd, device=DEV)
    k[:: 17] *= 8.0
    v[:, 0] *= 0.1
    cache.write(0, k.to(dtype), v.to(dtype))
    return cache


def attention_oracle(q: torch.Tensor, cache: KVCache, start: int, scale: float) -> torch.Tensor:
    """The torch reference in fp32 over exactly the values the kernel reads (dequantised FP8 included)."""
    k, v = cache.read(start + q.shape[0])
    return attention_ref(q.float(), k.float(), v.float(), start, scale)


ATTN_CASES = [
    # (T, Hq, Hkv, hd, start, kv, q dtype)
    (1, 24, 4, 256, 0, "fp8", torch.bfloat16),
    (1, 24, 4, 256, 5000, "fp8", torch.bfloat16),
    (1, 16, 4, 256, 777, "bf16", torch.bfloat16),
    (16, 24, 4, 256, 3000, "fp8", torch.bfloat16),
    (16, 16, 4, 256, 129, "bf16", torch.bfloat16),
    (32, 24, 4, 256, 64, "fp8", torch.bfloat16),
    (7, 32, 8, 128, 1000, "fp8", torch.bfloat16),
    (16, 32, 8, 128, 2047, "bf16", torch.bfloat16),
    (32, 32, 8, 128, 0, "bf16", torch.bfloat16),
    (3, 8, 8, 64, 45, "fp8", torch.float16),
    (5, 9, 3, 64, 300, "fp16", torch.float16),
    (4, 8, 2, 128, 500, "fp32", torch.float32),
    (2, 6, 2, 64, 91, "fp8", torch.float32),
]


@pytest.mark.parametrize("fp16_dot", [0, 1])
@pytest.mark.parametrize("T,n_q,n_kv,hd,start,kv,dtype", ATTN_CASES)
def test_attention_matches_reference(T, n_q, n_kv, hd, start, kv, dtype, fp16_dot) -> None:
    """Against the oracle; bf16 queries over FP8 caches both with bf16 and with fp16 products."""
    from edgespec.kernels.attention.triton_attention import cached_attention_triton
    fp8 = kv == "fp8"
    cache_dtype = {"fp8": dtype, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[kv]
    cache = make_cache(start + T + 50, n_kv, hd, start + T, cache_dtype, fp8)
    q = torch.randn(T, n_q, hd, device=DEV).to(dtype)
    scale = hd ** -0.5
    ref = attention_oracle(q, cache, start, scale)
    poison_allocator()
    out = cached_attention_triton(q, cache, start, scale, config={"FP16_DOT": fp16_dot})
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("n_splits", [1, 3, 64])
def test_attention_split_counts(n_splits: int) -> None:
    """Any split count (including more splits than key tiles: empty splits) gives the same answer."""
    from edgespec.kernels.attention.triton_attention import cached_attention_triton
    T, n_q, n_kv, hd, start = 5, 16, 4, 256, 300
    cache = make_cache(1024, n_kv, hd, start + T, torch.bfloat16, True)
    q = torch.randn(T, n_q, hd, device=DEV, dtype=torch.bfloat16)
    poison_allocator()
    out = cached_attention_triton(q, cache, start, hd ** -0.5, config={"n_splits": n_splits})
    assert rel_err(out, attention_oracle(q, cache, start, hd ** -0.5)) < 1e-2


def test_attention_strided_query_and_dispatcher() -> None:
    """q as the gated-attention view ([q_h | gate_h] per head, chunked) through the public dispatcher."""
    T, n_q, n_kv, hd, start = 4, 16, 4, 256, 123
    cache = make_cache(512, n_kv, hd, start + T, torch.bfloat16, True)
    q, _gate = torch.randn(T, n_q, 2 * hd, device=DEV, dtype=torch.bfloat16).chunk(2, dim=-1)
    assert not q.is_contiguous()
    poison_allocator()
    out = cached_attention(q, cache, start, hd ** -0.5)
    assert rel_err(out, attention_oracle(q, cache, start, hd ** -0.5)) < 1e-2


@pytest.mark.parametrize("fp8,T,config", [
    (True, 4, {}), (False, 4, {}),
    (True, 1, {"GLUON": 1}), (True, 1, {"GLUON": 1, "num_warps": 2, "BLOCK_W": 16}),   # the Gluon decode program
])
def test_attention_start_tensor_and_cuda_graph(fp8: bool, T: int, config: dict) -> None:
    """Capture once with the start in a device tensor, replay at other positions: every replay is right; eager with
    ``start_t`` agrees with eager with the int start (a ``start_t`` grid is sized for the whole cache, so the split
    counts differ)."""
    from edgespec.kernels.attention.triton_attention import cached_attention_triton
    n_q, n_kv, hd, max_len = 24, 4, 256, 4096
    cache = make_cache(max_len, n_kv, hd, max_len, torch.bfloat16, fp8)
    scale = hd ** -0.5
    q = torch.randn(T, n_q, hd, device=DEV, dtype=torch.bfloat16)
    start_t = torch.tensor([17], dtype=torch.int32, device=DEV)
    graph, out = capture_graph(
        lambda: cached_attention_triton(q, cache, 17, scale, start_t=start_t, config=dict(config)), warmups=1)
    for start in (0, 17, 1000, 2500, max_len - T):
        q.copy_(torch.randn_like(q))
        start_t.fill_(start)
        out.fill_(float("nan"))
        graph.replay()
        assert rel_err(out, attention_oracle(q, cache, start, scale)) < 1e-2, start
    start_t.fill_(1234)
    a = cached_attention_triton(q, cache, 0, scale, start_t=start_t, config=dict(config))
    b = cached_attention_triton(q, cache, 1234, scale, config=dict(config))
    assert rel_err(a, b) < 1e-2


# -------------------------------------------------------------------------------------- Gated DeltaNet

def gdn_inputs(T: int, n_k: int, n_v: int, dk: int, dv: int, dtype: torch.dtype):
    """q/k/v as strided views of one fused conv output (as the model passes them), g < 0, beta in (0, 1)."""
    fused = torch.randn(T, 2 * n_k * dk + n_v * dv, device=DEV).to(dtype)
    q = fused[:, : n_k * dk].view(T, n_k, dk)
    k = fused[:, n_k * dk: 2 * n_k * dk].view(T, n_k, dk)
    v = fused[:, 2 * n_k * dk:].view(T, n_v, dv)
    g = -torch.rand(T, n_v, device=DEV) * 0.5 - 0.01
    beta = torch.rand(T, n_v, device=DEV) * 0.9 + 0.05
    state = torch.randn(n_v, dk, dv, device=DEV) * 0.3
    return q, k, v, g, beta, state


GDN_SHAPES = [(16, 48, 128, 128), (16, 16, 128, 128), (2, 4, 64, 32)]


@pytest.mark.parametrize("n_k,n_v,dk,dv", GDN_SHAPES)
@pytest.mark.parametrize("T", [1, 4, 16])
@pytest.mark.parametrize("with_slots", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gdn_recurrent_matches_reference(n_k, n_v, dk, dv, T, with_slots, dtype) -> None:
    from edgespec.kernels.recurrent.triton_gdn import gdn_recurrent_triton
    q, k, v, g, beta, state = gdn_inputs(T, n_k, n_v, dk, dv, dtype)
    s_ref, s_out = state.clone(), state.clone()
    slots_ref = torch.full((T + 2, n_v, dk, dv), float("nan"), device=DEV) if with_slots else None
    slots_out = slots_ref.clone() if with_slots else None
    ref = gdn_recurrent_ref(q, k, v, g, beta, s_ref, slots_ref)
    poison_allocator()
    out = gdn_recurrent_triton(q, k, v, g, beta, s_out, slots_out)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert rel_err(out, ref) < 1e-4
    assert rel_err(s_out, s_ref) < 1e-4
    if with_slots:
        assert rel_err(slots_out[1: T + 1], slots_ref[1: T + 1]) < 1e-4
        assert torch.isnan(slots_out[0]).all() and torch.isnan(slots_out[T + 1]).all()   # not written


@pytest.mark.parametrize("n_k,n_v,dk,dv", [GDN_SHAPES[0], GDN_SHAPES[2]])
@pytest.mark.parametrize("T,chunk", [(1, 64), (63, 64), (64, 64), (65, 64), (300, 64), (100, 32)])
def test_gdn_chunked_matches_reference(n_k, n_v, dk, dv, T, chunk) -> None:
    from edgespec.kernels.recurrent.triton_gdn import gdn_chunked_triton, gdn_recurrent_triton
    q, k, v, g, beta, state = gdn_inputs(T, n_k, n_v, dk, dv, torch.bfloat16)
    s_ref, s_out, s_rec = state.clone(), state.clone(), state.clone()
    ref = gdn_chunked_ref(q, k, v, g, beta, s_ref, chunk)
    poison_allocator()
    out = gdn_chunked_triton(q, k, v, g, beta, s_out, chunk)
    assert rel_err(out, ref) < 1e-4
    assert rel_err(s_out, s_ref) < 1e-4
    rec = gdn_recurrent_triton(q, k, v, g, beta, s_rec)           # the two Triton forms agree too
    assert rel_err(out, rec) < 1e-4
    assert rel_err(s_out, s_rec) < 1e-4


# ------------------------------------------------------------------------------------------------ conv

@pytest.mark.parametrize("C,K", [(10240, 4), (300, 4), (77, 2)])
@pytest.mark.parametrize("T", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_slots", [True, False])
def test_conv_matches_reference(C, K, T, dtype, with_slots) -> None:
    from edgespec.kernels.recurrent.triton_conv import causal_conv1d_triton
    x = torch.randn(T, C, device=DEV).to(dtype)
    state = torch.randn(C, K - 1, device=DEV).to(dtype)
    w = torch.randn(C, K, device=DEV).to(dtype)
    s_ref, s_out = state.clone(), state.clone()
    slots_ref = torch.full((T + 2, C, K - 1), float("nan"), device=DEV, dtype=dtype) if with_slots else None
    slots_out = slots_ref.clone() if with_slots else None
    ref = causal_conv1d_ref(x, s_ref, w, slots_ref)
    poison_allocator()
    out = causal_conv1d_triton(x, s_out, w, slots_out)
    assert out.dtype == ref.dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(s_out, s_ref)
    if with_slots:
        assert torch.equal(slots_out[1: T + 1], slots_ref[1: T + 1])
        assert torch.isnan(slots_out[0]).all()


def test_conv_strided_input() -> None:
    """x as a column slice of a wider activation (row stride != C)."""
    from edgespec.kernels.recurrent.triton_conv import causal_conv1d_triton
    T, C, K = 6, 200, 4
    x = torch.randn(T, C + 56, device=DEV, dtype=torch.bfloat16)[:, 10: 10 + C]
    state = torch.randn(C, K - 1, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(C, K, device=DEV, dtype=torch.bfloat16)
    s_ref, s_out = state.clone(), state.clone()
    ref = causal_conv1d_ref(x, s_ref, w)
    out = causal_conv1d_triton(x, s_out, w)
    assert rel_err(out, ref) < 1e-2 and torch.equal(s_out, s_ref)


# ------------------------------------------------------------------------------------------------ norm

@pytest.mark.parametrize("shape", [(1, 5120), (16, 5120), (16, 48, 128), (3, 1000), (2, 4, 256)])
@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                          (torch.float32, torch.float32)])
@pytest.mark.parametrize("zero_centred", [False, True])
def test_rms_norm_matches_reference(shape, dtype, wdtype, zero_centred) -> None:
    from edgespec.kernels.pointwise.triton_norm import rms_norm_triton
    x = (torch.randn(shape, device=DEV) * 3.0).to(dtype)
    w = (torch.randn(shape[-1], device=DEV) * 0.2 + (0.0 if zero_centred else 1.0)).to(wdtype)
    ref = rms_norm_ref(x, w, 1e-6, zero_centred)
    poison_allocator()
    out = rms_norm_triton(x, w, 1e-6, zero_centred)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert rel_err(out, ref) < (1e-5 if ref.dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("shape", [(1, 48, 128), (16, 48, 128), (5, 3, 64)])
@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.float32)])
def test_gated_rms_norm_matches_reference(shape, dtype, wdtype) -> None:
    from edgespec.kernels.pointwise.triton_norm import gated_rms_norm_triton
    x = torch.randn(shape, device=DEV).to(dtype)
    gate = (torch.randn(shape, device=DEV) * 2.0).to(dtype)
    w = (torch.randn(shape[-1], device=DEV) * 0.2 + 1.0).to(wdtype)
    ref = gated_rms_norm_ref(x, gate, w, 1e-6)
    poison_allocator()
    out = gated_rms_norm_triton(x, gate, w, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_norm_strided_rows() -> None:
    """q_norm runs on the chunked q view of gated attention: non-contiguous rows."""
    from edgespec.kernels.pointwise.triton_norm import rms_norm_triton
    q, _ = torch.randn(4, 16, 512, device=DEV, dtype=torch.bfloat16).chunk(2, dim=-1)
    w = torch.randn(256, device=DEV, dtype=torch.bfloat16) * 0.1
    assert rel_err(rms_norm_triton(q, w, 1e-6, True), rms_norm_ref(q, w, 1e-6, True)) < 1e-2


# ------------------------------------------------------------------------------------------- fused pointwise

@pytest.mark.parametrize("shape", [(1, 5120), (16, 5120), (3, 1000), (2, 4, 256)])
@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                          (torch.float32, torch.float32)])
@pytest.mark.parametrize("zero_centred", [False, True])
def test_add_rms_norm_matches_reference(shape, dtype, wdtype, zero_centred) -> None:
    from edgespec.kernels.pointwise.norm import add_rms_norm_ref
    from edgespec.kernels.pointwise.triton_norm import add_rms_norm_triton
    x = (torch.randn(shape, device=DEV) * 3.0).to(dtype)
    res = (torch.randn(shape, device=DEV) * 3.0).to(dtype)
    w = (torch.randn(shape[-1], device=DEV) * 0.2 + (0.0 if zero_centred else 1.0)).to(wdtype)
    s_ref, y_ref = add_rms_norm_ref(x, res, w, 1e-6, zero_centred)
    poison_allocator()
    s_out, y_out = add_rms_norm_triton(x, res, w, 1e-6, zero_centred)
    assert torch.equal(s_out, s_ref)                  # the residual sum rounds exactly like torch's add
    assert y_out.dtype == y_ref.dtype and y_out.shape == y_ref.shape
    assert rel_err(y_out, y_ref) < (1e-5 if y_ref.dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("shape", [(1, 2 * 9216), (16, 2 * 17408), (3, 2 * 100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_matches_reference(shape, dtype) -> None:
    from edgespec.kernels.pointwise.activation import silu_mul_ref
    from edgespec.kernels.pointwise.triton_activation import silu_mul_triton
    x = (torch.randn(shape, device=DEV) * 3.0).to(dtype)
    ref = silu_mul_ref(x)
    poison_allocator()
    out = silu_mul_triton(x)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("T,H", [(1, 32), (16, 48), (5, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gdn_gates_match_reference(T, H, dtype) -> None:
    from edgespec.kernels.pointwise.activation import gdn_gates_ref
    from edgespec.kernels.pointwise.triton_activation import gdn_gates_triton
    # a, b as strided column views of a merged projection output, as the model passes them
    proj = (torch.randn(T, 3 * H, device=DEV) * 8.0).to(dtype)      # wide spread: both softplus branches
    a, b = proj[:, H:2 * H], proj[:, 2 * H:]
    A_log = torch.rand(H, device=DEV) * 2.7
    dt_bias = torch.randn(H, device=DEV)
    g_ref, beta_ref = gdn_gates_ref(a, b, A_log, dt_bias)
    poison_allocator()
    g, beta = gdn_gates_triton(a, b, A_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32
    assert rel_err(g, g_ref) < 1e-5
    # beta is rounded to b's dtype: a last-bit difference in the fp32 sigmoid can move it by one bf16 step
    assert rel_err(beta, beta_ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_gdn_recurrent_rounds_output_like_a_cast() -> None:
    """``out_dtype=bf16``: the kernel's store rounds o exactly like ``o.to(bf16)`` of the fp32 output."""
    from edgespec.kernels.recurrent.triton_gdn import gdn_recurrent_triton
    q, k, v, g, beta, state = gdn_inputs(4, *GDN_SHAPES[0], torch.bfloat16)
    s1, s2 = state.clone(), state.clone()
    o32 = gdn_recurrent_triton(q, k, v, g, beta, s1)
    o16 = gdn_recurrent_triton(q, k, v, g, beta, s2, out_dtype=torch.bfloat16)
    assert o16.dtype == torch.bfloat16 and torch.equal(o16, o32.to(torch.bfloat16))


# ------------------------------------------------------------------------------------------- GEMV

@pytest.mark.parametrize("n,k", [(2560, 9216), (18432, 2560), (1000, 300), (7, 64), (248320 // 64, 2560)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [None, {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 8, "num_stages": 2}])
def test_gemv_matches_reference(n, k, bias, config) -> None:
    from edgespec.kernels.quant.linear import linear_ref
    from edgespec.kernels.quant.triton_gemv import gemv_triton
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.05
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None
    ref = linear_ref(x.float(), w.float(), None if b is None else b.float())
    poison_allocator()
    out = gemv_triton(x, w, b, config=config)
    assert out.shape == (1, n) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("n,k", [(2560, 9216), (18432, 2560), (1000, 300), (7, 64), (5120, 17408), (576, 1536),
                                 (960, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_matches_reference(m, n, k, bias) -> None:
    """2-16 rows, with and without the K split (narrow matrices), 64- and 32-row tiles (tiny matrices), against the
    fp32 reference; deterministic."""
    from edgespec.kernels.quant.linear import linear_ref
    from edgespec.kernels.quant.triton_gemv import skinny_gemm_triton
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.05
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None
    ref = linear_ref(x.float(), w.float(), None if b is None else b.float())
    poison_allocator()
    out = skinny_gemm_triton(x, w, b)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2
    assert torch.equal(out, skinny_gemm_triton(x, w, b))


@pytest.mark.parametrize("n_out", [3000, 20000])
def test_linear_dispatch(n_out: int) -> None:
    """``linear``: one bf16 row (any leading dims) takes the GEMV; 2-16 rows the skinny GEMM (K split on the narrow
    matrix); more rows cuBLAS. ``route_log`` shows each call took the route named (the one ``linear_route`` gives
    for the device's real facts), and all match the reference."""
    from edgespec.kernels import sm_count, triton_available
    from edgespec.kernels.options import active
    from edgespec.kernels.quant.linear import linear, linear_ref, route_log
    from edgespec.kernels.quant.route import RouteFacts, linear_route, skinny_pays
    w = torch.randn(n_out, 1024, device=DEV, dtype=torch.bfloat16) * 0.05
    b = torch.randn(n_out, device=DEV, dtype=torch.bfloat16)
    facts = RouteFacts(cuda=True, triton=triton_available(), sms=sm_count(w.device), options=active())
    skinny = "skinny" if skinny_pays(n_out, facts.sms) else "cublas"
    cases = [((1, 1024), "gemv"), ((1, 1, 1024), "gemv"), ((1024,), "gemv"), ((5, 1024), skinny),
             ((2, 8, 1024), skinny), ((17, 1024), "cublas"), ((40, 1024), "cublas")]
    with torch.inference_mode():
        for shape, route in cases:
            x = torch.randn(*shape, device=DEV).to(torch.bfloat16)
            rows = x.numel() // 1024
            assert linear_route(rows, "bfloat16", tuple(w.shape), facts) == route, shape
            with route_log() as log:
                out = linear(x, w, b)
            assert log == {route: 1}, (shape, dict(log))
            ref = linear_ref(x.float(), w.float(), b.float())
            assert out.shape == ref.shape and rel_err(out, ref) < 1e-2


# ------------------------------------------------------------------------- q/k norm + RoPE + KV write

def rope_inputs(T: int, n_q: int, n_kv: int, hd: int, rot: int, gated: bool, norm: str, dtype: torch.dtype,
                start: int):
    """A merged qkv projection output, q/k norm weights (``norm``: none / standard / zero-centred) and the
    rotary angles of positions ``start ..`` in ``dtype``, as the model builds them."""
    q_out = n_q * hd * (2 if gated else 1)
    qkv = (torch.randn(T, q_out + 2 * n_kv * hd, device=DEV) * 3.0).to(dtype)
    qkv[:, q_out + n_kv * hd:] *= 0.02                  # small V rows: FP8 subnormals get exercised
    zc = norm == "zero_centred"
    qw = kw = None
    if norm != "none":
        qw = (torch.randn(hd, device=DEV) * 0.3 + (0.0 if zc else 1.0)).to(dtype)
        kw = (torch.randn(hd, device=DEV) * 0.3 + (0.0 if zc else 1.0)).to(dtype)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rot, 2, device=DEV, dtype=torch.float64) / rot))
    freqs = torch.outer(torch.arange(start, start + T, device=DEV, dtype=torch.float64), inv_freq).float()
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    return qkv, qw, kw, zc, (emb.cos().to(dtype), emb.sin().to(dtype))


def random_cache(max_len: int, n_kv: int, hd: int, dtype: torch.dtype, fp8: bool) -> KVCache:
    """A cache full of random rows (the rows around the written ones must stay untouched)."""
    cache = KVCache(max_len, n_kv, hd, dtype, DEV, fp8=fp8)
    cache.write(0, torch.randn(max_len, n_kv, hd, device=DEV).to(dtype),
                torch.randn(max_len, n_kv, hd, device=DEV).to(dtype))
    return cache


def clone_cache(cache: KVCache) -> KVCache:
    twin = KVCache(cache.max_len, cache.k.shape[1], cache.k.shape[2], cache.dtype, DEV, fp8=cache.fp8)
    for name in ("k", "v", "k_scale", "v_scale") if cache.fp8 else ("k", "v"):
        getattr(twin, name).copy_(getattr(cache, name))
    return twin


def assert_bits_close(out: torch.Tensor, ref: torch.Tensor, max_frac: float, what: str) -> None:
    """Bitwise equal, except at most ``max_frac`` of the elements (``max_frac=0``: all). The norm sums its
    squares in another order than torch: rstd may differ in its last bit and move a rare element by one rounding
    step (and with it, through RoPE, its partner channel).

    q is checked by :func:`assert_q_close` instead: on an H200 up to ~12% of the kernel's q elements differ from torch's
    in the last bit, norm or not (first seen there; the CPU interpreter, patched to round like a GPU, matched)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, what
    if out.dtype == torch.float8_e4m3fn:
        out, ref = out.view(torch.uint8), ref.view(torch.uint8)
    differ = (out != ref).sum().item()                  # a NaN (unwritten) element always differs
    assert differ <= max_frac * out.numel(), f"{what}: {differ} of {out.numel()} elements differ"
    if differ:
        assert rel_err(out.float(), ref.float()) < 1e-2, what


def assert_q_close(q: torch.Tensor, q_ref: torch.Tensor, what: str) -> None:
    """q within rounding of the reference: every element written and the relative error of a bf16 path (on an
    H200 10-12% of elements differed from torch's in the last bit, relative error ~1.5e-3; a wrong rotation,
    row or head is O(1)). Decode and verify share this kernel, so the difference cannot split them."""
    assert q.shape == q_ref.shape and q.dtype == q_ref.dtype and torch.isfinite(q).all(), what
    assert rel_err(q, q_ref) < 4e-3, (what, rel_err(q, q_ref))


def check_cache(out: KVCache, ref: KVCache, max_frac: float) -> None:
    """Every row (the written ones and all the others) and every scale, against the reference's cache. k goes
    through the same rotation as q, so it gets q's last-bit allowance (see :func:`assert_bits_close`)."""
    max_frac = max(max_frac, 0.2)
    assert_bits_close(out.k, ref.k, max_frac, "k rows")
    assert_bits_close(out.v, ref.v, 0.0, "v rows")
    if ref.fp8:
        # One k element off by a step can move its row's amax and so the whole row's scale: compare the
        # dequantised rows too.
        assert_bits_close(out.k_scale, ref.k_scale, max_frac, "k scales")
        assert_bits_close(out.v_scale, ref.v_scale, 0.0, "v scales")
        k_out, _ = out.read(out.max_len)
        k_ref, _ = ref.read(ref.max_len)
        assert rel_err(k_out, k_ref) < 4e-3


ROPE_CASES = [
    # (dtype, kv, gated, norm, rotary fraction, hd): Qwen3.5 (gated, zero-centred, partial), Qwen3, Llama, mixes
    (torch.bfloat16, "fp8", True, "zero_centred", 0.25, 256),
    (torch.bfloat16, "model", True, "zero_centred", 0.25, 256),
    (torch.bfloat16, "fp8", False, "standard", 1.0, 128),
    (torch.bfloat16, "model", False, "standard", 1.0, 128),
    (torch.bfloat16, "fp8", False, "none", 1.0, 128),
    (torch.bfloat16, "model", False, "none", 0.5, 256),
    (torch.bfloat16, "model", True, "none", 1.0, 128),
    (torch.bfloat16, "fp8", True, "standard", 0.5, 128),
    # fp16 is not listed: the dispatcher keeps fp16 on the torch path (see edgespec.kernels.attention.rope).
    (torch.bfloat16, "fp8", False, "none", 0.25, 128),
    (torch.bfloat16, "model", True, "none", 1.0, 256),
]


@pytest.mark.parametrize("start_kind", ["int", "tensor"])
@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("dtype,kv,gated,norm,rot_frac,hd", ROPE_CASES)
def test_qk_norm_rope_write_matches_reference(dtype, kv, gated, norm, rot_frac, hd, T, start_kind) -> None:
    """q, the gate view, the written K/V rows (and FP8 scales) and the untouched rest of the cache, against the
    unfused torch sequence on the same inputs. Bitwise without q/k norm; with it, up to a rare last-bit step."""
    from edgespec.kernels.attention.rope import qk_norm_rope_write_ref
    from edgespec.kernels.attention.triton_rope import qk_norm_rope_write_triton
    n_q, n_kv, start, max_len = 8, 2, 37, 96
    qkv, qw, kw, zc, cs = rope_inputs(T, n_q, n_kv, hd, int(hd * rot_frac), gated, norm, dtype, start)
    cache_ref = random_cache(max_len, n_kv, hd, dtype, kv == "fp8")
    cache_out = clone_cache(cache_ref)
    pos_t = torch.tensor([start], device=DEV) if start_kind == "tensor" else None
    args = (n_q, n_kv, hd, gated, qw, kw, 1e-6, zc, pos_t)
    q_ref, gate_ref = qk_norm_rope_write_ref(qkv, cache_ref, start, cs, *args)
    poison_allocator()
    q, gate = qk_norm_rope_write_triton(qkv, cache_out, -1 if pos_t is not None else start, cs, *args)
    assert q.is_contiguous() and q.shape == (T, n_q, hd)
    max_frac = 0.0 if norm == "none" else 1e-3
    assert_q_close(q, q_ref, "q")
    check_cache(cache_out, cache_ref, max_frac)
    if gated:
        assert gate.data_ptr() == gate_ref.data_ptr() and gate.stride() == gate_ref.stride()   # the same view
    else:
        assert gate is None and gate_ref is None


def test_qk_norm_rope_write_dispatcher_and_cuda_graph() -> None:
    """Through the public dispatcher, captured once with the start in a device tensor and replayed at other
    positions (including the last rows of the cache): every replay writes the right rows."""
    from edgespec.kernels.attention.rope import qk_norm_rope_write, qk_norm_rope_write_ref
    T, n_q, n_kv, hd, rot, max_len = 4, 16, 4, 256, 64, 512
    qkv, qw, kw, zc, cs = rope_inputs(T, n_q, n_kv, hd, rot, True, "zero_centred", torch.bfloat16, 0)
    cache = random_cache(max_len, n_kv, hd, torch.bfloat16, True)
    pos_t = torch.tensor([3], dtype=torch.int32, device=DEV)
    args = (n_q, n_kv, hd, True, qw, kw, 1e-6, zc, pos_t)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                       # compile and warm up outside the capture
        qk_norm_rope_write(qkv, cache, 0, cs, *args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, _gate = qk_norm_rope_write(qkv, cache, 0, cs, *args)
    for start in (0, 17, 300, max_len - T):
        fresh, _, _, _, fresh_cs = rope_inputs(T, n_q, n_kv, hd, rot, True, "zero_centred", torch.bfloat16, start)
        qkv.copy_(fresh)
        cs[0].copy_(fresh_cs[0])
        cs[1].copy_(fresh_cs[1])
        pos_t.fill_(start)
        ref_cache = clone_cache(cache)
        q_ref, _ = qk_norm_rope_write_ref(qkv, ref_cache, start, cs, *args[:-1])
        q.fill_(float("nan"))
        graph.replay()
        assert_q_close(q, q_ref, f"q at {start}")
        check_cache(cache, ref_cache, 1e-3)


def test_qk_norm_rope_write_rejects_bad_inputs() -> None:
    from edgespec.kernels.attention.triton_rope import qk_norm_rope_write_triton
    T, n_q, n_kv, hd, rot = 2, 4, 2, 128, 32
    qkv, qw, kw, zc, cs = rope_inputs(T, n_q, n_kv, hd, rot, True, "zero_centred", torch.bfloat16, 5)
    cache = KVCache(64, n_kv, hd, torch.bfloat16, DEV, fp8=True)

    def call(qkv=qkv, cache=cache, start=5, cs=cs, n_q=n_q, gated=True, qw=qw, pos_t=None, zc=zc):
        return qk_norm_rope_write_triton(qkv, cache, start, cs, n_q, n_kv, hd, gated, qw, kw, 1e-6, zc, pos_t)

    call()                                                                              # the good call runs
    for bad, match in [
        (dict(qkv=qkv[:, :-1]), "last dim"),                                            # width does not fit
        (dict(gated=False), "last dim"),                                                # layout does not fit
        (dict(qkv=qkv[None]), r"\[T, q_out"),                                           # not 2-D
        (dict(qkv=qkv.to(torch.int32)), "dtype"),                                       # not floating
        (dict(cs=(cs[0].float(), cs[1].float())), "activation dtype"),                  # angles in fp32
        (dict(cs=(cs[0][:1], cs[1][:1])), "cos"),                                       # angles for 1 row of 2
        (dict(cs=(cs[0][..., :3], cs[1][..., :3])), "rotary_dim"),                      # odd rotary dim
        (dict(qw=qw[:64]), "q_norm"),                                                   # norm weight size
        (dict(qw=qw.float(), zc=False), "activation dtype"),                            # would promote q
        (dict(cache=KVCache(64, n_kv + 1, hd, torch.bfloat16, DEV)), "cache rows"),     # head count
        (dict(start=63), "outside the cache"),                                          # rows past the end
        (dict(start=-1), "outside the cache"),
        (dict(pos_t=torch.tensor([5.0], device=DEV)), "pos_t"),                         # float position
        (dict(pos_t=torch.tensor([5, 6], device=DEV)), "pos_t"),                        # two positions
    ]:
        with pytest.raises(ValueError, match=match):
            call(**bad)


# ------------------------------------------------------------------------------- FP8-KV attention configs

@pytest.mark.parametrize("n_q,n_kv", [(24, 4), (16, 4)])                 # Qwen3.5-27B / -4B heads, hd 256
@pytest.mark.parametrize("T,start", [(1, 1500), (16, 1234)])
def test_fp8_attention_sweep_configs(n_q: int, n_kv: int, T: int, start: int) -> None:
    """Every FP8 configuration the benchmark sweeps (default, the pre-rework one, tiles, warps, stages, splits,
    row blocks, OPAQUE_CVT and V_SCALE variants) against the oracle, also with 1 and 7 splits."""
    from edgespec.kernels.attention.triton_attention import cached_attention_triton
    hd = 256
    cache = make_cache(start + T + 40, n_kv, hd, start + T, torch.bfloat16, True)
    q = torch.randn(T, n_q, hd, device=DEV, dtype=torch.bfloat16)
    ref = attention_oracle(q, cache, start, hd ** -0.5)
    bench = load_tool("kernel_bench")
    for cfg in bench.fp8_sweep_configs(T, n_q // n_kv):
        for extra in ({}, {"n_splits": 1}, {"n_splits": 7}):
            poison_allocator()
            out = cached_attention_triton(q, cache, start, hd ** -0.5, config={**cfg, **extra})
            assert out.shape == q.shape and out.dtype == q.dtype
            err = rel_err(out, ref)
            assert err < TOL[torch.bfloat16], (cfg, extra, err)


def _fp8_oracle_fp32(q: torch.Tensor, cache: KVCache, start: int, scale: float) -> torch.Tensor:
    """As ``attention_oracle`` but dequantised in fp32 (``cache.read`` rounds to the cache dtype, which moves
    large logits by more than the kernel's own error)."""
    n = start + q.shape[0]
    k = cache.k[:n].float() * cache.k_scale[:n, :, None]
    v = cache.v_rows(n).float() * cache.v_scale[:n, :, None]
    return attention_ref(q.float(), k, v, start, scale)


def _per_head_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst relative error over query heads: a head whose values are tiny is judged on its own scale."""
    return max(rel_err(out[:, h], ref[:, h]) for h in range(out.shape[1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 2, 5, 9, 16])
def test_fp8_attention_v_scale_extremes(dtype: torch.dtype, T: int) -> None:
    """fp16 products with v scales far apart: tokens 1e-4x, all-zero rows, a KV head 1e-6x (bf16; fp16: 1e-2x) and one
    1e3x everywhere.
    The "tile" scale fold keeps every head to tolerance on its own scale (the older "rows" form, V rows scaled
    into fp16, loses the 1e-6x head to fp16 subnormals) and never leaves fp16's range."""
    from edgespec.kernels.attention.triton_attention import cached_attention_triton
    n_q, n_kv, hd, start = 24, 4, 256, 700
    cache = KVCache(start + T + 9, n_kv, hd, dtype, DEV, fp8=True)
    k = torch.randn(start + T, n_kv, hd, device=DEV)
    v = torch.randn(start + T, n_kv, hd, device=DEV)
    k[::17] *= 8.0
    v[::23] *= 1e-4
    v[7::31] = 0.0
    v[:, 1] *= 1e-6 if dtype == torch.bfloat16 else 1e-2       # fp16 outputs of a 1e-6x head would be subnormal
    v[:, 3] *= 1e3
    cache.write(0, k.to(dtype), v.to(dtype))
    q = torch.randn(T, n_q, hd, device=DEV).to(dtype)
    ref = _fp8_oracle_fp32(q, cache, start, hd ** -0.5)
    for cfg in ({}, {"OPAQUE_CVT": 0}, {"n_splits": 64}):
        poison_allocator()
        out = cached_attention_triton(q, cache, start, hd ** -0.5, config=cfg)
        assert torch.isfinite(out).all(), cfg
        assert _per_head_err(out, ref) < TOL[dtype], cfg


@pytest.mark.parametrize("T", [1, 3, 8, 16])
def test_fp8_attention_conversion_forms_agree(T: int) -> None:
    """OPAQUE_CVT on (default) and off, V_SCALE "tile" (default) and "rows": the same attention."""
    from edgespec.kernels.attention.triton_attention import cached_attention_triton
    n_q, n_kv, hd, start = 24, 4, 256, 2000
    cache = make_cache(start + T, n_kv, hd, start + T, torch.bfloat16, True)
    q = torch.randn(T, n_q, hd, device=DEV, dtype=torch.bfloat16)
    ref = attention_oracle(q, cache, start, hd ** -0.5)
    outs = [cached_attention_triton(q, cache, start, hd ** -0.5, config=cfg)
            for cfg in ({}, {"OPAQUE_CVT": 0}, {"V_SCALE": "rows"}, {"OPAQUE_CVT": 0, "V_SCALE": "rows"})]
    for out in outs:
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        assert rel_err(out, outs[0]) < 5e-3
    with pytest.raises(ValueError, match="V_SCALE"):
        cached_attention_triton(q, cache, start, hd ** -0.5, config={"V_SCALE": "p"})   # fp16 products: unsafe


@pytest.mark.parametrize("T,start", [(1, 0), (1, 2047), (1, 4000), (5, 1234), (16, 3001)])
def test_fp8_v_layouts_give_the_same_attention(T: int, start: int) -> None:
    """The key-blocked, transposed V (default) and the key-major V hold the same rows and give the same attention,
    at lengths that end inside a 16-key group, a block and a split, for the decode and the verify launches."""
    from edgespec.kernels.attention.triton_attention import cached_attention_triton
    n_q, n_kv, hd = 24, 4, 256
    blocked = make_cache(start + T + 50, n_kv, hd, start + T, torch.bfloat16, True)
    junk = 300.0 * torch.randn(20, n_kv, hd, device=DEV, dtype=torch.bfloat16)    # rows of a rolled-back draft
    blocked.write(start + T, junk, junk)
    from edgespec.bench.kernel_timing import key_major_twin
    rows = key_major_twin(blocked)
    q = torch.randn(T, n_q, hd, device=DEV, dtype=torch.bfloat16)
    ref = attention_oracle(q, blocked, start, hd ** -0.5)
    a = cached_attention_triton(q, blocked, start, hd ** -0.5)
    b = cached_attention_triton(q, rows, start, hd ** -0.5)
    assert rel_err(a, ref) < TOL[torch.bfloat16] and rel_err(b, ref) < TOL[torch.bfloat16]
    assert rel_err(a, b) < 1e-3
