"""Compiled fp32 CPU versions of the small per-layer steps (``gguf_cpu.c``, built by
``edgespec.kernels.cpu.gguf_native``).

On a small CPU a batch-1 decode step of the demo model runs ~400 torch operations besides its products, each a
few microseconds of dispatch for a few hundred floats of work. The residual add + RMSNorm (6 operations),
SwiGLU (3) and a Llama attention layer (RoPE, K/V cache write, causal GQA attention: ~20) are one call each. Each
returns None where it does not apply (other devices or dtypes, FP8 or blocked caches, q/k norms, gated or partial
layouts, more rows than :data:`edgespec.kernels.quant.route.ROWS_MAX`, no compiler), and the caller runs the torch
reference, which stays the oracle the tests compare these against. Every output row is computed by the same
operations whatever the row count, so verify rows equal decode steps bit for bit.
"""

from __future__ import annotations

import torch

from edgespec.cache.kv import KVCache
from edgespec.kernels.cpu import gguf_native
from edgespec.kernels.quant.route import ROWS_MAX

_MAX_HEAD_DIM = 512   # the C attention keeps one rotated query head on its stack


def _ok(*tensors: torch.Tensor) -> bool:
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
            and not torch.is_grad_enabled() and gguf_native.library() is not None)


def add_rms_norm_cpu(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``s = residual + x`` (``x`` None: ``s = residual``) and ``weight * rmsnorm(s)``; None where not
    applicable (see the module doc)."""
    args = (residual, weight) if x is None else (x, residual, weight)
    if not _ok(*args) or residual.shape[-1] != weight.shape[0] or (x is not None and x.shape != residual.shape):
        return None
    D = residual.shape[-1]
    T = residual.numel() // D if D else 0
    s = residual if x is None else torch.empty_like(residual)
    y = torch.empty_like(residual)
    gguf_native.library().add_rms_norm_f32(None if x is None else x.data_ptr(), residual.data_ptr(),
                                           weight.data_ptr(), eps, T, D, s.data_ptr(), y.data_ptr())
    return s, y


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``gate_up [..., 2I]`` = ``[gate | up]``; None where not applicable."""
    if not _ok(gate_up) or gate_up.shape[-1] % 2:
        return None
    two_i = gate_up.shape[-1]
    out = torch.empty(*gate_up.shape[:-1], two_i // 2)
    gguf_native.library().silu_mul_f32(gate_up.data_ptr(), gate_up.numel() // max(1, two_i), two_i // 2,
                                       out.data_ptr())
    return out


def llama_attention_cpu(qkv: torch.Tensor, cache: KVCache, start: int, cs: tuple[torch.Tensor, torch.Tensor],
                        n_heads: int, n_kv: int, head_dim: int, scale: float) -> torch.Tensor | None:
    """RoPE of q and k, the K/V cache write of rows ``start ..`` and causal GQA attention for the merged
    projection rows ``qkv [T, (n_heads + 2 n_kv) head_dim]``: ``[T, n_heads * head_dim]``, or None where not
    applicable (see the module doc)."""
    cos, sin = cs
    T = qkv.shape[0]
    if (T > ROWS_MAX or cache.fp8 or cache.v_block or head_dim > _MAX_HEAD_DIM or head_dim % 16 or n_heads % n_kv
            or qkv.shape[-1] != (n_heads + 2 * n_kv) * head_dim or cos.shape[-1] % 2 or cos.shape[-1] > head_dim):
        return None
    cos, sin = cos.reshape(T, -1).contiguous(), sin.reshape(T, -1).contiguous()
    if not _ok(qkv, cos, sin, cache.k, cache.v):
        return None
    out = torch.empty(T, n_heads * head_dim)
    rc = gguf_native.library().llama_attention_f32(
        qkv.data_ptr(), T, n_heads, n_kv, head_dim, cos.data_ptr(), sin.data_ptr(), cos.shape[-1], None, None, 0.0,
        cache.k.data_ptr(), cache.v.data_ptr(), start, scale, out.data_ptr(), gguf_native.threads())
    return out if rc == 0 else None
