"""Torch twin of the block-scaled products (:mod:`edgespec.kernels.quant.triton_block_scaled`): the activation side
quantized into the operand format of the block-scaled tensor-core MMA, and the product that follows from it.

A Blackwell block-scaled MMA takes both operands in a microscaled format: NVFP4 weights (e2m1, E4M3 scale per 16)
only pair with NVFP4 activations (``tcgen05.mma kind::mxf4nvf4.block16``); MXFP4 weights (e2m1, E8M0 per 32) pair
with MXFP8 activations (e4m3, E8M0 per 32: ``kind::mxf8f6f4.block32``). One activation quantization would cost
accuracy (relative product error ~9e-2 for NVFP4, ~2.7e-2 for MXFP8, against the 1e-2 the packed products are held
to; docs/quant_kernels.md), so the activations go in as a short *residual series*: term 0 is the quantized row,
term t + 1 the quantization of what terms 0..t left over. The terms are extra columns of the same MMA (the
weights are read and fed once), summed in fp32 after it:

* MXFP8, 2 terms: a bf16 value has 8 significant bits and each e4m3 term 4, so hi + lo hold every bf16 input
  exactly (E8M0 scales reach 2^-126); the product then equals the reference up to fp32 summation order.
* NVFP4, 4 terms: each e2m1 term removes about 3.5 bits (relative product error 9.5e-2, 8.5e-3, 7.8e-4, 7.1e-5
  after 1..4 terms on a 27B-shaped matrix). E4M3 block scales span only 2^-9..448, so every (term, row) column
  has a power-of-two global scale ``g``: term 0's maps the row's amax to 6 x 448, each later term's is 4x
  smaller (a residual's block amax is at most a sixth of the block's), applied to the MMA's fp32 column.

Every scale is a power of two found from the float's bits (no ``log2``), so this twin and the Triton kernel make
the same codes bit for bit; the tests compare them.

Layout of a quantized activation (``ActQuant``): ``C = terms x MP`` columns per row block of ``MP`` rows (a power
of two, at least 16 columns in all), column ``t x MP + m`` = term t of row m; ``codes`` ``[blocks x C, K/2]`` uint8
(e2m1, low nibble = even index) or ``[blocks x C, K]`` float8_e4m3fn; ``scales`` ``[blocks x C, K/16]``
float8_e4m3fn or ``[blocks x C, K/32]`` uint8 E8M0; ``col_scale`` ``[blocks x C]`` fp32 (NVFP4's ``g``; ones for
MXFP8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgespec.kernels.quant.quant_ref import e2m1_decode, matmul_ref, pack_nibbles, unpack_nibbles

# weight format -> (activation format of its MMA, scale block, residual terms)
ACT_FORMAT = {"nvfp4": "e2m1", "mxfp4": "e4m3"}
SCALE_BLOCK = {"nvfp4": 16, "mxfp4": 32}
TERMS = {"nvfp4": 4, "mxfp4": 2}
BLOCK_SCALED_FORMATS = tuple(ACT_FORMAT)
# Most rows per MMA: the columns of one row block are terms x MP <= 256, the widest tcgen05 N.
MAX_BLOCK_ROWS = 64
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# e2m1 rounding: midpoints between neighbouring magnitudes (a value on a midpoint goes down)
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass
class ActQuant:
    """Activations quantized for a block-scaled MMA (module docstring: layout)."""

    codes: torch.Tensor
    scales: torch.Tensor
    col_scale: torch.Tensor
    rows: int            # real activation rows M
    block_rows: int      # MP: rows per row block (power of two)
    terms: int
    fmt: str             # the weight format it pairs with (nvfp4 | mxfp4)

    @property
    def columns(self) -> int:
        return self.terms * self.block_rows

    @property
    def blocks(self) -> int:
        return self.codes.shape[0] // self.columns


def block_rows(fmt: str, M: int, columns: int = 256) -> int:
    """Rows per row block for ``M`` activation rows: the next power of two, at least what makes 16 columns, at most
    :data:`MAX_BLOCK_ROWS` and ``columns / terms`` (more rows run as several row blocks: prefill)."""
    cap = min(MAX_BLOCK_ROWS, columns // TERMS[fmt])
    rows = 1
    while rows < min(M, cap):
        rows *= 2
    return max(rows, 16 // TERMS[fmt])


def pow2_ceil_exponent(v: torch.Tensor, limit: float) -> torch.Tensor:
    """Smallest integer e with ``v / 2^e <= limit`` for fp32 ``v >= 0`` (``limit`` = m x 2^E, 1 <= m < 2), from the
    float's exponent and mantissa bits (exact; the kernel does the same). Zero (and subnormal) ``v`` -> -126."""
    bits = v.float().view(torch.int32)
    exp = (bits >> 23) - 127
    lim_bits = torch.tensor(limit, dtype=torch.float32).view(torch.int32).item()
    lim_exp, lim_mant = (lim_bits >> 23) - 127, lim_bits & 0x7FFFFF
    e = exp - lim_exp + ((bits & 0x7FFFFF) > lim_mant).to(torch.int32)
    return torch.where(exp < -126, torch.full_like(e, -126), e).clamp(-126, 127)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """``2^e`` as fp32 for integer ``e`` in -126..127, built from bits."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 of the nearest e2m1 values of ``v`` (saturating at 6; sign in bit 3, -0 as +0)."""
    a = v.abs()
    idx = sum((a > m).to(torch.int32) for m in E2M1_MIDPOINTS)
    return idx + 8 * ((v < 0) & (idx > 0)).to(torch.int32)


