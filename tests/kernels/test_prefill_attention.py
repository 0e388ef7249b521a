"""The SDPA prefill attention (``edgespec.kernels.attention.attention.prefill_attention``) against the plain reference,
for a fresh prompt (causal) and for later chunks and resumed turns (lower-right causal), with grouped KV heads;
on CPU in fp32 and, where there is a GPU, in bf16 through the fused kernels it is there for."""

from __future__ import annotations

import pytest
import torch
from _devices import DEVICES

from edgespec.kernels.attention.attention import attention_ref, cached_attention, prefill_attention


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,start,hq,hkv,hd", [(40, 0, 8, 2, 64), (40, 17, 8, 2, 64), (200, 300, 4, 4, 128),
                                               (33, 0, 6, 1, 128)])
def test_prefill_attention_matches_reference(device: str, T: int, start: int, hq: int, hkv: int, hd: int) -> None:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(T + start)
    q = torch.randn(T, hq, hd, generator=g).to(device, dtype)
    k = torch.randn(start + T, hkv, hd, generator=g).to(device, dtype)
    v = torch.randn(start + T, hkv, hd, generator=g).to(device, dtype)
    out = prefill_attention(q, k, v, start, hd ** -0.5)
    ref = attention_ref(q.float(), k.float(), v.float(), start, hd ** -0.5)
    assert out.shape == (T, hq, hd) and out.dtype == dtype
    tol = 1e-5 if device == "cpu" else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fp8", [False, True])
def test_cached_attention_takes_sdpa_for_long_chunks(fp8: bool) -> None:
    """Through the cache (model-dtype and FP8 KV): a 100-row chunk after 50 cached rows equals the reference over
    the same (dequantised) rows."""
    from edgespec.cache.kv import KVCache
    cache = KVCache(256, 2, 64, torch.bfloat16, torch.device("cuda"), fp8=fp8)
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(150, 2, 64, device="cuda", generator=g).bfloat16()
    v = torch.randn(150, 2, 64, device="cuda", generator=g).bfloat16()
    cache.write(0, k, v)
    q = torch.randn(100, 8, 64, device="cuda", generator=g).bfloat16()
    out = cached_attention(q, cache, 50, 0.125)
    kr, vr = cache.read(150)
    ref = attention_ref(q.float(), kr.float(), vr.float(), 50, 0.125)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
