"""Causal GQA attention of T new query rows over a KV cache (decode: T=1, verify: T=K+1, prefill chunks).

``q [T, Hq, hd]`` holds the rows at positions ``start .. start+T-1``; the cache holds keys/values of positions
``0 .. start+T-1`` (the new rows already written). Row i attends to keys ``0 .. start+i``. Query head h reads
KV head h // (Hq / Hkv). The FP8 path reads e4m3 rows and their per-(token, head) scales directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgespec.cache.kv import KVCache


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Reference: ``k, v [start+T, Hkv, hd]`` already dequantised. Returns ``[T, Hq, hd]`` in q's dtype."""
    T = q.shape[0]
    L = k.shape[0]
    kt, vt = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
    if T == 1:
        # A single row at the end sees every key: no mask needed.
        out = F.scaled_dot_product_attention(q.transpose(0, 1), kt, vt, scale=scale, enable_gqa=True)
    else:
        pos_q = torch.arange(start, start + T, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] <= pos_q[:, None]     # [T, L]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), kt, vt, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
    return out.transpose(0, 1)


def cached_attention(q: torch.Tensor, cache: KVCache, start: int, scale: float,
                     pos_t: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q`` over ``cache`` rows ``0 .. start+T-1``. Triton reads FP8 rows in place on CUDA.

    ``pos_t``: the start as a device tensor (CUDA graphs). The torch path then attends over the whole
    preallocated cache with a position mask: shape-static, so capturable, at the cost of reading every row.
    """
    T = q.shape[0]
    if q.is_cuda:
        from edgespec.kernels import triton_available
        if triton_available() and T <= 32:
            from edgespec.kernels.triton_attention import cached_attention_triton
            return cached_attention_triton(q, cache, start, scale, start_t=pos_t)
    if pos_t is None:
        k, v = cache.read(start + T)
        return attention_ref(q, k, v, start, scale)
    k, v = cache.read(cache.max_len)
    pos_q = pos_t + torch.arange(T, device=q.device)
    mask = torch.arange(cache.max_len, device=q.device)[None, :] <= pos_q[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).to(q.dtype),
                                         v.transpose(0, 1).to(q.dtype), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)
