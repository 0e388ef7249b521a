"""CPU checks of the pure-torch kernel references against naive loops written independently of them.

The references are the oracles the Triton kernels are tested against (``tests/kernels/test_kernels_gpu.py``), so they
get their own checks: GDN chunked == recurrent == an explicit float64 loop, conv == ``F.conv1d`` over the
whole sequence, attention == a per-row softmax loop (GQA, start > 0), FP8 KV round trip within e4m3's error
bound. Every input is fresh random data (never zeros), and outputs/slots are poisoned with NaN before each
run.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from edgespec.cache.kv import FP8_MAX, KVCache, dequantize_fp8, quantize_fp8
from edgespec.kernels.attention.attention import attention_ref, cached_attention
from edgespec.kernels.pointwise.norm import gated_rms_norm_ref, rms_norm_ref
from edgespec.kernels.recurrent.conv import causal_conv1d_ref
from edgespec.kernels.recurrent.gdn import gdn_chunked_ref, gdn_recurrent_ref
from edgespec.kernels.recurrent.gdn_common import triton_chunk_ok


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere makes it NaN (which fails every ``<`` check)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


# -------------------------------------------------------------------------------------- Gated DeltaNet

def gdn_inputs(T: int, n_k: int, n_v: int, dk: int, dv: int, seed: int, dtype: torch.dtype = torch.float32):
    """Random q/k/v as strided views of one fused ``[T, conv_dim]`` tensor (as the model produces them)."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(T, 2 * n_k * dk + n_v * dv, generator=gen).to(dtype)
    q = fused[:, : n_k * dk].view(T, n_k, dk)
    k = fused[:, n_k * dk: 2 * n_k * dk].view(T, n_k, dk)
    v = fused[:, 2 * n_k * dk:].view(T, n_v, dv)
    g = -torch.rand(T, n_v, generator=gen) * 0.7 - 0.01           # log decay < 0
    beta = torch.rand(T, n_v, generator=gen) * 0.9 + 0.05
    state = torch.randn(n_v, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


def gdn_naive(q, k, v, g, beta, state):
    """The recurrence written out per head and step in float64, straight from the model's definition."""
    T, n_k, dk = q.shape
    n_v = v.shape[1]
    S = state.double().clone()
    out = torch.empty(T, n_v, v.shape[2], dtype=torch.float64)
    states = []
    for t in range(T):
        for j in range(n_v):
            hk = j // (n_v // n_k)
            qt = q[t, hk].double()
            kt = k[t, hk].double()
            qt = qt / torch.sqrt((qt * qt).sum() + 1e-6) / math.sqrt(dk)
            kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
            S[j] *= math.exp(float(g[t, j]))
            delta = float(beta[t, j]) * (v[t, j].double() - S[j].T @ kt)
            S[j] += torch.outer(kt, delta)
            out[t, j] = S[j].T @ qt
        states.append(S.clone())
    return out, S, states


@pytest.mark.parametrize("n_k,n_v", [(2, 2), (2, 4)])
def test_gdn_recurrent_matches_naive_loop(n_k: int, n_v: int) -> None:
    T, dk, dv = 7, 16, 8
    q, k, v, g, beta, state = gdn_inputs(T, n_k, n_v, dk, dv, seed=1)
    ref_o, ref_s, ref_states = gdn_naive(q, k, v, g, beta, state)
    s = state.clone()
    slots = torch.full((T + 2, n_v, dk, dv), float("nan"))
    o = gdn_recurrent_ref(q, k, v, g, beta, s, slots)
    assert rel_err(o, ref_o) < 1e-5
    assert rel_err(s, ref_s) < 1e-5
    for t in range(T):
        assert rel_err(slots[t + 1], ref_states[t]) < 1e-5
    assert torch.isnan(slots[0]).all() and torch.isnan(slots[T + 1]).all()   # untouched


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("chunk", [64, 16])
def test_gdn_chunked_equals_recurrent(T: int, chunk: int) -> None:
    q, k, v, g, beta, state = gdn_inputs(T, 2, 4, 32, 16, seed=T + chunk)
    s_rec, s_chk = state.clone(), state.clone()
    o_rec = gdn_recurrent_ref(q, k, v, g, beta, s_rec)
    o_chk = gdn_chunked_ref(q, k, v, g, beta, s_chk, chunk)
    assert rel_err(o_chk, o_rec) < 1e-4
    assert rel_err(s_chk, s_rec) < 1e-4


def test_gdn_chunked_strong_decay_and_parallel_keys() -> None:
    """Near-parallel keys and strong decay stress the triangular solve and the decay ratios."""
    T = 130
    q, k, v, g, beta, state = gdn_inputs(T, 1, 2, 16, 16, seed=7)
    k = (k[:1].expand(T, -1, -1) + 0.01 * k).contiguous()              # all keys nearly equal
    g = g * 20.0                                                         # decay down to exp(-14) per step
    s_rec, s_chk = state.clone(), state.clone()
    o_rec = gdn_recurrent_ref(q, k, v, g, beta, s_rec)
    o_chk = gdn_chunked_ref(q, k, v, g, beta, s_chk, 64)
    assert torch.isfinite(o_chk).all()
    assert rel_err(o_chk, o_rec) < 1e-4
    assert rel_err(s_chk, s_rec) < 1e-4


def test_chunked_gdn_goes_to_triton_only_at_its_chunk_sizes() -> None:
    """The dispatcher hands the Triton chunked form powers of two in [16, 128] only (others take the reference);
    the Triton form itself names any other chunk instead of answering."""
    assert [c for c in (0, 8, 16, 48, 64, 128, 256) if triton_chunk_ok(c)] == [16, 64, 128]
    pytest.importorskip("triton")
    from edgespec.kernels.recurrent.triton_gdn import gdn_chunked_triton
    q, k, v, g, beta, state = gdn_inputs(5, 1, 2, 16, 16, seed=3)
    with pytest.raises(ValueError, match="power-of-two chunk in \\[16, 128\\], got 48"):
        gdn_chunked_triton(q, k, v, g, beta, state, 48)


# ------------------------------------------------------------------------------------------------ conv

@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_conv_ref_matches_full_sequence_conv(K: int, dtype: torch.dtype) -> None:
    """Two consecutive calls (T0 then T1 rows) equal one F.conv1d over the zero-padded whole sequence."""
    C, T0, T1 = 12, 5, 9
    gen = torch.Generator().manual_seed(K)
    x = torch.randn(T0 + T1, C, generator=gen).to(dtype)
    w = torch.randn(C, K, generator=gen).to(dtype)
    full = F.silu(F.conv1d(F.pad(x.t(), (K - 1, 0)).unsqueeze(0), w.unsqueeze(1), groups=C)[0]).t()
    state = torch.zeros(C, K - 1, dtype=dtype)
    slots = torch.full((T1 + 1, C, K - 1), float("nan"), dtype=dtype)
    out0 = causal_conv1d_ref(x[:T0], state, w)
    assert torch.equal(state, x[T0 - (K - 1): T0].t())
    out1 = causal_conv1d_ref(x[T0:], state, w, slots)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert rel_err(torch.cat([out0, out1]), full) < tol
    assert torch.equal(state, x[-(K - 1):].t())
    for t in range(T1):                      # slot t+1 = the K-1 inputs ending at row T0+t
        end = T0 + t + 1
        assert torch.equal(slots[t + 1], x[end - (K - 1): end].t())


# ------------------------------------------------------------------------------------------- attention

def attention_naive(q, k, v, start, scale):
    """Per query row and head: softmax over keys 0..start+i of the head's KV group, in float64."""
    T, n_q, hd = q.shape
    n_kv = k.shape[1]
    out = torch.empty(T, n_q, hd, dtype=torch.float64)
    for i in range(T):
        for h in range(n_q):
            kh = h // (n_q // n_kv)
            keys = k[: start + i + 1, kh].double()
            s = (keys @ q[i, h].double()) * scale
            p = torch.softmax(s, dim=0)
            out[i, h] = p @ v[: start + i + 1, kh].double()
    return out


@pytest.mark.parametrize("T,start,n_q,n_kv",
                         [(1, 0, 4, 4), (1, 9, 6, 2), (5, 0, 4, 2), (4, 11, 8, 2), (3, 6, 3, 1)])
def test_attention_ref_matches_naive(T: int, start: int, n_q: int, n_kv: int) -> None:
    hd = 16
    gen = torch.Generator().manual_seed(100 * T + start)
    q = torch.randn(T, n_q, hd, generator=gen)
    k = torch.randn(start + T, n_kv, hd, generator=gen)
    v = torch.randn(start + T, n_kv, hd, generator=gen)
    scale = hd ** -0.5
    assert rel_err(attention_ref(q, k, v, start, scale), attention_naive(q, k, v, start, scale)) < 1e-5


@pytest.mark.parametrize("fp8", [False, True])
def test_cached_attention_cpu_path(fp8: bool) -> None:
    """The CPU dispatcher reads the cache (dequantised when FP8) and matches the naive loop on those rows."""
    T, start, n_q, n_kv, hd = 3, 20, 8, 2, 32
    gen = torch.Generator().manual_seed(5)
    cache = KVCache(64, n_kv, hd, torch.float32, "cpu", fp8=fp8)
    rows = (start + T, n_kv, hd)
    cache.write(0, torch.randn(rows, generator=gen), torch.randn(rows, generator=gen))
    q = torch.randn(T, n_q, hd, generator=gen)
    k, v = cache.read(start + T)
    out = cached_attention(q, cache, start, hd ** -0.5)
    assert rel_err(out, attention_naive(q, k, v, start, hd ** -0.5)) < 1e-5


# ---------------------------------------------------------------------------------------------- FP8 KV

def test_fp8_round_trip_error_bound() -> None:
    """e4m3 keeps 3 mantissa bits: per element |x - dq(q(x))| <= 2^-4 |x| for normals, plus scale*2^-10 below
    e4m3's smallest normal (2^-6 in scaled units). Each (token, head) row's amax is exactly representable."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(50, 4, 64, generator=gen) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 2, 5] = 1e4                                                     # an outlier must not hurt other rows
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (50, 4)
    dq = dequantize_fp8(q, scale, torch.float32)
    err = (dq - x).abs()
    bound = x.abs() * 2.0 ** -4 + scale[..., None] * 2.0 ** -10 + 1e-30
    assert (err <= bound).all()
    amax = x.abs().amax(-1)
    assert torch.allclose(dq.abs().amax(-1), amax, rtol=1e-6)
    assert (q.float().abs().amax(-1) <= FP8_MAX).all()
    assert rel_err(dq, x) < 0.04


def test_fp8_zero_rows_stay_finite() -> None:
    x = torch.randn(3, 2, 8)
    x[1, 0] = 0.0
    q, scale = quantize_fp8(x)
    dq = dequantize_fp8(q, scale, torch.float32)
    assert torch.isfinite(dq).all() and (dq[1, 0] == 0).all()


# ------------------------------------------------------------------------------------------------ norm

def test_rms_norm_refs_match_formula() -> None:
    """float64 inputs: the references normalise in fp32 by design, so agreement is to fp32 rounding."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 3, 32, generator=gen, dtype=torch.float64)
    w = torch.randn(32, generator=gen, dtype=torch.float64)
    gate = torch.randn(5, 3, 32, generator=gen, dtype=torch.float64)
    xn = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    assert rel_err(rms_norm_ref(x, w, 1e-6, False), xn * w) < 1e-6
    assert rel_err(rms_norm_ref(x, w, 1e-6, True), xn * (1 + w)) < 1e-6
    assert rel_err(gated_rms_norm_ref(x, gate, w, 1e-6), xn * w * gate * torch.sigmoid(gate)) < 1e-6


def test_gdn_tile_overrides_are_checked() -> None:
    """EDGESPEC_GDN_BLOCK_V (a power of two >= 4) and EDGESPEC_GDN_WARPS (1, 2, 4, 8) are tuning overrides of the
    recurrent GDN launch; anything else is refused by name, and unset they leave the default."""
    pytest.importorskip("triton")
    from edgespec.config import load_settings
    from edgespec.kernels.options import KernelOptions
    from edgespec.kernels.recurrent.triton_gdn import gdn_tile

    def env(**values: str) -> KernelOptions:
        environ = {f"EDGESPEC_{k.upper()}": v for k, v in values.items()}
        return KernelOptions.from_settings(load_settings(environ=environ))

    default = gdn_tile(128, env())
    assert gdn_tile(128, env(gdn_block_v="64"))[0] == 64 and gdn_tile(32, env(gdn_block_v="64"))[0] == 32
    for bad in ("48", "2", "abc", "-16"):
        with pytest.raises(ValueError, match="gdn_block_v"):
            gdn_tile(128, env(gdn_block_v=bad))
    assert gdn_tile(128, env(gdn_warps="2"))[1] == 2
    for bad in ("3", "16", "x"):
        with pytest.raises(ValueError, match="gdn_warps"):
            gdn_tile(128, env(gdn_warps=bad))
    assert gdn_tile(128, env()) == default == gdn_tile(128)


def test_skinny_routing_override_is_checked() -> None:
    """EDGESPEC_SKINNY (an A/B override of which 2-16-row products skip cuBLAS): ``all`` (the default) sends every
    matrix to the skinny GEMM, ``wide`` only those with at least one 64-row block per SM; anything else is refused
    by name rather than silently taken as the default."""
    from edgespec.config import load_settings
    from edgespec.kernels.options import KernelOptions
    from edgespec.kernels.quant.route import skinny_pays

    def env(mode: str | None) -> KernelOptions:
        environ = {} if mode is None else {"EDGESPEC_SKINNY": mode}
        return KernelOptions.from_settings(load_settings(environ=environ))

    assert skinny_pays(2560, 132, env(None)) and skinny_pays(248320, 132, env(None))
    assert skinny_pays(2560, 132, env("all"))
    assert not skinny_pays(2560, 132, env("wide")) and skinny_pays(248320, 132, env("wide"))
    for bad in ("narrow", "", "WIDE"):
        with pytest.raises(ValueError, match="skinny"):
            skinny_pays(2560, 132, env(bad))
