"""Register-level decode of the packed formats, shared by the products that read them: the dense few-row kernels
(:mod:`edgespec.kernels.quant.triton_quant_gemv`), the weight-major tiles (``triton_quant_wide``), the K-quant
and per-row FP8 products, and the MoE expert products (``edgespec.kernels.moe``).

* an int4 word -> eight fp32 values ``q - z`` (:func:`_int4_word_values`, the CUDA-core paths);
* an int4 or NVFP4 word -> four pairs of 16-bit values in the activation's type (:func:`_int4_pair_tile`,
  :data:`_NVFP4_PAIRS_BF16_ASM`), laid out in the pair order of :func:`_pair_columns`, with the activation tile
  permuted to match (:func:`_pair_x`, :func:`pair_order`);
* the store of a program's result or K-split partial (:func:`_finish`) and the K split of a launch
  (:func:`wave_splits`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _finish(acc, part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, stride_pm, stride_ym,
            DOT: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Store a program's ``[BLOCK_M, BLOCK_N]`` (DOT) or ``[BLOCK_N]`` result: to y (bias, output dtype) when K
    is not split, else as fp32 partials."""
    if DOT:
        out_ok = (m[:, None] < M) & (n[None, :] < N)
        if DIRECT:
            if HAS_BIAS:
                acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_ok)
        else:
            tl.store(part_ptr + pid_k * stride_ps + m[:, None] * stride_pm + n[None, :], acc, mask=out_ok)
    else:
        if DIRECT:
            if HAS_BIAS:
                acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
            tl.store(y_ptr + n, acc.to(y_ptr.dtype.element_ty), mask=n < N)
        else:
            tl.store(part_ptr + pid_k * stride_ps + n, acc, mask=n < N)


# One int32 word of int4 codes (nibble j = input 8w + j) -> the eight values (q - z) as fp32, with fp16 pair
# arithmetic: (w >> 4p) & 0x000F000F | 0x6400_6400 is the fp16 pair (1024 + q[p], 1024 + q[p + 4]) in one LOP3,
# one sub.f16x2 of (1024 + z) leaves q - z exactly, and two cvt widen it: ~2.4 instructions per weight instead of
# the ~4.5 of byte extraction and a float subtraction per value.
_INT4_WORD_ASM = tl.constexpr("""
{
.reg .b32 t0, t1, t2, t3, zz;
.reg .b16 l0, h0, l1, h1, l2, h2, l3, h3;
lop3.b32 t0, $8, 0x000F000F, 0x64006400, 0xea;
shr.b32 t1, $8, 4;
lop3.b32 t1, t1, 0x000F000F, 0x64006400, 0xea;
shr.b32 t2, $8, 8;
lop3.b32 t2, t2, 0x000F000F, 0x64006400, 0xea;
shr.b32 t3, $8, 12;
lop3.b32 t3, t3, 0x000F000F, 0x64006400, 0xea;
sub.f16x2 t0, t0, $9;
sub.f16x2 t1, t1, $9;
sub.f16x2 t2, t2, $9;
sub.f16x2 t3, t3, $9;
mov.b32 {l0, h0}, t0;
mov.b32 {l1, h1}, t1;
mov.b32 {l2, h2}, t2;
mov.b32 {l3, h3}, t3;
cvt.f32.f16 $0, l0;
cvt.f32.f16 $1, l1;
cvt.f32.f16 $2, l2;
cvt.f32.f16 $3, l3;
cvt.f32.f16 $4, h0;
cvt.f32.f16 $5, h1;
cvt.f32.f16 $6, h2;
cvt.f32.f16 $7, h3;
}
""")


@triton.jit
def _int4_word_values(words, zpair):
    """The eight fp32 values ``q - z`` of each int32 word (nibble j = input 8w + j); ``zpair`` is the fp16 pair
    (1024 + z, 1024 + z) as int32 bits."""
    return tl.inline_asm_elementwise(_INT4_WORD_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words, zpair],
                                     dtype=(tl.float32,) * 8, is_pure=True, pack=1)


# int4 for 1..16 rows on the tensor cores. A word of eight codes becomes four registers, each a pair of 16-bit values
# (q[p] - z, q[p + 4] - z), p = 0..3, already in the activation's type: the codes OR-ed into the mantissa of 128
# (bf16, 0x4300) or 1024 (fp16, 0x6400) in one LOP3, then one fused pair operation takes (that + z) away, exactly
# (|q - z| <= 15 is an integer of either type). The pairs are laid side by side as the product's K axis, column
# 8w + 2p + h holding input 8w + p + 4h, and the activation tile is permuted to the same order in registers, so the
# compiler feeds the pairs to the mma as they are: 2.87 lane-instructions per weight in the sm_90 main loop
# (lab/quant_sass.py), against 6.83 for the byte tile of ``_int4_kernel`` and 4.09 for the one-row word kernel.


