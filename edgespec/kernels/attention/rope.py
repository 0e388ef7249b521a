"""The attention prologue: split the merged q/k/v projection, per-head q/k RMSNorm, NeoX RoPE, KV-cache write.

Between the qkv GEMV and the attention kernel, torch runs ~19 small kernels per layer (the gated q/gate split
copy, two norms, rotate-half with its cats and products, the cache scatter and the FP8 quantisation), all
launches and latency (docs/benchmarks.md, "Design figures").
:func:`qk_norm_rope_write` does it in one Triton launch on CUDA (:mod:`edgespec.kernels.attention.triton_rope`).

The torch reference below is composed from the model's own pieces (``rms_norm_ref``, the rotate-half of
:class:`~edgespec.models.layers.RotaryEmbedding`, :meth:`KVCache.write`), so its maths and rounding are the
unfused model's by construction; the CPU path runs it.

:func:`head_norm_rope` is the general "RMSNorm the first n heads, each by its own weight, then rotate" op of the
DFlash drafter (its block q|k heads, and every drafter layer's context keys stacked ``[layers, T, Hkv, hd]``):
~7 torch launches per call before, one Triton launch on CUDA. Its reference :func:`head_norm_rope_ref` is the
unit-weight-norm-then-product sequence the drafter ran, bit for bit.
"""

from __future__ import annotations

import torch

from edgespec.cache.kv import KVCache
from edgespec.kernels import use_triton
from edgespec.kernels.attention.rope_checks import check_head_norm_rope
from edgespec.kernels.pointwise.norm import rms_norm_ref


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX (rotate-half) RoPE of ``x [T, H, hd]`` over its first ``rotary_dim = cos.shape[-1]`` channels.

    ``cos, sin [T, 1, rotary_dim]`` in x's dtype (from ``RotaryEmbedding.angles``; ``RotaryEmbedding.forward``
    calls this). In bf16 each product rounds to bf16 and then their sum does.
    """
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    half = d // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def split_qkv(qkv: torch.Tensor, n_heads: int, n_kv: int, head_dim: int, gated: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Views ``q [T, Hq, hd]``, ``k, v [T, Hkv, hd]`` and (gated) ``gate [T, Hq, hd]`` of the merged projection.

    Gated (Qwen3.5) ``q_proj`` emits ``[q_h | gate_h]`` per head, so q and gate are strided views.
    """
    T = qkv.shape[0]
    q_out = n_heads * head_dim * (2 if gated else 1)
    q, k, v = qkv.split([q_out, n_kv * head_dim, n_kv * head_dim], dim=-1)
    gate = None
    if gated:
        q, gate = q.view(T, n_heads, 2 * head_dim).chunk(2, dim=-1)
    return (q.reshape(T, n_heads, head_dim), k.reshape(T, n_kv, head_dim), v.reshape(T, n_kv, head_dim), gate)


