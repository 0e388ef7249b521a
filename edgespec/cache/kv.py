"""Preallocated KV cache of one full-attention layer, in the model dtype or FP8 e4m3 with per-token-head scales.

The buffers are sized to ``max_len`` at start-up and never reallocated: a decode step, a verify of K+1 rows and
a rollback touch only rows of the existing tensors. Truncation is O(1) because the valid length lives in the
owning :class:`~edgespec.cache.model_cache.ModelCache`, not here.

FP8 layout: ``k``/``v`` are ``float8_e4m3fn [max_len, n_kv_heads, head_dim]`` and ``k_scale``/``v_scale`` are
``float32 [max_len, n_kv_heads]``. Each (token, head) vector is scaled by its own amax / 448 before the cast, so
outlier heads and tokens keep their precision (FlashRT fixes one scale at 1.0, which clips and underflows).
Rows are quantised once, when written, and every later read sees exactly the same values: decode, verify and
replay all attend over identical keys, which is what lets speculative output equal plain output in FP8 mode.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Smallest scale: keeps all-zero rows finite (0 / tiny = 0) without dividing by zero.
_MIN_SCALE = 1e-12


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., head_dim]`` to e4m3 with one float32 scale per leading index."""
    amax = x.detach().abs().amax(dim=-1).float()
    scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (x.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


class KVCache:
    """K and V of one attention layer for positions ``0..max_len-1``."""

    def __init__(self, max_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, fp8: bool = False) -> None:
        self.max_len = max_len
        self.dtype = dtype  # compute dtype reads are returned in
        self.fp8 = fp8
        store = FP8_DTYPE if fp8 else dtype
        shape = (max_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        if fp8:
            self.k_scale = torch.ones(max_len, n_kv_heads, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(max_len, n_kv_heads, dtype=torch.float32, device=device)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor, pos_t: torch.Tensor | None = None) -> None:
        """Store rows ``start .. start+T-1`` from ``k, v [T, n_kv_heads, head_dim]``.

        With ``pos_t`` (the start as a device tensor) the rows are scattered with ``index_copy_``, so the same
        captured CUDA graph writes wherever the sequence currently ends.
        """
        if pos_t is not None:
            rows = pos_t + torch.arange(k.shape[0], device=k.device)
            if self.fp8:
                qk, sk = quantize_fp8(k)
                qv, sv = quantize_fp8(v)
                # index_copy_ has no float8 kernel: move the bytes as uint8.
                self.k.view(torch.uint8).index_copy_(0, rows, qk.view(torch.uint8))
                self.v.view(torch.uint8).index_copy_(0, rows, qv.view(torch.uint8))
                self.k_scale.index_copy_(0, rows, sk)
                self.v_scale.index_copy_(0, rows, sv)
            else:
                self.k.index_copy_(0, rows, k.to(self.k.dtype))
                self.v.index_copy_(0, rows, v.to(self.v.dtype))
            return
        end = start + k.shape[0]
        if self.fp8:
            self.k[start:end], self.k_scale[start:end] = quantize_fp8(k)
            self.v[start:end], self.v_scale[start:end] = quantize_fp8(v)
        else:
            self.k[start:end] = k
            self.v[start:end] = v

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``0 .. end-1`` in the compute dtype (dequantised for FP8)."""
        if self.fp8:
            return (dequantize_fp8(self.k[:end], self.k_scale[:end], self.dtype),
                    dequantize_fp8(self.v[:end], self.v_scale[:end], self.dtype))
        return self.k[:end], self.v[:end]

    def nbytes(self) -> int:
        total = self.k.nbytes + self.v.nbytes
        if self.fp8:
            total += self.k_scale.nbytes + self.v_scale.nbytes
        return total
