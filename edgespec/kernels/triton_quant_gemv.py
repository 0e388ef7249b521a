"""Weight-only quantized products ``y = x W^T`` for 1..64 activation rows (decode and verify) in Triton, reading
each packed weight byte once per call: ``int4`` (group-wise asymmetric, AWQ/GPTQ repacked), ``nvfp4`` (e2m1 with
per-16 e4m3 scales and a global fp32 scale) and ``fp8_block`` (e4m3 with 128x128 fp32 block scales), all in the
contract layouts of ``edgespec.kernels.quant_ref`` (the torch reference each kernel is tested against).

Why these shapes: a batch-1 step is bound by the bytes of the weights, so a kernel must stream the packed bytes at
copy speed and do little enough arithmetic per byte to keep up (at 3 TB/s, a 4-bit weight arrives every ~0.15 ns
per chip, ~4 instructions per weight across an H100's 132 SMs). Each program owns ``BLOCK_N`` output rows and
walks its K range one tile at a time; a tile is one quantization group (int4: ``group_size`` inputs, so one scale
and zero per row; fp8: one 128x128 block, so one scale per program; nvfp4: 128 inputs, eight per-16 scales).

* Nibbles are never interleaved in registers: the low nibbles of a tile multiply the even inputs and the high
  nibbles the odd ones (two products over half-width tiles), so unpacking is one AND or one shift per weight.
* int4 codes become floats by OR-ing them into the mantissa of 2^23 (no integer-to-float conversion); the zero
  point is subtracted in the same register (``(2^23 + q) - (2^23 + z)``, exact), and the scale is applied to the
  accumulated tile, not to every weight.
* e2m1 codes are placed into fp16 bits (magnitude into the exponent/mantissa, sign into bit 15): that is the
  e2m1 value times 2^-14 exactly (subnormal codes included), folded into the block scale.
* ``DOT`` programs (2..16 rows, and one row where it pays) run the rows as one 16-row tensor-core tile over the
  dequantized bf16 tile; one row can also go down a CUDA-core path (``DOT=False``) that multiplies in fp32.
  17..64 rows (tree verification) run as one 32- or 64-row tile, so the weight is still read and decoded once.
* Narrow matrices split K across programs and sum fp32 partials in a fixed order (no atomics: the same bits on
  every run), with ``edgespec.kernels.triton_gemv``'s split-sum kernel.

No repacking is needed for these loads (:func:`prepare_for_kernel` only checks the buffers), so the weight
classes' ``matmul_ref`` reads the very same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from edgespec.kernels import sm_count
from edgespec.kernels.triton_gemv import _split_sum_kernel
from edgespec.kernels.triton_pdl import pdl_launch, pdl_release, pdl_wait
from edgespec.kernels.triton_quant_prefill import DEQUANT_GEMM_MIN_ROWS, dequant_gemm

MAX_ROWS = 16
# 17..WIDE_MAX_ROWS rows (tree and long-chain verifies): the same tiles with 32 or 64 activation rows in one row
# block, so each weight is still read and decoded once per call (no dequantize-then-GEMM below the crossover).
WIDE_MAX_ROWS = 64
FORMATS = ("int4", "nvfp4", "fp8_block")


@triton.jit
def _program_mn(M, BLOCK_M: tl.constexpr, M_FAST: tl.constexpr):
    """(row block, weight row block) of this program. Many rows (prefill): the row blocks of one weight tile run
    next to each other, so the tile comes from DRAM once and from L2 for the others."""
    if M_FAST:
        pid = tl.program_id(0)
        m_blocks = tl.cdiv(M, BLOCK_M)
        return pid % m_blocks, pid // m_blocks
    return 0, tl.program_id(0)


@triton.jit
def _x_pairs(x_ptr, base, HALF: tl.constexpr):
    """fp32 inputs ``base + 2j`` and ``base + 2j + 1`` (j < HALF): the even/odd halves that multiply the low/high
    nibbles, from one contiguous load."""
    flat = tl.load(x_ptr + base + tl.arange(0, 2 * HALF)).to(tl.float32)
    return tl.split(tl.reshape(flat, [HALF, 2]))


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


@triton.jit
def _int4_kernel(x_ptr, q_ptr, s_ptr, z_ptr, part_ptr, b_ptr, y_ptr, M, N, n_tiles, tiles_per_split,
                 stride_xm, stride_qn, stride_sn, stride_zn, stride_ps, stride_pm, stride_ym,
                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
                 DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, M_FAST: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    HALF: tl.constexpr = GROUP // 2
    pid_m, pid_n = _program_mn(M, BLOCK_M, M_FAST)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, HALF)
    lo_t = pid_k * tiles_per_split          # the host makes the splits divide the tiles evenly
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_N, HALF], tl.float32)
    for i in range(0, tiles_per_split):
        t = lo_t + i
        b = tl.load(q_ptr + n[:, None] * stride_qn + (t * HALF + j)[None, :], mask=n_ok[:, None], other=0)
        b = b.to(tl.int32)
        z = tl.load(z_ptr + n * stride_zn + t, mask=n_ok, other=0).to(tl.int32)
        s = tl.load(s_ptr + n * stride_sn + t, mask=n_ok, other=0.0).to(tl.float32)
        c = (z | 0x4B000000).to(tl.float32, bitcast=True)            # 2^23 + z
        lo = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - c[:, None]     # q - z, exact
        hi = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - c[:, None]
        k_even = t * GROUP + 2 * j
        if DOT:
            xe = tl.load(x_ptr + m[:, None] * stride_xm + k_even[None, :], mask=m[:, None] < M, other=0.0)
            xo = tl.load(x_ptr + m[:, None] * stride_xm + (k_even + 1)[None, :], mask=m[:, None] < M, other=0.0)
            part = tl.dot(xe, tl.trans(lo.to(xe.dtype)))
            part = tl.dot(xo, tl.trans(hi.to(xo.dtype)), part)
            acc += part * s[None, :]
        else:
            xe, xo = _x_pairs(x_ptr, t * GROUP, HALF)
            acc2 += (lo * xe[None, :] + hi * xo[None, :]) * s[:, None]
    if not DOT:
        acc = tl.sum(acc2, axis=1)
    pdl_release(PDL)
    _finish(acc, part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, stride_pm, stride_ym, DOT, DIRECT, HAS_BIAS)


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


@triton.jit
def _int4_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, part_ptr, b_ptr, y_ptr, M, N, n_tiles, tiles_per_split,
                      stride_qn, stride_sn, stride_zn, stride_ps,
                      GROUP: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      PDL: tl.constexpr):
    """One row: the weights as int32 words (8 codes each), unpacked with fp16 pair arithmetic (see
    ``_INT4_WORD_ASM``), multiplied in fp32 and scaled once per word."""
    pdl_wait(PDL)
    WORDS: tl.constexpr = GROUP // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_idx = tl.arange(0, WORDS)
    acc2 = tl.zeros([BLOCK_N, WORDS], tl.float32)
    lo_t = pid_k * tiles_per_split
    # the next tile's words are loaded before this tile is unpacked: twice the bytes in flight per thread
    w_ptrs = q_ptr + n[:, None] * stride_qn + (lo_t * WORDS + w_idx)[None, :]
    nxt = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
    for i in range(0, tiles_per_split):
        t = lo_t + i
        words = nxt
        w_ptrs += WORDS
        nxt = tl.load(w_ptrs, mask=n_ok[:, None] & (i + 1 < tiles_per_split), other=0)
        z = tl.load(z_ptr + n * stride_zn + t, mask=n_ok, other=0).to(tl.int32)
        s = tl.load(s_ptr + n * stride_sn + t, mask=n_ok, other=0.0).to(tl.float32)
        zh = z | 0x6400
        zpair = zh | (zh << 16)
        v0, v1, v2, v3, v4, v5, v6, v7 = _int4_word_values(words, zpair[:, None] + tl.zeros_like(words))
        xf = tl.load(x_ptr + t * GROUP + tl.arange(0, GROUP)).to(tl.float32)
        xa, xb = tl.split(tl.reshape(xf, [WORDS, 4, 2]))          # j even / odd
        x0, x2 = tl.split(xa.reshape(WORDS, 2, 2))
        x1, x3 = tl.split(xb.reshape(WORDS, 2, 2))
        x0, x4 = tl.split(x0)
        x2, x6 = tl.split(x2)
        x1, x5 = tl.split(x1)
        x3, x7 = tl.split(x3)
        part = v0 * x0[None, :] + v1 * x1[None, :] + v2 * x2[None, :] + v3 * x3[None, :]
        part += v4 * x4[None, :] + v5 * x5[None, :] + v6 * x6[None, :] + v7 * x7[None, :]
        acc2 += part * s[:, None]
    acc = tl.sum(acc2, axis=1)
    m = tl.arange(0, 1)
    pdl_release(PDL)
    _finish(acc, part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, 0, 0, False, DIRECT, HAS_BIAS)


# The same unpacking, then the eight products of a word summed in fp16 pairs (four HFMA2) and widened once: ~2.25
# instructions per weight. Inputs: word ($1), (1024 + z) pair ($2), and the x pairs (x[8w + p], x[8w + p + 4]) as
# fp16 bits ($3..$6, p = 0..3); output: the fp32 sum of (q - z) * x over the word.
_INT4_WORD_DOT_ASM = tl.constexpr("""
{
.reg .b32 t0, t1, t2, t3, a;
.reg .b16 lo, hi;
.reg .f32 fl, fh;
lop3.b32 t0, $1, 0x000F000F, 0x64006400, 0xea;
shr.b32 t1, $1, 4;
lop3.b32 t1, t1, 0x000F000F, 0x64006400, 0xea;
shr.b32 t2, $1, 8;
lop3.b32 t2, t2, 0x000F000F, 0x64006400, 0xea;
shr.b32 t3, $1, 12;
lop3.b32 t3, t3, 0x000F000F, 0x64006400, 0xea;
sub.f16x2 t0, t0, $2;
sub.f16x2 t1, t1, $2;
sub.f16x2 t2, t2, $2;
sub.f16x2 t3, t3, $2;
mul.rn.f16x2 a, t0, $3;
fma.rn.f16x2 a, t1, $4, a;
fma.rn.f16x2 a, t2, $5, a;
fma.rn.f16x2 a, t3, $6, a;
mov.b32 {lo, hi}, a;
cvt.f32.f16 fl, lo;
cvt.f32.f16 fh, hi;
add.f32 $0, fl, fh;
}
""")

# x is scaled by 2^-X_SHIFT before it becomes fp16 (and the group scale by 2^X_SHIFT): a word's fp16 partial sum
# (at most 4 x 15 x |x| per lane) stays finite for |x| up to ~17k.
X_SHIFT = 4


@triton.jit
def _int4_gemv_h2_kernel(x_ptr, q_ptr, s_ptr, z_ptr, part_ptr, b_ptr, y_ptr, M, N, n_tiles, tiles_per_split,
                         stride_qn, stride_sn, stride_zn, stride_ps,
                         GROUP: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PDL: tl.constexpr):
    """One row, products in fp16 pairs per word (``_INT4_WORD_DOT_ASM``), accumulated in fp32 across words."""
    pdl_wait(PDL)
    WORDS: tl.constexpr = GROUP // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_idx = tl.arange(0, WORDS)
    acc2 = tl.zeros([BLOCK_N, WORDS], tl.float32)
    lo_t = pid_k * tiles_per_split
    w_ptrs = q_ptr + n[:, None] * stride_qn + (lo_t * WORDS + w_idx)[None, :]
    nxt = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
    for i in range(0, tiles_per_split):
        t = lo_t + i
        words = nxt
        w_ptrs += WORDS
        nxt = tl.load(w_ptrs, mask=n_ok[:, None] & (i + 1 < tiles_per_split), other=0)
        z = tl.load(z_ptr + n * stride_zn + t, mask=n_ok, other=0).to(tl.int32)
        s = tl.load(s_ptr + n * stride_sn + t, mask=n_ok, other=0.0).to(tl.float32) * (1 << 4)
        zh = z | 0x6400
        zpair = (zh | (zh << 16))[:, None] + tl.zeros_like(words)
        xf = tl.load(x_ptr + t * GROUP + tl.arange(0, GROUP)).to(tl.float32) * (1.0 / (1 << 4))
        bits = xf.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        lo_b, hi_b = tl.split(tl.permute(tl.reshape(bits, [WORDS, 2, 4]), (0, 2, 1)))   # inputs p and p + 4
        pairs = lo_b | (hi_b << 16)                                                       # [WORDS, 4] over p
        e, o = tl.split(tl.reshape(pairs, [WORDS, 2, 2]))
        xp0, xp2 = tl.split(e)
        xp1, xp3 = tl.split(o)
        zero = tl.zeros_like(words)
        part = tl.inline_asm_elementwise(
            _INT4_WORD_DOT_ASM, "=r,r,r,r,r,r,r",
            [words, zpair, xp0[None, :] + zero, xp1[None, :] + zero, xp2[None, :] + zero, xp3[None, :] + zero],
            dtype=tl.float32, is_pure=True, pack=1)
        acc2 += part * s[:, None]
    acc = tl.sum(acc2, axis=1)
    m = tl.arange(0, 1)
    pdl_release(PDL)
    _finish(acc, part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, 0, 0, False, DIRECT, HAS_BIAS)


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


@triton.jit
def _nvfp4_pair_dot_kernel(x_ptr, q_ptr, s_ptr, scale2_ptr, part_ptr, b_ptr, y_ptr, M, N, n_tiles, tiles_per_split,
                           stride_xm, stride_qn, stride_sn, stride_ps, stride_pm, stride_ym,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_BF16: tl.constexpr,
                           DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
                           X_PAIRED: tl.constexpr = False):
    """1..64 rows (a 16-, 32- or 64-row tile): one tensor-core tile per 128 inputs over the pair-ordered,
    block-scaled weight tile (see ``_NVFP4_PAIRS_BF16_ASM``); the tile products accumulate in the mma, scaled once
    at the end."""
    TILE: tl.constexpr = 128
    WORDS: tl.constexpr = TILE // 8
    NB: tl.constexpr = TILE // 16
    SHIFT: tl.constexpr = NVFP4_BF16_SHIFT if IS_BF16 else NVFP4_FP16_SHIFT
    HALF: tl.constexpr = tl.bfloat16 if IS_BF16 else tl.float16
    ASM: tl.constexpr = _NVFP4_PAIRS_BF16_ASM if IS_BF16 else _NVFP4_PAIRS_FP16_ASM
    pdl_wait(PDL)
    pid_k, n, n_ok, m, lo_t = _pair_program(N, tiles_per_split, BLOCK_M, BLOCK_N)
    # words as [rows, scale blocks, 2]: a block's scale pair is broadcast over its two words in registers
    w_ptrs = (q_ptr + n[:, None, None] * stride_qn + lo_t * WORDS + tl.arange(0, NB)[None, :, None] * 2
              + tl.arange(0, 2)[None, None, :])
    s_ptrs = s_ptr + n[:, None] * stride_sn + (lo_t * NB + tl.arange(0, NB))[None, :]
    x_ptrs = x_ptr + m[:, None] * stride_xm + (lo_t * TILE + tl.arange(0, TILE))[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, tiles_per_split):
        words = tl.load(w_ptrs, mask=n_ok[:, None, None], other=0)
        sc = tl.load(s_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32) * (2.0 ** SHIFT)
        sb = sc.to(HALF).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        spair = (sb | (sb << 16))[:, :, None] + tl.zeros_like(words)
        t0, t1, t2, t3 = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r", [words, spair], dtype=(tl.int32,) * 4,
                                                   is_pure=True, pack=1)
        t0 = tl.reshape(t0, [BLOCK_N, WORDS])
        t1 = tl.reshape(t1, [BLOCK_N, WORDS])
        t2 = tl.reshape(t2, [BLOCK_N, WORDS])
        t3 = tl.reshape(t3, [BLOCK_N, WORDS])
        w = _pair_columns(t0, t1, t2, t3, BLOCK_N, TILE, IS_BF16)
        x = _pair_x(x_ptrs, m[:, None] < M, BLOCK_M, TILE, X_PAIRED)
        acc = tl.dot(x, tl.trans(w), acc)
        w_ptrs += WORDS
        s_ptrs += NB
        x_ptrs += TILE
    acc = acc * (tl.load(scale2_ptr) * (2.0 ** SHIFT))        # the weights were value x scale x 2^-SHIFT
    pdl_release(PDL)
    _finish(acc, part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, stride_pm, stride_ym, True, DIRECT, HAS_BIAS)


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ``ptrs`` (no registers written, nothing waited for)."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\nmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _int4_pair_dot_kernel(x_ptr, q_ptr, s_ptr, z_ptr, part_ptr, b_ptr, y_ptr, M, N, n_tiles, tiles_per_split,
                          stride_xm, stride_qn, stride_sn, stride_zn, stride_ps, stride_pm, stride_ym,
                          GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_BF16: tl.constexpr,
                          DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
                          X_PAIRED: tl.constexpr = False):
    """1..64 rows (a 16-, 32- or 64-row tile): one tensor-core tile per quantization group over the pair-ordered
    ``q - z`` tile (``_int4_pair_tile``), the group's scale applied to the tile's fp32 product. ``PREFETCH`` > 0:
    before waiting for the previous kernel (PDL), ask L2 for the first ``PREFETCH`` 128-byte lines of each of the
    program's rows: weights are never written during a step, so they may be read early, and the first tiles then
    come from L2."""
    WORDS: tl.constexpr = GROUP // 8
    pid_k, n, n_ok, m, lo_t = _pair_program(N, tiles_per_split, BLOCK_M, BLOCK_N)
    if PREFETCH > 0:
        line = tl.minimum(tl.arange(0, PREFETCH) * 32, tiles_per_split * WORDS - 1)     # 32 words = 128 bytes
        _prefetch_l2(q_ptr + tl.minimum(n, N - 1)[:, None] * stride_qn + lo_t * WORDS + line[None, :])
    pdl_wait(PDL)
    w_ptrs = q_ptr + n[:, None] * stride_qn + (lo_t * WORDS + tl.arange(0, WORDS))[None, :]
    x_ptrs = x_ptr + m[:, None] * stride_xm + (lo_t * GROUP + tl.arange(0, GROUP))[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(0, tiles_per_split):
        t = lo_t + i
        words = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        z = tl.load(z_ptr + n * stride_zn + t, mask=n_ok, other=0).to(tl.int32)
        s = tl.load(s_ptr + n * stride_sn + t, mask=n_ok, other=0.0).to(tl.float32)
        w = _int4_pair_tile(words, z, BLOCK_N, GROUP, IS_BF16)
        x = _pair_x(x_ptrs, m[:, None] < M, BLOCK_M, GROUP, X_PAIRED)
        acc += tl.dot(x, tl.trans(w)) * s[None, :]
        w_ptrs += WORDS
        x_ptrs += GROUP
    pdl_release(PDL)
    _finish(acc, part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, stride_pm, stride_ym, True, DIRECT, HAS_BIAS)


@triton.jit
def _nvfp4_kernel(x_ptr, q_ptr, s_ptr, scale2_ptr, part_ptr, b_ptr, y_ptr, M, N, n_tiles, tiles_per_split,
                  stride_xm, stride_qn, stride_sn, stride_ps, stride_pm, stride_ym,
                  TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
                  DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, M_FAST: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    HALF: tl.constexpr = TILE // 2
    NB: tl.constexpr = TILE // 16
    pid_m, pid_n = _program_mn(M, BLOCK_M, M_FAST)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, HALF)
    # e2m1 placed in fp16 bits is the value x 2^-14: fold 2^14 into the global scale
    scale2 = tl.load(scale2_ptr) * 16384.0
    lo_t = pid_k * tiles_per_split          # the host makes the splits divide the tiles evenly
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_N, NB], tl.float32)
    for i in range(0, tiles_per_split):
        t = lo_t + i
        b = tl.load(q_ptr + n[:, None] * stride_qn + (t * HALF + j)[None, :], mask=n_ok[:, None], other=0)
        b = b.to(tl.int32)
        # one e4m3 scale per 16 inputs = per 8 bytes (from cache after the first touch)
        # one e4m3 scale per 16 inputs = per 8 bytes: applied to per-block partial sums (one-row path) or to the
        # weights as [BLOCK_N, blocks, 8] (tensor-core path), never gathered per byte
        sc = tl.load(s_ptr + n[:, None] * stride_sn + (t * NB + tl.arange(0, NB))[None, :], mask=n_ok[:, None],
                     other=0.0).to(tl.float32) * scale2
        lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        k_even = t * TILE + 2 * j
        if DOT:
            lo = tl.reshape(tl.reshape(lo, [BLOCK_N, NB, 8]) * sc[:, :, None], [BLOCK_N, HALF])
            hi = tl.reshape(tl.reshape(hi, [BLOCK_N, NB, 8]) * sc[:, :, None], [BLOCK_N, HALF])
            xe = tl.load(x_ptr + m[:, None] * stride_xm + k_even[None, :], mask=m[:, None] < M, other=0.0)
            xo = tl.load(x_ptr + m[:, None] * stride_xm + (k_even + 1)[None, :], mask=m[:, None] < M, other=0.0)
            acc = tl.dot(xe, tl.trans(lo.to(xe.dtype)), acc)
            acc = tl.dot(xo, tl.trans(hi.to(xo.dtype)), acc)
        else:
            xe, xo = _x_pairs(x_ptr, t * TILE, HALF)
            prod = lo * xe[None, :] + hi * xo[None, :]
            acc2 += tl.sum(tl.reshape(prod, [BLOCK_N, NB, 8]), axis=2) * sc
    if not DOT:
        acc = tl.sum(acc2, axis=1)
    pdl_release(PDL)
    _finish(acc, part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, stride_pm, stride_ym, DOT, DIRECT, HAS_BIAS)


@triton.jit
def _fp8_block_kernel(x_ptr, w_ptr, s_ptr, part_ptr, b_ptr, y_ptr, M, N, K, n_tiles, tiles_per_split,
                      stride_xm, stride_wn, stride_sn, stride_ps, stride_pm, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr,
                      DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, M_FAST: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    # BLOCK_N divides 128, so a program's rows share one row of the scale grid; a K tile is one 128-wide block.
    pid_m, pid_n = _program_mn(M, BLOCK_M, M_FAST)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, 128)
    s_row = s_ptr + ((pid_n * BLOCK_N) // 128) * stride_sn
    lo_t = pid_k * tiles_per_split          # the host makes the splits divide the tiles evenly
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_N, 128], tl.float32)
    for i in range(0, tiles_per_split):
        t = lo_t + i
        k = t * 128 + kk
        s = tl.load(s_row + t)
        if EVEN_K:
            w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & (k < K)[None, :],
                        other=0.0)
        if DOT:
            x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k < K)[None, :],
                        other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype))) * s
        else:
            x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            acc2 += w.to(tl.float32) * (x * s)[None, :]
    if not DOT:
        acc = tl.sum(acc2, axis=1)
    pdl_release(PDL)
    _finish(acc, part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, stride_pm, stride_ym, DOT, DIRECT, HAS_BIAS)


# ---- launch ---------------------------------------------------------------------------------------------------

def wave_splits(n_blocks: int, n_tiles: int, want: int, min_tiles: int = 4) -> int:
    """K splits for a launch of ``n_blocks`` weight-row blocks over ``n_tiles`` K tiles: 1 when the row blocks
    alone reach ``want`` programs, else the smallest divisor of ``n_tiles`` (every split gets the same tiles) that
    does, keeping at least ``min_tiles`` tiles per split (the largest such divisor when none reaches ``want``)."""
    if n_blocks >= want:
        return 1
    ok = [d for d in range(1, n_tiles + 1) if n_tiles % d == 0 and n_tiles // d >= min(min_tiles, n_tiles)]
    reach = [d for d in ok if n_blocks * d >= want]
    return min(reach) if reach else max(ok)


# (format, row bucket: 1, 2..16 -> 16, 17..32 -> 32, 33..64 -> 64) -> the weight-major tile of
# edgespec.kernels.triton_quant_wide where it beats this module's tiles on the Qwen3.5-27B stack on a 16-SM green
# context (tools/tile_sweep.py --sm-limit 16; figures: docs/benchmarks.md, "Weight-major tiles on Thor's SM
# budget"). Elsewhere (int4 1..32 rows, block-FP8 1..32) this module's activation-major tiles are faster.
WIDE_LAUNCHES: dict[tuple[str, int], dict[str, int]] = {
    ("nvfp4", 1): {"T": 1, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "PDL": 0},
    ("nvfp4", 16): {"T": 1, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PDL": 0},
    ("nvfp4", 32): {"T": 1, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PDL": 0},
    ("nvfp4", 64): {"T": 1, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PDL": 0},
    ("int4", 64): {"T": 1, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PDL": 1},
    ("fp8_block", 64): {"T": 1, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PDL": 0},
}


def quant_config(fmt: str, N: int, K: int, M: int, sms: int) -> dict[str, int]:
    """Launch of one product: the per-matrix winners of ``tools/quant_bench.py --sweep`` (H100; int4 on an
    H200; docs/quant_kernels.md). 1..16 rows: ``BLOCK_N`` weight rows per program, ``SPLIT_K`` K
    ranges when there are too few row blocks to fill the chip (about ``waves`` programs per SM). One int4/nvfp4
    row takes the CUDA-core path (int4: the word kernel with fp16-pair products, ``H2``; a vocabulary-wide int4
    matrix the pair tile), fp8 rows and 2+ rows the tensor-core tile (int4: the pair tile). More rows (prefill):
    64x128 output tiles, the row blocks of a weight tile side by side."""
    if M > WIDE_MAX_ROWS:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "SPLIT_K": 1, "DOT": 1, "num_warps": 8, "num_stages": 3}
    if M > MAX_ROWS:
        # 17..64 rows: one row block of 32 or 64 rows, so a weight tile is decoded once for all of them; wider
        # weight blocks than at 16 rows, because every program reads the whole activation block from L2 once per
        # tile (at 64 rows and 64 weight rows that is as many L2 bytes as weight bytes). Warps, block widths and
        # where x is permuted once on the host (XPAIR) are the winners of tools/quant_bench.py --wide-sweep
        # (figures: docs/benchmarks.md, "Kernel launch choices")
        block_m = max(32, triton.next_power_of_2(M))
        block_n, x_pair = {("int4", 32): (128, 0), ("int4", 64): (64, 1), ("nvfp4", 32): (128, 1),
                           ("nvfp4", 64): (64, 1), ("fp8_block", 32): (64, 0), ("fp8_block", 64): (128, 0)}[
            fmt, block_m]
        warps, stages, waves = 4, 3, 2
        cfg = {"BLOCK_M": block_m, "DOT": 1, "PAIRS": int(fmt != "fp8_block"), "XPAIR": x_pair, "num_warps": warps,
               "num_stages": stages}
    elif fmt == "int4" and (M > 1 or N >= 65536) or fmt == "nvfp4" and M > 1:
        # 2..16 rows, and one int4 row of a vocabulary-wide matrix: the pair-ordered tensor-core tile
        # (``_int4_pair_dot_kernel``, ``_nvfp4_pair_dot_kernel``); the int4 lm_head asks L2 for its first lines
        # before the PDL wait
        block_n, warps, stages, waves = (64 if N <= 8192 else 128), 4, 3, 4
        # nvfp4 2..16 rows: x permuted once on the host (XPAIR) rather than in every program, the faster there
        cfg = {"BLOCK_M": 16, "DOT": 1, "PAIRS": 1, "PREFETCH": 4 if N >= 65536 else 0, "num_warps": warps,
               "num_stages": stages, "XPAIR": int(fmt == "nvfp4" and M > 1)}
    elif M == 1 and fmt != "fp8_block":
        block_n, warps, stages, waves = {"int4": (64, 4, 3, 4), "nvfp4": (32, 4, 4, 4)}[fmt]
        cfg = {"BLOCK_M": 16, "DOT": 0, "num_warps": warps, "num_stages": stages, "H2": int(fmt == "int4")}
    else:
        # fp8: one row rides the 16-row tensor-core tile too (the per-matrix sweep's best on most 27B matrices),
        # so a decode row and a verify row take the same launch
        block_n, warps, stages, waves = (128, 4, 3, 2) if fmt != "fp8_block" else (32, 4, 4, 4)
        cfg = {"BLOCK_M": 16, "DOT": 1, "num_warps": warps, "num_stages": stages}
    wide = WIDE_LAUNCHES.get((fmt, 1 if M == 1 else 16 if M <= MAX_ROWS else 32 if M <= 32 else 64))
    if wide is not None:      # a tile of edgespec.kernels.triton_quant_wide is faster at this row bucket
        cfg, block_n = {**cfg, **wide}, wide["BLOCK_N"]
    n_blocks = triton.cdiv(N, block_n)
    n_tiles = triton.cdiv(K, 128)
    want = waves * sms
    if M == 1:
        # one row: the smallest even K split that reaches the programs wanted, the per-matrix split sweep's best
        # on the 4B's 2560-wide matrices (tools/tile_sweep.py --split-shape; figures: docs/benchmarks.md)
        splits = wave_splits(n_blocks, n_tiles, want)
    else:
        splits = 1 if n_blocks >= want // 2 else max(1, min(triton.cdiv(want, n_blocks), n_tiles // 4))
    # PDL (where the device has it) for int4 only: it makes the int4 products faster and the 16-row tiles of
    # block-FP8 and NVFP4 slower (figures: docs/benchmarks.md, "Kernel launch choices"); WIDE_LAUNCHES name their own
    return {**cfg, "BLOCK_N": block_n, "SPLIT_K": splits, "PDL": cfg.get("PDL", int(fmt == "int4"))}


def _check(packed, x: torch.Tensor) -> None:
    fmt = packed.format
    if x.dim() != 2 or x.shape[1] != packed.in_features:
        raise ValueError(f"{fmt} product: x {tuple(x.shape)} does not end in in_features={packed.in_features}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{fmt} product: x must be bf16 or fp16, got {x.dtype}")
    if fmt == "int4" and (packed.group_size not in (32, 64, 128, 256) or packed.in_features % packed.group_size):
        raise ValueError(f"int4 product: group size {packed.group_size} must be 32..256 (a power of two) and "
                         f"divide in_features={packed.in_features}")
    if fmt == "nvfp4" and packed.in_features % 128:
        raise ValueError(f"nvfp4 product: in_features={packed.in_features} must be a multiple of 128")


def quant_matmul(packed, x: torch.Tensor, bias: torch.Tensor | None = None,
                 config: dict[str, int] | None = None) -> torch.Tensor:
    """``x [..., in] @ W^T (+ bias)`` for bf16/fp16 ``x`` and a packed weight with the contract buffer names
    (``packed.format`` picks the kernel), output in x's dtype. 1..16 rows: the decode/verify launch; 17..64
    (:data:`WIDE_MAX_ROWS`): the same tiles with one 32- or 64-row block (each weight read once); below
    ``DEQUANT_GEMM_MIN_ROWS[format]``: the many-row launch of the same kernels; more (prefill): dequantize-then-GEMM.
    ``config`` overrides the launch (benchmark sweeps; ``DEQUANT`` 0/1 forces the fused or the GEMM path)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    _check(packed, x2)
    M, N, K = x2.shape[0], packed.out_features, packed.in_features
    fmt = packed.format
    cfg = {**quant_config(fmt, N, K, M, sm_count(x.device)), **(config or {})}
    if cfg.get("DEQUANT", int(M >= DEQUANT_GEMM_MIN_ROWS[fmt])):
        # prefill: dequantize a band of rows, multiply on the tensor cores (edgespec.kernels.triton_quant_prefill)
        return dequant_gemm(packed, x2, bias).reshape(*lead, N)
    if cfg.get("T", 0) and M <= WIDE_MAX_ROWS:
        # the weight-major tiles (weights the left MMA operand): edgespec.kernels.triton_quant_wide
        from edgespec.kernels.triton_quant_wide import wide_t_matmul
        y = wide_t_matmul(packed, x2, bias, cfg, sm_count(x.device))
        if y is not None:
            return y.reshape(*lead, N)
    tiling = _tiling(packed, M, cfg)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    part = y if tiling.direct else torch.empty((tiling.splits, M, N), dtype=torch.float32, device=x.device)
    # PDL (SM90+): the next launch is scheduled while this one drains; every kernel waits for its predecessor first
    pdl = pdl_launch(x.device) if cfg.get("PDL", 0) else {}
    _launch_fused(packed, x2, bias, cfg, tiling, part, y, pdl)
    if not tiling.direct:
        _split_sum_kernel[(M, triton.cdiv(N, 1024))](
            part, bias if bias is not None else part, y, M, N, tiling.splits, part.stride(0), part.stride(1),
            y.stride(0), HAS_BIAS=bias is not None, SPLITS_P2=max(2, triton.next_power_of_2(tiling.splits)),
            BLOCK=1024, num_warps=4, PDL=bool(pdl), **pdl)
    return y.reshape(*lead, N)


