"""Group-wise int4 weights with zero points; AWQ (GEMM layout) and GPTQ checkpoints are repacked into this layout.

In memory: ``qweight`` uint8 ``[out, in/2]`` (LOW nibble = even input index), ``scales`` float16 ``[out, in/g]``,
``zeros`` uint8 ``[out, in/g]`` (unsigned zero point 0..15), attribute ``group_size`` g; value = (q - z) x s.
0.5 + ~2.25/g bytes per weight (3 bytes of scale and zero per group of g).

The checkpoint layouts (checked against AutoAWQ, AutoGPTQ/GPTQModel and vLLM's loaders):

* AWQ GEMM: ``qweight`` int32 ``[in, out/8]`` and ``qzeros`` int32 ``[in/g, out/8]`` pack 8 OUTPUT columns per
  int32 in the interleaved order 0,2,4,6,1,3,5,7 (nibble i, bits 4i..4i+3, holds column 8j + order[i]);
  ``scales`` float16 ``[in/g, out]``; value = (q - z) x s.
* GPTQ: ``qweight`` int32 ``[in/8, out]`` packs 8 INPUT rows per int32 in order (nibble i holds row 8j + i);
  ``qzeros`` int32 ``[in/g, out/8]`` packs 8 output columns in order; ``scales`` float16 ``[in/g, out]``; ``g_idx``
  int32 ``[in]``. Exporters of the original format (``checkpoint_format`` "gptq", the default) store each zero
  point minus one (a symmetric 4-bit zero of 8 is stored as 7); "gptq_v2" stores it as is.
Repacking is a pure bit shuffle: no value is rounded.
"""

from __future__ import annotations

import torch

