"""Torch reference math of the packed weight formats (the oracle the Triton kernels in
``edgespec.kernels.quant.triton_quant_gemv`` are tested against), over raw tensors in the agreed in-memory layouts
(docs: ``edgespec/weights/base.py``, ``/work/shared/reference/weights.md``):

* ``int4``: ``qweight`` uint8 ``[out, in/2]`` (LOW nibble = even input index), ``scales`` fp16 ``[out, in/g]``,
  ``zeros`` uint8 ``[out, in/g]`` (0..15); ``w = (q - z) * s``.
* ``nvfp4``: ``weight`` uint8 ``[out, in/2]`` (two e2m1 codes, LOW nibble = even index), ``weight_scale``
  float8_e4m3fn ``[out, in/16]``, ``weight_scale_2`` fp32 0-d; ``w = e2m1 * weight_scale * weight_scale_2``.
* ``fp8_block``: ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale_inv`` fp32
  ``[ceil(out/128), ceil(in/128)]``; ``w = fp8 * scale`` of its 128x128 block (the name says "inv"; it multiplies).
* ``mxfp4`` (OCP microscaling): ``weight`` uint8 ``[out, in/2]`` (e2m1 codes as nvfp4), ``weight_scale`` uint8
  ``[out, in/32]`` of E8M0 exponents; ``w = e2m1 * 2^(weight_scale - 127)``.

The weight classes (``edgespec.weights``) dequantize through these functions, so the class reference and the
kernel reference are one piece of math. The ``quantize_*`` functions build packed tensors from a dense matrix
(tests and benches; round-to-nearest, no calibration).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from edgespec.weights.mxfp4 import MXFP4_BLOCK, dequant_mxfp4, quantize_mxfp4

# e2m1 code (sign in bit 3) -> value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NVFP4_BLOCK = 16
FP8_BLOCK = 128
FP8_MAX = 448.0


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[rows, n]`` -> uint8 ``[rows, 2n]`` of 4-bit codes: low nibble first (even index)."""
    p = packed.to(torch.uint8)
    return torch.stack((p & 0x0F, p >> 4), dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_nibbles`: codes 0..15 ``[rows, 2n]`` -> uint8 ``[rows, n]``."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes 0..15 -> fp32 values by arithmetic (no host-made table, so it also runs inside a CUDA graph
    capture): magnitude ``m * 0.5`` for exponent 0, ``2^(e-1) * (1 + m/2)`` otherwise; sign in bit 3."""
    c = codes.to(torch.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(torch.float32)
    mag = torch.where(e == 0, m * 0.5, torch.exp2((e - 1).to(torch.float32)) * (1 + m * 0.5))
    return torch.where(c >= 8, -mag, mag)


def dequant_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """``[rows, in]`` dense rows of an int4 weight (the tensors are the same rows of each buffer)."""
    q = unpack_nibbles(qweight).to(torch.float32)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=-1)
    z = zeros.to(torch.float32).repeat_interleave(group_size, dim=-1)
    return ((q - z) * s).to(dtype)


def dequant_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """``[rows, in]`` dense rows of an NVFP4 weight."""
    v = e2m1_decode(unpack_nibbles(weight))
    s = weight_scale.to(torch.float32).repeat_interleave(NVFP4_BLOCK, dim=-1) * weight_scale_2.to(torch.float32)
    return (v * s).to(dtype)


def dequant_fp8_block(weight: torch.Tensor, weight_scale_inv: torch.Tensor, row_start: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """Dense rows ``row_start : row_start + len(weight)`` of a block-FP8 weight (``weight`` holds just those rows,
    ``weight_scale_inv`` is the whole scale grid)."""
    rows, cols = weight.shape
    r = torch.arange(row_start, row_start + rows, device=weight.device) // FP8_BLOCK
    c = torch.arange(cols, device=weight.device) // FP8_BLOCK
    s = weight_scale_inv.to(torch.float32)[r][:, c]
    return (weight.to(torch.float32) * s).to(dtype)


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest int4 of a dense ``[out, in]`` matrix: ``(qweight, scales, zeros)``."""
    out, k = w.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"int4: in_features {k} must be a multiple of the (even) group size {group_size}")
    g = w.float().reshape(out, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    s = ((hi - lo) / 15).clamp_min(1e-8)
    z = (-lo / s).round().clamp(0, 15)
    s16 = s.to(torch.float16)
    q = (g / s16.float()[..., None] + z[..., None]).round().clamp(0, 15)
    return pack_nibbles(q.reshape(out, k)), s16, z.to(torch.uint8)


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 of a dense ``[out, in]`` matrix: ``(weight, weight_scale, weight_scale_2)`` (per-16 e4m3 scales
    under one fp32 global scale, values rounded to the nearest e2m1)."""
    out, k = w.shape
    if k % NVFP4_BLOCK:
        raise ValueError(f"nvfp4: in_features {k} must be a multiple of {NVFP4_BLOCK}")
    b = w.float().reshape(out, k // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = b.abs().amax(-1)
    scale_2 = (amax.max() / (6.0 * FP8_MAX)).clamp_min(1e-12)
    ws = (amax / 6.0 / scale_2).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    denom = ws.float() * scale_2
    v = torch.where(denom[..., None] > 0, b / denom[..., None], torch.zeros_like(b))
    mags = torch.tensor(E2M1_VALUES[:8], device=w.device)
    idx = (v.abs()[..., None] - mags).abs().argmin(-1)
    codes = idx + 8 * (v < 0).long()
    return pack_nibbles(codes.reshape(out, k)), ws, scale_2.to(torch.float32).reshape(())


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 of a dense ``[out, in]`` matrix: ``(weight, weight_scale_inv)`` with 128x128 blocks."""
    out, k = w.shape
    ro, rk = -(-out // FP8_BLOCK), -(-k // FP8_BLOCK)
    pad = torch.zeros(ro * FP8_BLOCK, rk * FP8_BLOCK, dtype=torch.float32, device=w.device)
    pad[:out, :k] = w.float()
    amax = pad.reshape(ro, FP8_BLOCK, rk, FP8_BLOCK).abs().amax(dim=(1, 3))
    s = (amax / FP8_MAX).clamp_min(1e-12)
    q = (w.float() / s.repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :k])
    return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


@dataclass
class RawPacked:
    """Packed tensors under the contract names, without the weight class around them (kernel tests and benches).

    ``format`` is ``int4``, ``nvfp4``, ``mxfp4`` or ``fp8_block``; ``tensors`` holds that format's buffers by name
    (they are also readable as attributes, as on the weight classes)."""

    format: str
    out_features: int
    in_features: int
    tensors: dict[str, torch.Tensor]
    group_size: int = 128
    kernel: object = field(default=None, repr=False)

    def __getattr__(self, name: str) -> torch.Tensor:
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_rows(self, start, stop, dtype)

    def matmul_ref(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return matmul_ref(self, x, bias)


def pack(fmt: str, w: torch.Tensor, group_size: int = 128) -> RawPacked:
    """Quantize a dense ``[out, in]`` matrix into a :class:`RawPacked` of format ``fmt``."""
    out, k = w.shape
    if fmt == "int4":
        q, s, z = quantize_int4(w, group_size)
        return RawPacked(fmt, out, k, {"qweight": q, "scales": s, "zeros": z}, group_size)
    if fmt == "nvfp4":
        q, s, s2 = quantize_nvfp4(w)
        return RawPacked(fmt, out, k, {"weight": q, "weight_scale": s, "weight_scale_2": s2}, NVFP4_BLOCK)
    if fmt == "mxfp4":
        q, s = quantize_mxfp4(w)
        return RawPacked(fmt, out, k, {"weight": q, "weight_scale": s}, MXFP4_BLOCK)
    if fmt == "fp8_block":
        q, s = quantize_fp8_block(w)
        return RawPacked(fmt, out, k, {"weight": q, "weight_scale_inv": s}, FP8_BLOCK)
    raise ValueError(f"unknown packed format {fmt!r}: int4, nvfp4, mxfp4 or fp8_block")


def dequantize_rows(packed, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``start:stop`` of any packed weight (contract names) as dense ``dtype``."""
    fmt = packed.format
    if fmt == "int4":
        return dequant_int4(packed.qweight[start:stop], packed.scales[start:stop], packed.zeros[start:stop],
                            packed.group_size, dtype)
    if fmt == "nvfp4":
        return dequant_nvfp4(packed.weight[start:stop], packed.weight_scale[start:stop], packed.weight_scale_2,
                             dtype)
    if fmt == "mxfp4":
        return dequant_mxfp4(packed.weight[start:stop], packed.weight_scale[start:stop], dtype)
    if fmt == "fp8_block":
        return dequant_fp8_block(packed.weight[start:stop], packed.weight_scale_inv, start, dtype)
    raise ValueError(f"unknown packed format {fmt!r}")


def matmul_ref(packed, x: torch.Tensor, bias: torch.Tensor | None = None, tile_rows: int = 4096) -> torch.Tensor:
    """``x [..., in] @ W^T (+ bias)`` dequantizing ``tile_rows`` output rows at a time (fp32 products, output in
    x's dtype)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.in_features).float()
    out = torch.empty(x2.shape[0], packed.out_features, dtype=torch.float32, device=x.device)
    for s in range(0, packed.out_features, tile_rows):
        e = min(packed.out_features, s + tile_rows)
        out[:, s:e] = x2 @ dequantize_rows(packed, s, e, torch.float32).t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).reshape(*lead, packed.out_features)