@dataclass(frozen=True)
class _Tiling:
    """How one fused product of :func:`quant_matmul` is cut: row and column blocks, K tiles and their split."""

    many: bool          # more than WIDE_MAX_ROWS rows: the many-row launch (row blocks on the grid)
    block_m: int
    block_n: int
    tile: int           # K elements per scale tile (the int4 group, else 128)
    n_tiles: int
    splits: int         # K split across programs (1: each program writes its output directly)
    per_split: int

    @property
    def direct(self) -> bool:
        return self.splits == 1

    def grid(self, M: int, N: int) -> tuple[int, int]:
        return (triton.cdiv(N, self.block_n) * (triton.cdiv(M, self.block_m) if self.many else 1), self.splits)


def _tiling(packed, M: int, cfg: dict[str, int]) -> _Tiling:
    """The tiling of a fused product of ``M`` rows; sets ``cfg``'s ``DOT`` (tensor-core dot above one row) and
    ``SPLIT_K`` (none for many rows) in place, as the launch reads them."""
    many = M > WIDE_MAX_ROWS
    # 1..16 rows: one 16-row tile; 17..64: one row block of 32 or 64 (never fewer rows than M: one weight read)
    block_m = cfg["BLOCK_M"] if many else 16 if M <= MAX_ROWS else max(cfg["BLOCK_M"], triton.next_power_of_2(M))
    if M > 1:
        cfg["DOT"] = 1
    if many:
        cfg["SPLIT_K"] = 1
    block_n = cfg["BLOCK_N"]
    if packed.format == "fp8_block" and 128 % block_n:
        raise ValueError(f"fp8_block product: BLOCK_N {block_n} must divide the 128-row scale block")
    tile = 128 if packed.format != "int4" else packed.group_size
    n_tiles = triton.cdiv(packed.in_features, tile)
    splits = max(d for d in range(1, min(cfg["SPLIT_K"], n_tiles) + 1) if n_tiles % d == 0)
    return _Tiling(many, block_m, block_n, tile, n_tiles, splits, n_tiles // splits)


def _launch_fused(packed, x2: torch.Tensor, bias: torch.Tensor | None, cfg: dict[str, int], t: _Tiling,
                  part: torch.Tensor, y: torch.Tensor, pdl: dict) -> None:
    """Launch the format's fused kernel: into ``y`` directly, or per K split into ``part`` (summed after)."""
    fmt, direct, tile, n_tiles, per_split = packed.format, t.direct, t.tile, t.n_tiles, t.per_split
    M, N, K = x2.shape[0], packed.out_features, packed.in_features
    b = bias if bias is not None else y
    grid = t.grid(M, N)
    launch = dict(PDL=bool(pdl), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl)
    common = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, DOT=bool(cfg["DOT"]), DIRECT=direct,
                  HAS_BIAS=bias is not None, M_FAST=t.many, **launch)
    ps, pm = (part.stride(0), part.stride(1)) if not direct else (0, 0)
    pairs = fmt in ("int4", "nvfp4") and cfg["DOT"] and cfg.get("PAIRS", 0) and not t.many
    x_paired = bool(pairs and cfg.get("XPAIR", 0))
    xk = pair_order(x2) if x_paired else x2
    if fmt == "int4" and pairs:
        q, s, z = packed.qweight, packed.scales, packed.zeros
        qw = q.view(torch.int32)                 # 8 codes per word: rows of in/2 bytes are whole words
        _int4_pair_dot_kernel[grid](xk, qw, s, z, part, b, y, M, N, n_tiles, per_split, xk.stride(0), qw.stride(0),
                                    s.stride(0), z.stride(0), ps, pm, y.stride(0), GROUP=tile, BLOCK_M=t.block_m,
                                    BLOCK_N=t.block_n, IS_BF16=x2.dtype == torch.bfloat16, DIRECT=direct,
                                    HAS_BIAS=bias is not None, PREFETCH=cfg.get("PREFETCH", 0) if pdl else 0,
                                    X_PAIRED=x_paired, **launch)
    elif fmt == "int4" and M == 1 and not cfg["DOT"] and cfg.get("WORDS", 1):
        q, s, z = packed.qweight, packed.scales, packed.zeros
        qw = q.view(torch.int32)                 # 8 codes per word: rows of in/2 bytes are whole words
        kern = _int4_gemv_h2_kernel if cfg.get("H2", 0) else _int4_gemv_kernel
        kern[grid](x2, qw, s, z, part, b, y, M, N, n_tiles, per_split, qw.stride(0), s.stride(0),
                   z.stride(0), ps, GROUP=tile, BLOCK_N=t.block_n, DIRECT=direct, HAS_BIAS=bias is not None,
                   **launch)
    elif fmt == "int4":
        q, s, z = packed.qweight, packed.scales, packed.zeros
        _int4_kernel[grid](x2, q, s, z, part, b, y, M, N, n_tiles, per_split, x2.stride(0), q.stride(0),
                           s.stride(0), z.stride(0), ps, pm, y.stride(0), GROUP=tile, **common)
    elif fmt == "nvfp4" and pairs:
        qw = packed.weight.view(torch.int32)     # 8 codes per word: rows of in/2 bytes are whole words
        s = packed.weight_scale
        _nvfp4_pair_dot_kernel[grid](xk, qw, s, packed.weight_scale_2, part, b, y, M, N, n_tiles, per_split,
                                     xk.stride(0), qw.stride(0), s.stride(0), ps, pm, y.stride(0),
                                     BLOCK_M=t.block_m, BLOCK_N=t.block_n, IS_BF16=x2.dtype == torch.bfloat16,
                                     DIRECT=direct, HAS_BIAS=bias is not None, X_PAIRED=x_paired, **launch)
    elif fmt == "nvfp4":
        q, s = packed.weight, packed.weight_scale
        _nvfp4_kernel[grid](x2, q, s, packed.weight_scale_2, part, b, y, M, N, n_tiles, per_split, x2.stride(0),
                            q.stride(0), s.stride(0), ps, pm, y.stride(0), TILE=tile, **common)
    elif fmt == "fp8_block":
        w, s = packed.weight, packed.weight_scale_inv
        _fp8_block_kernel[grid](x2, w, s, part, b, y, M, N, K, n_tiles, per_split, x2.stride(0), w.stride(0),
                                s.stride(0), ps, pm, y.stride(0), EVEN_K=K % 128 == 0, **common)
    else:
        raise ValueError(f"no Triton product for weight format {fmt!r}")