from edgespec.weights.base import PackedWeight, register_format
from edgespec.weights.nvfp4 import pack_nibbles, unpack_nibbles

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` int32 -> ``[..., n, 8]`` int64 nibbles (nibble i = bits 4i..4i+3)."""
    return ((packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF).long()


def pack_int32(nibbles: torch.Tensor) -> torch.Tensor:
    """``[..., n, 8]`` values 0..15 -> ``[..., n]`` int32 (inverse of :func:`unpack_int32`)."""
    acc = torch.zeros(nibbles.shape[:-1], dtype=torch.int64, device=nibbles.device)
    for i in range(8):
        acc |= (nibbles[..., i].long() & 0xF) << (4 * i)
    return torch.where(acc >= 1 << 31, acc - (1 << 32), acc).to(torch.int32)


def awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ ``[rows, out/8]`` int32 -> ``[rows, out]`` values in column order (undoes the interleave)."""
    nib = unpack_int32(packed)                      # [rows, out/8, 8]: nibble i holds column 8j + AWQ_ORDER[i]
    out = torch.empty_like(nib)
    out[..., list(AWQ_ORDER)] = nib
    return out.reshape(packed.shape[0], -1)


def awq_pack_columns(values: torch.Tensor) -> torch.Tensor:
    """``[rows, out]`` values 0..15 -> AWQ ``[rows, out/8]`` int32 (the interleaved order)."""
    v = values.reshape(values.shape[0], -1, 8)
    return pack_int32(v[..., list(AWQ_ORDER)])


def gptq_columns(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qzeros [rows, out/8]`` int32 -> ``[rows, out]`` (sequential order)."""
    return unpack_int32(packed).reshape(packed.shape[0], -1)


def gptq_rows(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qweight [in/8, out]`` int32 -> ``[in, out]`` (nibble i of row j is input row 8j + i)."""
    nib = unpack_int32(packed)                      # [in/8, out, 8]
    return nib.permute(0, 2, 1).reshape(-1, packed.shape[1])


@register_format
class Int4Weight(PackedWeight):
    """Group-wise int4 ``[out, in]`` weight (buffers ``qweight``, ``scales``, ``zeros``; attribute ``group_size``)."""

    format = "int4"

    def __init__(self, out_features: int, in_features: int, compute_dtype: torch.dtype, group_size: int = 128,
                 device: torch.device | str | None = None) -> None:
        super().__init__(out_features, in_features, compute_dtype)
        if in_features % group_size or in_features % 2:
            raise ValueError(f"int4 needs in_features ({in_features}) divisible by the group size ({group_size})")
        self.group_size = int(group_size)
        groups = in_features // group_size
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=torch.float16, device=device))
        self.register_buffer("zeros", torch.empty(out_features, groups, dtype=torch.uint8, device=device))

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self._decode(slice(start, stop), dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Embedding lookup from a packed table: the rows' codes, scales and zeros gathered on the device (no host
        sync, so it can sit in a captured graph), only those rows decoded."""
        return self._decode(index.reshape(-1), self.compute_dtype).reshape(*index.shape, self.in_features)

    def _decode(self, rows: slice | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        g = self.group_size
        q = unpack_nibbles(self.qweight[rows]).float()
        z = self.zeros[rows].float().repeat_interleave(g, 1)
        s = self.scales[rows].float().repeat_interleave(g, 1)
        return ((q - z) * s).to(dtype)

    @classmethod
    def cat(cls, parts: list[PackedWeight]) -> PackedWeight | None:
        """Stacked rows (every row carries its own scales and zeros, so any split works)."""
        first = parts[0]
        if any(not isinstance(p, Int4Weight) or p.in_features != first.in_features
               or p.group_size != first.group_size for p in parts):
            return None
        merged = cls(sum(p.out_features for p in parts), first.in_features, first.compute_dtype, first.group_size,
                     device=first.qweight.device)
        r = 0
        for p in parts:
            for name in ("qweight", "scales", "zeros"):
                getattr(merged, name)[r:r + p.out_features].copy_(getattr(p, name))
            r += p.out_features
        return merged

    @classmethod
    def quantize(cls, w: torch.Tensor, group_size: int = 128,
                 compute_dtype: torch.dtype = torch.float32) -> Int4Weight:
        """Round-to-nearest asymmetric int4 per group of ``group_size`` inputs (min/max of each group -> 0..15)."""
        out_f, in_f = w.shape
        q = cls(out_f, in_f, compute_dtype, group_size, device=w.device)
        g = w.float().view(out_f, in_f // group_size, group_size)
        lo = g.amin(-1).clamp(max=0)
        hi = g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8).half().float()    # the fp16 value the layer will multiply by
        zero = (-lo / scale).round().clamp(0, 15)
        codes = (g / scale.unsqueeze(-1) + zero.unsqueeze(-1)).round().clamp(0, 15).reshape(out_f, in_f)
        q.qweight.copy_(pack_nibbles(codes))
        q.scales.copy_(scale)
        q.zeros.copy_(zero)
        return q

    # -- checkpoint layouts -------------------------------------------------------------------------------------
    @staticmethod
    def awq_qweight(qweight: torch.Tensor) -> torch.Tensor:
        """AWQ ``qweight [in, out/8]`` int32 -> our ``[out, in/2]`` uint8."""
        return pack_nibbles(awq_columns(qweight).t())

    @staticmethod
    def awq_zeros(qzeros: torch.Tensor) -> torch.Tensor:
        """AWQ ``qzeros [in/g, out/8]`` int32 -> our ``zeros [out, in/g]`` uint8."""
        return awq_columns(qzeros).t().to(torch.uint8).contiguous()

    @staticmethod
    def gptq_qweight(qweight: torch.Tensor) -> torch.Tensor:
        """GPTQ ``qweight [in/8, out]`` int32 -> our ``[out, in/2]`` uint8."""
        return pack_nibbles(gptq_rows(qweight).t())

    @staticmethod
    def gptq_zeros(qzeros: torch.Tensor, minus_one: bool) -> torch.Tensor:
        """GPTQ ``qzeros [in/g, out/8]`` int32 -> our ``zeros [out, in/g]``; ``minus_one``: the file stores z - 1."""
        z = gptq_columns(qzeros)
        if minus_one:
            z = (z + 1) & 0xF
        return z.t().to(torch.uint8).contiguous()

    def to_awq(self) -> dict[str, torch.Tensor]:
        """This weight in the AWQ GEMM layout (``qweight``, ``qzeros``, ``scales``) for writing a checkpoint."""
        q = unpack_nibbles(self.qweight).t()                       # [in, out]
        return {"qweight": awq_pack_columns(q), "qzeros": awq_pack_columns(self.zeros.t().long()),
                "scales": self.scales.t().contiguous()}
