"""The compiled CPU step helpers (edgespec.kernels.cpu.cpu_step) against their torch references."""

from __future__ import annotations

import pytest
import torch

from edgespec.cache.kv import KVCache
from edgespec.kernels.attention.attention import attention_ref
from edgespec.kernels.attention.rope import rope_ref, split_qkv
from edgespec.kernels.cpu import gguf_native
from edgespec.kernels.cpu.cpu_step import add_rms_norm_cpu, llama_attention_cpu, silu_mul_cpu
from edgespec.kernels.pointwise.activation import silu_mul_ref
from edgespec.kernels.pointwise.norm import add_rms_norm_ref, rms_norm_ref

pytestmark = pytest.mark.skipif(gguf_native.library() is None, reason="the compiled helpers cannot be built here")


@torch.inference_mode()
def test_add_rms_norm_matches_reference() -> None:
    x, r, w = torch.randn(5, 72), torch.randn(5, 72), torch.randn(72)
    s, y = add_rms_norm_cpu(x, r, w, 1e-5)
    s_ref, y_ref = add_rms_norm_ref(x, r, w, 1e-5, False)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    _, y1 = add_rms_norm_cpu(None, r, w, 1e-5)
    torch.testing.assert_close(y1, rms_norm_ref(r, w, 1e-5, False), rtol=1e-5, atol=1e-6)
    assert torch.equal(add_rms_norm_cpu(x[2:3], r[2:3], w, 1e-5)[1], y[2:3])   # row-count independent
    assert add_rms_norm_cpu(x.double(), r.double(), w.double(), 1e-5) is None


@torch.inference_mode()
def test_silu_mul_matches_reference() -> None:
    gate_up = torch.randn(3, 2 * 48) * 4
    out = silu_mul_cpu(gate_up)
    torch.testing.assert_close(out, silu_mul_ref(gate_up), rtol=1e-5, atol=1e-6)
    assert torch.equal(silu_mul_cpu(gate_up[1:2]), out[1:2])
    assert silu_mul_cpu(torch.randn(2, 5)) is None


@torch.inference_mode()
@pytest.mark.parametrize("start", [0, 37])
def test_llama_attention_matches_reference(start: int) -> None:
    H, Hkv, hd, T = 6, 2, 32, 5
    angles = torch.randn(start + T, hd // 2)
    cos_all, sin_all = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    cs = (cos_all[start:, None], sin_all[start:, None])
    prefix_k, prefix_v = torch.randn(start, Hkv, hd), torch.randn(start, Hkv, hd)
    qkv = torch.randn(T, (H + 2 * Hkv) * hd)

    ours, ref = KVCache(64, Hkv, hd, torch.float32, "cpu"), KVCache(64, Hkv, hd, torch.float32, "cpu")
    for cache in (ours, ref):
        cache.write(0, prefix_k, prefix_v)
    out = llama_attention_cpu(qkv, ours, start, cs, H, Hkv, hd, hd ** -0.5)
    q, k, v, _ = split_qkv(qkv, H, Hkv, hd, False)
    ref.write(start, rope_ref(k, *cs), v)
    want = attention_ref(rope_ref(q, *cs), *ref.read(start + T), start, hd ** -0.5).reshape(T, H * hd)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.k, ref.k, rtol=1e-6, atol=1e-6)
    assert torch.equal(ours.v, ref.v)
    # one row at a time gives the same rows bit for bit (decode == verify)
    single = KVCache(64, Hkv, hd, torch.float32, "cpu")
    single.write(0, prefix_k, prefix_v)
    for t in range(T):
        row = llama_attention_cpu(qkv[t:t + 1].contiguous(), single, start + t,
                                  (cs[0][t:t + 1], cs[1][t:t + 1]), H, Hkv, hd, hd ** -0.5)
        assert torch.equal(row[0], out[t]), t


def test_llama_attention_declines_what_it_does_not_cover() -> None:
    fp8 = KVCache(16, 2, 32, torch.float32, "cpu", fp8=True)
    cs = (torch.ones(1, 1, 32), torch.zeros(1, 1, 32))
    with torch.inference_mode():
        assert llama_attention_cpu(torch.randn(1, 10 * 32), fp8, 0, cs, 6, 2, 32, 1.0) is None
        plain = KVCache(16, 2, 32, torch.float32, "cpu")
        assert llama_attention_cpu(torch.randn(9, 10 * 32), plain, 0, cs, 6, 2, 32, 1.0) is None   # > ROWS_MAX