def _int4_pairs_asm(magic: str, take_zero: str, setup: tuple[str, ...] = ()) -> tl.constexpr:
    """The PTX of one word ($4) -> four int4 pairs ($0..$3): nibbles p and p + 4 OR-ed into the mantissa of the
    ``magic`` pair, then ``take_zero`` (a pair op on ``$p`` and the (magic + z) pair ``$5``) leaves q - z."""
    lines = ["{", ".reg .b32 t1, t2, t3" + (", one;" if setup else ";"), *setup,
             f"lop3.b32 $0, $4, 0x000F000F, {magic}, 0xea;"]
    for p in (1, 2, 3):
        lines += [f"shr.b32 t{p}, $4, {4 * p};", f"lop3.b32 ${p}, t{p}, 0x000F000F, {magic}, 0xea;"]
    lines += [take_zero.format(p=p) for p in range(4)]
    return tl.constexpr("\n".join([*lines, "}"]))


# bf16: 128 + q, and an fma by one adds -(128 + z) (sub.bf16x2 needs sm_90; the fma runs from sm_80)
_INT4_PAIRS_BF16_ASM = _int4_pairs_asm("0x43004300", "fma.rn.bf16x2 ${p}, ${p}, one, $5;",
                                       ("mov.b32 one, 0x3F803F80;",))


# fp16: 1024 + q, minus (1024 + z)
_INT4_PAIRS_FP16_ASM = _int4_pairs_asm("0x64006400", "sub.f16x2 ${p}, ${p}, $5;")


@triton.jit
def _int4_pair_tile(words, z, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, IS_BF16: tl.constexpr):
    """The ``[BLOCK_N, GROUP]`` tile of ``q - z`` (activation type) from ``[BLOCK_N, GROUP / 8]`` int32 words and
    the rows' zero points, its columns in the pair order (column 8w + 2p + h = input 8w + p + 4h)."""
    # bf16: the bits of -(128 + z), which the fma adds; fp16: 1024 + z, which the sub takes away
    zh = z | (0xC300 if IS_BF16 else 0x6400)
    asm: tl.constexpr = _INT4_PAIRS_BF16_ASM if IS_BF16 else _INT4_PAIRS_FP16_ASM
    t0, t1, t2, t3 = tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r", [words, (zh | (zh << 16))[:, None] +
                                                                        tl.zeros_like(words)],
                                               dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    return _pair_columns(t0, t1, t2, t3, BLOCK_N, GROUP, IS_BF16)


