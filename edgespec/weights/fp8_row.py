"""FP8 weights with one float32 scale per output row: per-channel and per-tensor FP8 checkpoints.

``weight`` float8_e4m3fn ``[out, in]`` and ``weight_scale`` float32 ``[out]``: the dense value is the fp8 value
times its row's scale. compressed-tensors ``float-quantized`` FP8 (``strategy: channel`` stores ``[out, 1]``,
``strategy: tensor`` one scalar) and ModelOpt FP8 (``weight_scale`` a scalar; ``FP8_PER_CHANNEL_PER_TOKEN``
``[out]``) all load into this layout: a per-tensor scale is repeated on every row at load (4 bytes a row, the
same products). One byte per weight plus 4 per row. Rows carry their own scale, so any parts stack (merged
q/k/v with three different per-tensor scales stay one layer).

On a CUDA GPU (SM89+) the arch hooks put it on :mod:`edgespec.kernels.quant.triton_fp8_row` (the e4m3 bytes on the
tensor cores, the row scale applied to the sums); elsewhere the reference product (a tile of rows dequantized
inside the step) runs.
"""

from __future__ import annotations

import torch

from edgespec.weights.base import PackedWeight, register_format

FP8_MAX = 448.0


@register_format
class FP8RowWeight(PackedWeight):
    """Per-row-scaled FP8 ``[out, in]`` weight (buffers ``weight``, ``weight_scale``)."""

    format = "fp8_row"

    def __init__(self, out_features: int, in_features: int, compute_dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__(out_features, in_features, compute_dtype)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                   device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight[start:stop].float() * self.weight_scale[start:stop, None]).to(dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: the rows and their scales gathered on the device (no host sync)."""
        flat = index.reshape(-1)
        out = (self.weight[flat].float() * self.weight_scale[flat, None]).to(self.compute_dtype)
        return out.reshape(*index.shape, self.in_features)

    @classmethod
    def cat(cls, parts: list[PackedWeight]) -> PackedWeight | None:
        """Stacked rows (every row has its own scale, so any split works)."""
        first = parts[0]
        if any(not isinstance(p, FP8RowWeight) or p.in_features != first.in_features for p in parts):
            return None
        merged = cls(sum(p.out_features for p in parts), first.in_features, first.compute_dtype,
                     device=first.weight.device)
        r = 0
        for p in parts:
            merged.weight[r:r + p.out_features].copy_(p.weight)
            merged.weight_scale[r:r + p.out_features].copy_(p.weight_scale)
            r += p.out_features
        return merged

    @classmethod
    def quantize(cls, w: torch.Tensor, compute_dtype: torch.dtype = torch.float32,
                 per_tensor: bool = False) -> FP8RowWeight:
        """Round-to-nearest FP8 of a dense ``[out, in]`` matrix, each row's (or the whole tensor's) amax -> 448."""
        out_f, in_f = w.shape
        q = cls(out_f, in_f, compute_dtype, device=w.device)
        wf = w.float()
        amax = wf.abs().amax().expand(out_f) if per_tensor else wf.abs().amax(1)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q.weight_scale.copy_(scale)
        q.weight.copy_((wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
        return q