def qk_norm_rope_write_ref(qkv: torch.Tensor, cache: KVCache, start: int, cs: tuple[torch.Tensor, torch.Tensor],
                           n_heads: int, n_kv: int, head_dim: int, gated: bool,
                           q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                           eps: float = 1e-6, zero_centred: bool = False, pos_t: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference of :func:`qk_norm_rope_write`: the unfused sequence the attention layer ran before."""
    q, k, v, gate = split_qkv(qkv, n_heads, n_kv, head_dim, gated)
    if q_norm is not None:
        q = rms_norm_ref(q, q_norm, eps, zero_centred)
    if k_norm is not None:
        k = rms_norm_ref(k, k_norm, eps, zero_centred)
    cos, sin = cs
    q = rope_ref(q, cos, sin)
    k = rope_ref(k, cos, sin)
    cache.write(start, k, v, pos_t)
    return q, gate


def qk_norm_rope_write(qkv: torch.Tensor, cache: KVCache, start: int, cs: tuple[torch.Tensor, torch.Tensor],
                       n_heads: int, n_kv: int, head_dim: int, gated: bool,
                       q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                       eps: float = 1e-6, zero_centred: bool = False, pos_t: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From the merged projection output ``qkv [T, q_out + 2 * n_kv * head_dim]`` of rows at positions
    ``start .. start+T-1`` (or ``pos_t[0] ..``, a one-element device tensor, for CUDA graphs):

    * K (normed by ``k_norm`` when given, then rotated) and V are written to ``cache`` rows of those positions
      (FP8 caches: quantised with one scale per (token, head), exactly as :meth:`KVCache.write` does);
    * returns ``(q, gate)``: q normed by ``q_norm`` and rotated, ``[T, n_heads, head_dim]``; the gate (gated
      attention only, else None) as an untouched strided view of ``qkv``.

    ``cs``: ``(cos, sin) [T, 1, rotary_dim]`` in qkv's dtype from :meth:`RotaryEmbedding.angles`; channels past
    ``rotary_dim`` pass unrotated (partial RoPE). ``zero_centred``: norms scale by ``1 + w`` (Qwen3.5), else by
    ``w`` (Qwen3); Llama passes no norm weights. One Triton launch on CUDA for bf16 activations, the torch
    reference elsewhere. Not bit-identical to the torch sequence on a GPU: on an H200 up to ~12% of the q
    elements differ in the last bit (relative error ~1.5e-3), which is harmless for speculative parity because
    decode and verify both run this kernel; fp16 stays on the torch path (the kernel is checked on GPUs in bf16).
    """
    if qkv.dtype == torch.bfloat16 and use_triton(qkv):
        from edgespec.kernels.attention.triton_rope import qk_norm_rope_write_triton
        return qk_norm_rope_write_triton(qkv, cache, start, cs, n_heads, n_kv, head_dim, gated, q_norm, k_norm,
                                         eps, zero_centred, pos_t)
    return qk_norm_rope_write_ref(qkv, cache, start, cs, n_heads, n_kv, head_dim, gated, q_norm, k_norm, eps,
                                  zero_centred, pos_t)


def head_norm_rope_ref(x: torch.Tensor, n: int, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """Reference of :func:`head_norm_rope`: the sequence the DFlash drafter ran before (``_head_rms_norm`` then
    ``RotaryEmbedding.forward``). A unit-weight RMSNorm of all heads leaves ``x̂`` rounded to x's dtype exactly
    where ``RMSNorm`` multiplies by its weight (``1 * x̂`` is exact), so ``x̂ * w`` rounds like ``RMSNorm(w)``."""
    w3 = check_head_norm_rope(x, n, weight, cos, sin)
    unit = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    w = w3[:, None] if x.dim() == 4 else w3[0]      # [Bw, 1, nw, hd] vs [B, T, n, hd]; [nw, hd] vs [T, n, hd]
    y = rms_norm_ref(x, unit, eps, False)[..., :n, :] * w
    T, rot = x.shape[-3], cos.shape[-1]
    return rope_ref(y, cos.reshape(T, 1, rot), sin.reshape(T, 1, rot))


def head_norm_rope(x: torch.Tensor, n: int, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """RMSNorm (``w * x̂``, Qwen3 style, not zero-centred) of the first ``n`` heads of ``x``, each by its own
    weight, then NeoX RoPE: returns a fresh contiguous ``[T, n, hd]`` (``[B, T, n, hd]``) in x's dtype.

    * ``x``: ``[T, H_all, hd]`` or ``[B, T, H_all, hd]``, any strides (with a unit inner one, e.g. a view of a
      merged projection output, the kernel reads it in place); heads past ``n`` are ignored.
    * ``weight`` (``Bw`` is B or 1, ``nw`` is n or 1; a 3-D x counts as B = 1): ``[hd]`` for every head,
      ``[nw, hd]`` per head, ``[Bw, nw, hd]`` per leading index and head, or the torch-broadcast form
      ``[Bw, 1, nw, hd]`` (e.g. the drafter's per-layer ``[L, 1, 1, hd]``). Its dtype must not promote x's.
    * ``cos, sin``: ``[T, 1, rotary_dim]`` (from :meth:`~edgespec.models.layers.RotaryEmbedding.angles`) or
      ``[T, rotary_dim]`` in x's dtype; rotary_dim even and at most hd, the channels past it pass unrotated.

    One Triton launch on CUDA for bf16, the torch reference elsewhere; ValueError on inputs that do not fit.
    On a GPU the kernel's rstd may differ from torch's in its last bit (another summation order), moving a rare
    element by one rounding step. fp16 stays on the torch path (the kernel is checked on GPUs in bf16).
    """
    if x.dtype == torch.bfloat16 and use_triton(x):
        from edgespec.kernels.attention.triton_rope import head_norm_rope_triton
        return head_norm_rope_triton(x, n, weight, cos, sin, eps)
    return head_norm_rope_ref(x, n, weight, cos, sin, eps)