def quant_kernel(packed, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``PackedWeight.kernel`` signature: the Triton product for bf16/fp16 CUDA inputs without autograd,
    the format's torch reference (``packed.matmul_ref``) for anything else (CPU tensors, fp32, gradients)."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and not torch.is_grad_enabled():
        return quant_matmul(packed, x, bias)
    return packed.matmul_ref(x, bias)


# Lowest compute capability each kernel runs on: bf16 tensor-core tiles need SM80; e4m3 conversions SM89.
MIN_CAPABILITY = {"int4": (8, 0), "nvfp4": (8, 0), "fp8_block": (8, 9)}


def choose_quant_kernel(packed, capability: tuple[int, int] | None = None):
    """The fast product for a packed weight on its device (for the arch hooks to store in ``packed.kernel``), or
    None when there is none (CPU, no Triton, an unknown format, too old a GPU, a shape the kernels refuse).
    ``capability``: choose for that compute capability, wherever the weight lives (``compile_targets``).

    These are the Hopper-shaped products; from compute capability 10 the Thor hooks give NVFP4 and MXFP4 the
    block-scaled MMA instead (``edgespec.kernels.triton_block_scaled``)."""
    from edgespec.kernels import triton_available
    fmt = getattr(packed, "format", None)
    if fmt not in MIN_CAPABILITY or not triton_available():
        return None
    dev = packed.weight.device if fmt != "int4" else packed.qweight.device
    if capability is None and dev.type != "cuda":
        return None
    if (capability or torch.cuda.get_device_capability(dev)) < MIN_CAPABILITY[fmt]:
        return None
    if fmt == "int4" and (packed.group_size not in (32, 64, 128, 256) or packed.in_features % packed.group_size):
        return None
    if fmt == "nvfp4" and packed.in_features % 128:
        return None
    if fmt == "fp8_block" and _fp8_block_shape(packed) != (128, 128):
        return None     # the tile reads one scale per 128x128 block (compressed-tensors may declare others)
    return quant_kernel


def _fp8_block_shape(packed) -> tuple[int, int]:
    """The scale block of a block-FP8 weight: a packed FP8BlockWeight names it; the kernel view
    (``quant_ref.RawPacked``) keeps its square group."""
    block = getattr(packed, "block", None) or (packed.group_size, packed.group_size)
    return int(block[0]), int(block[1])


def prepare_for_kernel(packed):
    """Make ``packed``'s buffers ready for :func:`quant_kernel` in place and return it. The kernels read the
    contract layouts as they are (no transposition or nibble shuffle pays: rows are streamed along K either
    way), so this only makes the buffers row-contiguous (a no-op for loaded weights) and checks their dtypes;
    ``matmul_ref`` keeps working on the same tensors."""
    names = {"int4": ("qweight", "scales", "zeros"), "nvfp4": ("weight", "weight_scale", "weight_scale_2"),
             "fp8_block": ("weight", "weight_scale_inv")}[packed.format]
    dtypes = {"qweight": torch.uint8, "zeros": torch.uint8, "scales": torch.float16,
              "weight_scale": torch.float8_e4m3fn, "weight_scale_2": torch.float32, "weight_scale_inv": torch.float32,
              "weight": torch.uint8 if packed.format == "nvfp4" else torch.float8_e4m3fn}
    for name in names:
        t = getattr(packed, name)
        if t.dtype != dtypes[name]:
            raise ValueError(f"{packed.format}.{name}: dtype {t.dtype}, expected {dtypes[name]}")
        if t.dim() == 2 and t.stride(-1) != 1:
            t = t.contiguous()
            if hasattr(packed, "tensors"):
                packed.tensors[name] = t
            else:
                setattr(packed, name, t)
    return packed
