"""OCP MXFP4 weights: 4-bit e2m1 values with one E8M0 (power-of-two) scale per 32 inputs.

``weight`` uint8 ``[out, in/2]`` (two e2m1 codes per byte, the LOW nibble holds the even input index, as NVFP4),
``weight_scale`` uint8 ``[out, in/32]`` of E8M0 exponents: value = e2m1 x 2^(weight_scale - 127). 0.5 + 1/32 bytes
per weight. On Blackwell the product feeds these bytes straight into the block-scaled MMA
(``edgespec.kernels.quant.triton_block_scaled``); elsewhere the reference dequantizes a tile at a time.
"""

from __future__ import annotations

import torch

from edgespec.weights.base import PackedWeight, register_format
from edgespec.weights.nvfp4 import e2m1_codes, e2m1_table, pack_nibbles, unpack_nibbles

MXFP4_BLOCK = 32
E2M1_EMAX = 2       # e2m1's largest exponent: a block's shared exponent is floor(log2(amax)) - 2 (OCP MX)


def e8m0_value(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent codes (uint8) -> fp32 ``2^(code - 127)`` (code 255, NaN in the OCP spec, is not produced)."""
    return torch.exp2(codes.to(torch.float32) - 127)


def dequant_mxfp4(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[rows, in]`` dense rows of MXFP4 buffers (the same rows of each)."""
    values = e2m1_table(weight.device)[unpack_nibbles(weight)]
    return (values * e8m0_value(weight_scale).repeat_interleave(MXFP4_BLOCK, dim=-1)).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of a dense ``[out, in]`` matrix: ``(weight, weight_scale)``, the OCP recipe: a 32-block's shared
    exponent is ``floor(log2(amax)) - 2``, values rounded to the nearest e2m1 (saturating at 6)."""
    out, k = w.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"mxfp4: in_features {k} must be a multiple of {MXFP4_BLOCK}")
    b = w.float().reshape(out, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = b.abs().amax(-1)
    exp = torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - E2M1_EMAX
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127)).clamp(-127, 127)
    codes = e2m1_codes(b / torch.exp2(exp)[..., None])
    return pack_nibbles(codes.reshape(out, k)), (exp + 127).to(torch.uint8)


@register_format
class MXFP4Weight(PackedWeight):
    """MXFP4 ``[out, in]`` weight (buffers ``weight``, ``weight_scale``)."""

    format = "mxfp4"
    group_size = MXFP4_BLOCK

    def __init__(self, out_features: int, in_features: int, compute_dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__(out_features, in_features, compute_dtype)
        if in_features % MXFP4_BLOCK:
            raise ValueError(f"MXFP4 needs in_features divisible by {MXFP4_BLOCK}, got {in_features}")
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, in_features // MXFP4_BLOCK, dtype=torch.uint8,
                                                         device=device))

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return dequant_mxfp4(self.weight[start:stop], self.weight_scale[start:stop], dtype)

    @classmethod
    def cat(cls, parts: list[PackedWeight]) -> PackedWeight | None:
        """Stacked rows (every scale belongs to its own row's 32-block, so any parts stack)."""
        first = parts[0]
        if any(not isinstance(p, MXFP4Weight) or p.in_features != first.in_features for p in parts):
            return None
        merged = cls(sum(p.out_features for p in parts), first.in_features, first.compute_dtype,
                     device=first.weight.device)
        merged.weight.copy_(torch.cat([p.weight for p in parts]))
        merged.weight_scale.copy_(torch.cat([p.weight_scale for p in parts]))
        return merged

    @classmethod
    def quantize(cls, w: torch.Tensor, compute_dtype: torch.dtype = torch.float32) -> MXFP4Weight:
        """Round-to-nearest MXFP4 of a dense ``[out, in]`` matrix (the OCP recipe, ``quant_ref.quantize_mxfp4``)."""
        q = cls(*w.shape, compute_dtype, device=w.device)
        codes, scales = quantize_mxfp4(w)
        q.weight.copy_(codes)
        q.weight_scale.copy_(scales)
        return q
