"""Block-wise FP8 weights as Qwen's official ``-FP8`` releases store them.

``weight`` float8_e4m3fn ``[out, in]`` and ``weight_scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]``: the
dense value is the fp8 value times the scale of its 128x128 block (the name says "inv", but it multiplies; see
transformers' ``integrations/finegrained_fp8.py``). One byte per weight plus 4 bytes per 16384.
"""

from __future__ import annotations

import torch

from edgespec.weights.base import PackedWeight, register_format

FP8_MAX = 448.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@register_format
class FP8BlockWeight(PackedWeight):
    """Block-FP8 ``[out, in]`` weight (buffers ``weight``, ``weight_scale_inv``; attribute ``block``)."""

    format = "fp8_block"

    def __init__(self, out_features: int, in_features: int, compute_dtype: torch.dtype,
                 block: tuple[int, int] = (128, 128), device: torch.device | str | None = None) -> None:
        super().__init__(out_features, in_features, compute_dtype)
        self.block = (int(block[0]), int(block[1]))
        bo, bi = self.block
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                   device=device))
        self.register_buffer("weight_scale_inv", torch.empty(_cdiv(out_features, bo), _cdiv(in_features, bi),
                                                             dtype=torch.float32, device=device))

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        bo, bi = self.block
        first = start // bo
        scales = self.weight_scale_inv[first:_cdiv(stop, bo)]
        scales = scales.repeat_interleave(bo, 0)[start - first * bo:stop - first * bo]
        scales = scales.repeat_interleave(bi, 1)[:, :self.in_features]
        return (self.weight[start:stop].float() * scales).to(dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Embedding lookup from a packed table: each row with its block row of scales, gathered on the device (no
        host sync), only those rows decoded."""
        flat = index.reshape(-1)
        scales = self.weight_scale_inv[flat // self.block[0]].repeat_interleave(self.block[1], 1)
        out = (self.weight[flat].float() * scales[:, :self.in_features]).to(self.compute_dtype)
        return out.reshape(*index.shape, self.in_features)

    @classmethod
    def cat(cls, parts: list[PackedWeight]) -> PackedWeight | None:
        """Stacked rows when every part but the last ends on a block boundary (the scale rows then stack too)."""
        first = parts[0]
        if any(not isinstance(p, FP8BlockWeight) or p.block != first.block or p.in_features != first.in_features
               for p in parts):
            return None
        if any(p.out_features % first.block[0] for p in parts[:-1]):
            return None
        out = sum(p.out_features for p in parts)
        merged = cls(out, first.in_features, first.compute_dtype, first.block, device=first.weight.device)
        r = s = 0
        for p in parts:
            merged.weight[r:r + p.out_features].copy_(p.weight)
            merged.weight_scale_inv[s:s + p.weight_scale_inv.shape[0]].copy_(p.weight_scale_inv)
            r += p.out_features
            s += p.weight_scale_inv.shape[0]
        return merged

    @classmethod
    def quantize(cls, w: torch.Tensor, block: tuple[int, int] = (128, 128),
                 compute_dtype: torch.dtype = torch.float32) -> FP8BlockWeight:
        """Round-to-nearest block quantization of a dense ``[out, in]`` matrix (amax of each block -> 448)."""
        out_f, in_f = w.shape
        bo, bi = block
        q = cls(out_f, in_f, compute_dtype, block, device=w.device)
        wf = w.float()
        pad = torch.zeros(_cdiv(out_f, bo) * bo, _cdiv(in_f, bi) * bi, device=w.device)
        pad[:out_f, :in_f] = wf
        blocks = pad.view(pad.shape[0] // bo, bo, pad.shape[1] // bi, bi)
        amax = blocks.abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q.weight_scale_inv.copy_(scale)
        full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:out_f, :in_f]
        q.weight.copy_((wf / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
        return q
