"""Causal GQA attention of T new query rows over a KV cache (decode: T=1, verify: T=K+1, prefill chunks).

``q [T, Hq, hd]`` holds the rows at positions ``start .. start+T-1``; the cache holds keys/values of positions
``0 .. start+T-1`` (the new rows already written). Row i attends to keys ``0 .. start+i``. Query head h reads
KV head h // (Hq / Hkv). The FP8 path reads e4m3 rows and their per-(token, head) scales directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgespec.cache.kv import KVCache
from edgespec.kernels import use_triton

# Above this many query rows on CUDA (prefill chunks), attention runs through torch's fused SDPA kernels; up to it
# (decode, verify, short resumed turns) through edgespec's Triton attention.
TRITON_MAX_ROWS = 32


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                  pos_q: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: ``k, v [L, Hkv, hd]`` dequantised, L >= start+T. Returns ``[T, Hq, hd]`` in q's dtype.

    Query rows are grouped by KV head (``[Hkv, rep*T, hd]``) so each head's keys are used by one batched matmul,
    with no copy of K/V per query head. ``pos_q`` (positions of the rows, a device tensor) replaces ``start``.
    Plain matmul + softmax instead of SDPA: on a small CPU it is about twice as fast for one row and does not
    stall when cores are shared.
    """
    T, Hq, hd = q.shape
    L, Hkv, _ = k.shape
    rep = Hq // Hkv
    qg = q.reshape(T, Hkv, rep, hd).permute(1, 2, 0, 3).reshape(Hkv, rep * T, hd)
    scores = torch.bmm(qg, k.permute(1, 2, 0).to(q.dtype)) * scale                  # [Hkv, rep*T, L]
    if pos_q is None and T == 1 and L == start + 1:
        pass  # a single last row sees every key
    else:
        if pos_q is None:
            pos_q = torch.arange(start, start + T, device=q.device)
        visible = torch.arange(L, device=q.device)[None, :] <= pos_q[:, None]         # [T, L]
        scores = scores.view(Hkv, rep, T, L).masked_fill(~visible, float("-inf")).view(Hkv, rep * T, L)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.bmm(probs, v.transpose(0, 1).to(q.dtype))                            # [Hkv, rep*T, hd]
    return out.view(Hkv, rep, T, hd).permute(2, 0, 1, 3).reshape(T, Hq, hd)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of the rows ``start .. start+T-1`` over ``k, v [start+T, Hkv, hd]`` through torch's fused
    SDPA (flash or memory-efficient kernels on CUDA): no ``[T, L]`` score matrix in memory.

    Why: :func:`attention_ref` materialises fp32 scores, a mask and their copies, which dominated the GPU time of a
    long prefill (tools/step_profile.py --prefill; docs/benchmarks.md, "Design figures (H100)").
    A fresh prompt (``start == 0``) takes the plain causal mask; a later chunk or a resumed turn the lower-right
    aligned one (row i sees keys ``0 .. start+i``). KV heads are repeated to the query heads first (a copy of
    ``2 x L x Hq x hd`` elements, small next to the scores it replaces; not every SDPA kernel takes grouped heads).
    """
    from torch.nn.attention.bias import causal_lower_right
    T, Hq, hd = q.shape
    L, Hkv, _ = k.shape
    rep = Hq // Hkv
    qh = q.transpose(0, 1).unsqueeze(0)                                                # [1, Hq, T, hd]
    kh = k.to(q.dtype).repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0)     # [1, Hq, L, hd]
    vh = v.to(q.dtype).repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0)
    if start == 0 and L == T:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(T, L), scale=scale)
    return out[0].transpose(0, 1)                                                      # [T, Hq, hd]


def cached_attention(q: torch.Tensor, cache: KVCache, start: int, scale: float,
                     pos_t: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q`` over ``cache`` rows ``0 .. start+T-1``. Triton reads FP8 rows in place on CUDA.

    ``pos_t``: the start as a device tensor (CUDA graphs). The torch path then attends over the whole
    preallocated cache with a position mask: shape-static, so capturable, at the cost of reading every row.
    """
    T = q.shape[0]
    if T <= TRITON_MAX_ROWS and use_triton(q):
        from edgespec.kernels.attention.triton_attention import cached_attention_triton
        return cached_attention_triton(q, cache, start, scale, start_t=pos_t)
    if pos_t is None:
        k, v = cache.read(start + T)
        return (prefill_attention if q.is_cuda else attention_ref)(q, k, v, start, scale)
    k, v = cache.read(cache.max_len)
    return attention_ref(q, k, v, 0, scale, pos_q=pos_t + torch.arange(T, device=q.device))
