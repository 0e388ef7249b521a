"""The Triton programs of the weight-only packed products (``int4``, ``nvfp4``, ``fp8_block``) for 1..64 rows:
the tile designs are described in :mod:`edgespec.kernels.quant.triton_quant_gemv`, which picks and launches them;
the register-level decode they share with the other packed products lives in
:mod:`edgespec.kernels.quant.triton_quant_tiles`."""

from __future__ import annotations

import triton
import triton.language as tl

from edgespec.kernels.launch.triton_pdl import pdl_release, pdl_wait
from edgespec.kernels.quant.triton_quant_tiles import (
    _NVFP4_PAIRS_BF16_ASM,
    _NVFP4_PAIRS_FP16_ASM,
    NVFP4_BF16_SHIFT,
    NVFP4_FP16_SHIFT,
    _finish,
    _int4_pair_tile,
    _int4_word_values,
    _pair_columns,
    _pair_program,
    _pair_x,
)


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
