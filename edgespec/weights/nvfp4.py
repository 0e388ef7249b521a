"""NVIDIA ModelOpt NVFP4 weights: 4-bit e2m1 values, an e4m3 scale per 16 inputs and one fp32 scale per tensor.

``weight`` uint8 ``[out, in/2]`` (two e2m1 codes per byte, the LOW nibble holds the even input index),
``weight_scale`` float8_e4m3fn ``[out, in/16]``, ``weight_scale_2`` float32 scalar: value = e2m1 x weight_scale x
weight_scale_2. e2m1 magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6 with the sign in the top bit of the code.
0.5 + 1/16 bytes per weight.
"""

from __future__ import annotations

import torch

from edgespec.weights.base import PackedWeight, register_format

GROUP = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


_TABLES: dict[torch.device, torch.Tensor] = {}


def e2m1_table(device: torch.device) -> torch.Tensor:
    """The 16 code values as float32 (index = 4-bit code), made once per device: a host-to-device copy inside
    every product would break CUDA-graph capture of a forward."""
    table = _TABLES.get(device)
    if table is None:
        table = _TABLES[device] = torch.tensor(_E2M1, dtype=torch.float32, device=device)
    return table


# Midpoints between neighbouring e2m1 magnitudes: rounding to nearest is one bucketize.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (0..15) of each value of ``x`` (already divided by its scales; saturates at 6)."""
    mags = torch.bucketize(x.abs(), torch.tensor(_MIDPOINTS, dtype=x.dtype, device=x.device))
    return mags | ((x < 0).long() << 3)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[rows, n/2]`` uint8 -> ``[rows, n]`` int64 codes, low nibble first."""
    lo = (packed & 0xF).long()
    hi = (packed >> 4).long()
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[rows, n]`` integer codes 0..15 -> ``[rows, n/2]`` uint8, even index in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


@register_format
class NVFP4Weight(PackedWeight):
    """NVFP4 ``[out, in]`` weight (buffers ``weight``, ``weight_scale``, ``weight_scale_2``)."""

    format = "nvfp4"

    def __init__(self, out_features: int, in_features: int, compute_dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__(out_features, in_features, compute_dtype)
        if in_features % GROUP:
            raise ValueError(f"NVFP4 needs in_features divisible by {GROUP}, got {in_features}")
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, in_features // GROUP,
                                                         dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale_2", torch.empty((), dtype=torch.float32, device=device))

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self._decode(slice(start, stop), dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Embedding lookup from a packed table: the rows' codes and scales gathered on the device (no host sync),
        only those rows decoded."""
        return self._decode(index.reshape(-1), self.compute_dtype).reshape(*index.shape, self.in_features)

    def _decode(self, rows: slice | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_nibbles(self.weight[rows])
        values = e2m1_table(codes.device)[codes]
        scales = self.weight_scale[rows].float().repeat_interleave(GROUP, 1) * self.weight_scale_2
        return (values * scales).to(dtype)

    @classmethod
    def cat(cls, parts: list[PackedWeight]) -> PackedWeight | None:
        """Stacked rows when all parts share one ``weight_scale_2`` (ModelOpt exports fused q/k/v and gate/up so);
        otherwise None: folding different global scales into the e4m3 block scales would round them again."""
        first = parts[0]
        if any(not isinstance(p, NVFP4Weight) or p.in_features != first.in_features for p in parts):
            return None
        if first.weight.is_meta or any(not torch.equal(p.weight_scale_2, first.weight_scale_2) for p in parts[1:]):
            return None     # on the meta device the scales are unknown: the loader merges after loading
        merged = cls(sum(p.out_features for p in parts), first.in_features, first.compute_dtype,
                     device=first.weight.device)
        r = 0
        for p in parts:
            merged.weight[r:r + p.out_features].copy_(p.weight)
            merged.weight_scale[r:r + p.out_features].copy_(p.weight_scale)
            r += p.out_features
        merged.weight_scale_2.copy_(first.weight_scale_2)
        return merged

    @classmethod
    def quantize(cls, w: torch.Tensor, compute_dtype: torch.dtype = torch.float32,
                 global_amax: torch.Tensor | None = None) -> NVFP4Weight:
        """Round-to-nearest NVFP4 of a dense ``[out, in]`` matrix, ModelOpt's recipe: the global scale maps the
        tensor's amax to 6 x 448, each 16-group's scale (e4m3) maps its amax to 6. ``global_amax``: share one
        global scale between matrices that are served merged (q/k/v, gate/up)."""
        out_f, in_f = w.shape
        q = cls(out_f, in_f, compute_dtype, device=w.device)
        wf = w.float()
        amax = wf.abs().amax() if global_amax is None else global_amax.float()
        scale_2 = amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else torch.tensor(1.0, device=w.device)
        groups = wf.view(out_f, in_f // GROUP, GROUP)
        block = (groups.abs().amax(-1) / E2M1_MAX / scale_2).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        eff = block.float() * scale_2
        scaled = groups / torch.where(eff > 0, eff, torch.ones_like(eff)).unsqueeze(-1)
        codes = e2m1_codes(scaled.reshape(out_f, in_f))
        q.weight.copy_(pack_nibbles(codes))
        q.weight_scale.copy_(block)
        q.weight_scale_2.copy_(scale_2)
        return q