@triton.jit
def _pair_program(N, tiles_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(K split, weight rows, their in-bounds mask, activation rows, first tile) of a 1..16-row pair-tile program."""
    pid_k = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    lo_t = pid_k * tiles_per_split          # the host makes the splits divide the tiles evenly
    return pid_k, n, n < N, tl.arange(0, BLOCK_M), lo_t


@triton.jit
def _pair_columns(t0, t1, t2, t3, BLOCK_N: tl.constexpr, TILE: tl.constexpr, IS_BF16: tl.constexpr):
    """``[BLOCK_N, TILE]`` 16-bit values from four ``[BLOCK_N, TILE / 8]`` int32 tensors of pairs (``tp`` of word w
    holds inputs 8w + p and 8w + p + 4 as its low and high half), column 8w + 2p + h holding input 8w + p + 4h."""
    WORDS: tl.constexpr = TILE // 8
    pairs = tl.reshape(tl.join(tl.join(t0, t2), tl.join(t1, t3)), [BLOCK_N, 4 * WORDS])     # column 4w + p
    halves = tl.join(pairs.to(tl.int16), (pairs >> 16).to(tl.int16))                         # h = 0: low half
    dt: tl.constexpr = tl.bfloat16 if IS_BF16 else tl.float16
    return tl.reshape(halves, [BLOCK_N, TILE]).to(dt, bitcast=True)


@triton.jit
def _pair_order_x(x_ptrs, mask, BLOCK_M: tl.constexpr, TILE: tl.constexpr):
    """The ``[BLOCK_M, TILE]`` activation tile at ``x_ptrs`` with its columns in the pair order of
    :func:`_pair_columns` (inputs 8w + 4h + p -> column 8w + 2p + h), permuted in registers."""
    xc = tl.load(x_ptrs, mask=mask, other=0.0)
    return tl.reshape(tl.permute(tl.reshape(xc, [BLOCK_M, TILE // 8, 2, 4]), (0, 1, 3, 2)), [BLOCK_M, TILE])


@triton.jit
def _pair_x(x_ptrs, mask, BLOCK_M: tl.constexpr, TILE: tl.constexpr, X_PAIRED: tl.constexpr):
    """The activation tile in pair order: loaded as it is when the host already permuted x (``X_PAIRED``,
    :func:`pair_order`: one copy per call instead of a register permutation per tile and program), else
    permuted here (:func:`_pair_order_x`)."""
    if X_PAIRED:
        return tl.load(x_ptrs, mask=mask, other=0.0)
    return _pair_order_x(x_ptrs, mask, BLOCK_M, TILE)


def pair_order(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` with each 8 columns in the pair order of :func:`_pair_columns` (input 8w + 4h + p at column
    8w + 2p + h): what :func:`_pair_order_x` does to a tile, done once for the whole call."""
    M, K = x.shape
    return x.view(M, K // 8, 2, 4).transpose(2, 3).reshape(M, K)


# NVFP4 for 1..16 rows on the tensor cores, the same pair order as int4. Each e2m1 code is placed into the bits of
# a 16-bit float: magnitude (3 bits) under the exponent's lowest bits, sign into bit 15. That is the code's value
# times 2^-126 (bf16) or 2^-14 (fp16) exactly, the smallest code (0.5) a subnormal. One fused pair op multiplies
# it by the block scale times 2^63 (bf16) or 2^7 (fp16): e2m1 (2 significant bits) times e4m3 (4) is exact in
# either type and lands in the normal range (value x scale x 2^-63 / 2^-7), so the weights reach the mma exact; the
# accumulated tile is scaled by the global scale and 2^63 / 2^7 once at the end. Inputs: word ($4), scale pair
# ($5); outputs: pairs p = 0..3 (magnitudes of nibbles p and p + 4 shifted under the exponent, their signs to bits
# 15 and 31, each masked before they are merged).


def _nvfp4_pairs_asm(mag_shifts: tuple[int, ...], mag_mask: str, fma: str) -> tl.constexpr:
    """The PTX of one word -> four NVFP4 pairs: per pair p, the magnitudes of nibbles p and p + 4 shifted by
    ``mag_shifts[p]`` (left if positive) under the exponent and masked, their signs (bits 4p + 3, 4p + 19) moved to
    bits 15 and 31 and masked, merged, and multiplied by the scale pair ``$5``."""
    lines = ["{", ".reg .b32 a, b, zero;", "mov.b32 zero, 0;"]
    for p, k in enumerate(mag_shifts):
        lines.append(f"{'shl' if k >= 0 else 'shr'}.b32 a, $4, {abs(k)};")
        if 12 - 4 * p:
            lines += [f"shl.b32 b, $4, {12 - 4 * p};", "and.b32 b, b, 0x80008000;"]
        else:
            lines.append("and.b32 b, $4, 0x80008000;")
        lines += [f"lop3.b32 a, a, {mag_mask}, b, 0xea;", f"{fma} ${p}, a, $5, zero;"]
    return tl.constexpr("\n".join([*lines, "}"]))


_NVFP4_PAIRS_BF16_ASM = _nvfp4_pairs_asm((6, 2, -2, -6), "0x01C001C0", "fma.rn.bf16x2")    # magnitude -> bits 6..8


_NVFP4_PAIRS_FP16_ASM = _nvfp4_pairs_asm((9, 5, 1, -3), "0x0E000E00", "fma.rn.f16x2")      # magnitude -> bits 9..11


NVFP4_BF16_SHIFT = tl.constexpr(63)    # block scales times 2^63 in the tile, undone on the accumulator (bf16)


NVFP4_FP16_SHIFT = tl.constexpr(7)     # ... 2^7 (fp16: 448 x 2^7 stays below 65504)


def wave_splits(n_blocks: int, n_tiles: int, want: int, min_tiles: int = 4) -> int:
    """K splits for a launch of ``n_blocks`` weight-row blocks over ``n_tiles`` K tiles: 1 when the row blocks
    alone reach ``want`` programs, else the smallest divisor of ``n_tiles`` (every split gets the same tiles) that
    does, keeping at least ``min_tiles`` tiles per split (the largest such divisor when none reaches ``want``)."""
    if n_blocks >= want:
        return 1
    ok = [d for d in range(1, n_tiles + 1) if n_tiles % d == 0 and n_tiles // d >= min(min_tiles, n_tiles)]
    reach = [d for d in ok if n_blocks * d >= want]
    return min(reach) if reach else max(ok)