def _mxfp8_term(res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One MXFP8 term of residual blocks ``res [R, nb, 32]``: (e4m3 codes, E8M0 codes, the dequantized term)."""
    e = pow2_ceil_exponent(res.abs().amax(-1), E4M3_MAX)                # [R, nb]
    s = exp2_int(e)[..., None]
    q = (res / s).to(torch.float8_e4m3fn)
    return q, (e + 127).to(torch.uint8), q.float() * s


def _nvfp4_term(res: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One NVFP4 term of residual blocks ``res [R, nb, 16]`` under column scales ``g [R]``: (e2m1 codes,
    E4M3 block scales, the dequantized term)."""
    s = (res.abs().amax(-1) / E2M1_MAX / g[:, None]).to(torch.float8_e4m3fn)     # [R, nb]
    sf = s.float() * g[:, None]
    v = torch.where(sf[..., None] > 0, res / sf[..., None], torch.zeros_like(res))
    codes = e2m1_round(v)
    return codes, s, e2m1_decode(codes) * sf[..., None]


def nvfp4_column_scales(x: torch.Tensor, terms: int) -> torch.Tensor:
    """``[terms, M]`` power-of-two global scales: term 0's maps each row's amax to 6 x 448, each next one 4x
    smaller."""
    e0 = pow2_ceil_exponent(x.abs().amax(-1), E2M1_MAX * E4M3_MAX)
    return torch.stack([exp2_int((e0 - 2 * t).clamp(-126, 127)) for t in range(terms)])


def quantize_activations(x: torch.Tensor, fmt: str, columns: int = 256) -> ActQuant:
    """``x [M, K]`` (any float dtype; K a multiple of the scale block) -> the residual series of :class:`ActQuant`
    that the block-scaled product of a ``fmt`` weight multiplies (row blocks of at most ``columns`` columns)."""
    M, K = x.shape
    blk, terms = SCALE_BLOCK[fmt], TERMS[fmt]
    if K % blk:
        raise ValueError(f"{fmt} block-scaled product: in_features {K} must be a multiple of {blk}")
    mp = block_rows(fmt, M, columns)
    n_blocks = -(-M // mp)
    xf = torch.zeros(n_blocks * mp, K, dtype=torch.float32, device=x.device)
    xf[:M] = x.float()
    res = xf.reshape(-1, K // blk, blk)
    g = nvfp4_column_scales(xf, terms) if fmt == "nvfp4" else torch.ones(terms, xf.shape[0], device=x.device)
    codes, scales = [], []
    for t in range(terms):
        if fmt == "nvfp4":
            q, s, deq = _nvfp4_term(res, g[t])
            codes.append(pack_nibbles(q.reshape(-1, K)))
        else:
            q, s, deq = _mxfp8_term(res)
            codes.append(q.reshape(-1, K))
        scales.append(s)
        res = res - deq
    # [terms, blocks x MP, ...] -> rows ordered (block, term, row of block)
    def columns(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(terms, n_blocks, mp, *t.shape[2:]).transpose(0, 1).reshape(n_blocks * terms * mp,
                                                                                   *t.shape[2:])
    return ActQuant(columns(torch.stack(codes)), columns(torch.stack(scales)), columns(g), M, mp, terms, fmt)


def dequantize_activations(aq: ActQuant) -> torch.Tensor:
    """The fp32 ``[M, K]`` rows the residual series of ``aq`` stands for (the terms summed)."""
    blk = SCALE_BLOCK[aq.fmt]
    if aq.fmt == "nvfp4":
        v = e2m1_decode(unpack_nibbles(aq.codes))
        s = aq.scales.float()
    else:
        v = aq.codes.float()
        s = exp2_int(aq.scales.to(torch.int32) - 127)
    deq = v * s.repeat_interleave(blk, dim=-1) * aq.col_scale[:, None]
    per_block = deq.reshape(aq.blocks, aq.terms, aq.block_rows, -1).sum(1)
    return per_block.reshape(-1, deq.shape[-1])[:aq.rows]


def block_scaled_matmul_ref(packed, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the block-scaled product computes: ``x`` through its residual series (:func:`quantize_activations`),
    times the weight (``quant_ref``), fp32 sums, output in x's dtype. ``x [..., in]``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq = dequantize_activations(quantize_activations(x2, packed.format))
    out = matmul_ref(packed, xq, None if bias is None else bias.float())
    return out.to(x.dtype).reshape(*lead, packed.out_features)

