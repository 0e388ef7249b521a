"""GGUF K-quant products for 1..4 activation rows on the CUDA cores (decode and short verifies): Q4_K, Q5_K and
Q6_K read in the file's own super-blocks (no repack, no second copy), accumulated in fp32.

Why not the tensor-core tiles of :mod:`edgespec.kernels.quant.triton_kquant` here: a one-row step runs a 16-row MMA tile
over weights decoded into shared memory, so a row pays the tile's decode-store-reload for 16. A batch-1 step is
bound by the bytes of the weights and by how fast each small product starts and drains; the int4 word GEMV
(``edgespec.kernels.quant.triton_quant_gemv``) showed the CUDA-core path wins there (docs/benchmarks.md).

Layouts: :mod:`edgespec.weights.gguf_kquants`. Each program owns ``BLOCK_N`` weight rows and a run of super-blocks
(the K split, sized by ``wave_splits`` to fill the SMs and summed in a fixed order by the split-sum kernel, so the
same bits on every run); the activation rows (up to :data:`GEMV_MAX_ROWS`) each keep their own accumulator and
run the very same operations, so a row's result does not depend on how many rows ride with it. How many rows each
format is sent here is ``edgespec.kernels.quant.route.KQUANT_GEMV_ROWS`` (Q4_K one, Q6_K up to four: where it beats the
tiles).

* Q4_K / Q5_K (read as int32 words, 36 / 44 per super-block): per sub-block of 32 the products ``sum(q * x)``
  are accumulated per word column, then scaled once: ``acc += (d * sc) * dot - (dmin * m) * sum(x)``. Q4_K's
  codes become floats without shifts or integer conversions: the nibble at bits ``s .. s + 3`` of a word, OR-ed
  into the mantissa of 2^23, is ``2^23 + q * 2^s`` exactly (one AND-OR), and the activation it multiplies is taken
  times ``2^-s`` (exact), so ``(v - 2^23) * x'`` is ``q * x`` to the bit. The top three nibbles come from the word
  shifted by 12 (one shift per eight codes).
* Q6_K (read as int16 halfwords: 210-byte super-blocks are not word aligned): each quarter of 32 codes is rebuilt
  from its ``ql`` nibble and ``qh`` pair, ``q - 32`` placed the same way; ``d * sc`` (one per 16) scales the
  products of its group.

With a one-hot fp32 activation row every product above is exact, so the output is the CPU decode's fp32 weight
bit for bit: the GPU tests check the decode that way. For general activations the sums run in another order than
the reference's dense product (fp32 rounding apart).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels import sm_count
from edgespec.kernels.launch.triton_pdl import pdl_launch, pdl_release, pdl_wait
from edgespec.kernels.quant.triton_kquant_decode import LAYOUTS, _dmin_head, _fp16_bits, _scale_min
from edgespec.kernels.quant.triton_quant_tiles import _finish, wave_splits
from edgespec.kernels.quant.triton_rowblock import RowBlockOutputs

# Activation rows one launch takes (edgespec.kernels.quant.route.KQUANT_GEMV_ROWS says how many each format is sent).
GEMV_MAX_ROWS = 4
# Launch per ggml type: weight rows per program, warps, programs wanted per SM (the K split), fewest super-blocks per
# split. The launch of least time summed over the peer Q4_K_M file's matrices at one row (tools/kquant_gemv_bench.py
# --sweep, H200; docs/benchmarks.md); Q5_K (none in that file) takes Q4_K's.
_Q4K_LAUNCH = {"BLOCK_N": 128, "num_warps": 4, "WAVES": 8, "MIN_SB": 1}
GEMV_LAUNCH: dict[int, dict[str, int]] = {12: dict(_Q4K_LAUNCH), 13: dict(_Q4K_LAUNCH),
                                          14: {"BLOCK_N": 32, "num_warps": 4, "WAVES": 4, "MIN_SB": 1}}


@triton.jit
def _magic(bits):
    """fp32 ``v`` for an int32 ``bits`` holding ``v`` (an integer below 2^23) in its low 23 bits, exactly."""
    return (bits | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _x_quads(x_ptr, base):
    """fp32 activations ``x[base + 4w + b]`` (w < 8) as four ``[8]`` vectors, b = 0..3, from one contiguous load:
    the inputs that byte ``b`` of word ``w`` multiplies."""
    flat = tl.load(x_ptr + base + tl.arange(0, 32)).to(tl.float32)
    even, odd = tl.split(tl.reshape(flat, [8, 2, 2]))            # b = 2i + j: j = 0 / 1
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _q4k_codes(words, qh, c: tl.constexpr, HAS_QH: tl.constexpr):
    """The eight code planes of a ``[BLOCK_N, 8]`` word tile (chunk ``c`` of a Q4_K / Q5_K super-block), plane
    ``p = 2b + h`` = nibble ``h`` of byte ``b``: byte ``b`` of word ``w`` is weight ``4w + b`` of sub-block
    ``2c + h``. Q4_K: plane ``p`` is ``q * 2^S[p]`` (``S`` = 0, 4, 8, 12, 16, 8, 12, 16; :func:`_dmin_row` takes
    the inputs times ``2^-S``); Q5_K: ``q + 16 * (fifth bit)``, unscaled."""
    if HAS_QH:
        h0 = _magic((words & 15) | (((qh >> c * 2) & 1) << 4))
        h1 = _magic(((words >> 4) & 15) | (((qh >> (c * 2 + 1)) & 1) << 4))
        h2 = _magic(((words >> 8) & 15) | (((qh >> (8 + c * 2)) & 1) << 4))
        h3 = _magic(((words >> 12) & 15) | (((qh >> (9 + c * 2)) & 1) << 4))
        h4 = _magic(((words >> 16) & 15) | (((qh >> (16 + c * 2)) & 1) << 4))
        h5 = _magic(((words >> 20) & 15) | (((qh >> (17 + c * 2)) & 1) << 4))
        h6 = _magic(((words >> 24) & 15) | (((qh >> (24 + c * 2)) & 1) << 4))
        h7 = _magic(((words >> 28) & 15) | (((qh >> (25 + c * 2)) & 1) << 4))
        return h0, h1, h2, h3, h4, h5, h6, h7
    top = words >> 12                       # nibbles 5..7 to bits 8..19 (the sign bits it drags in are masked)
    return (_magic(words & 0xF), _magic(words & 0xF0), _magic(words & 0xF00), _magic(words & 0xF000),
            _magic(words & 0xF0000), _magic(top & 0xF00), _magic(top & 0xF000), _magic(top & 0xF0000))


@triton.jit
def _dmin_row(acc, x_ptr, k0, v0, v1, v2, v3, v4, v5, v6, v7, dsc_lo, dm_lo, dsc_hi, dm_hi, HAS_QH: tl.constexpr):
    """One activation row's products with one chunk (sub-blocks ``2c`` and ``2c + 1``, inputs ``k0 .. k0 + 63``)
    into its ``[BLOCK_N, 8]`` accumulator: the codes' dot per word column, then the sub-block scale and min."""
    # 2^-S of each plane (Q4_K; Q5_K's planes are unscaled): planes 0, 2, 4, 6 multiply the low-nibble inputs
    F1: tl.constexpr = 1.0 if HAS_QH else 2.0 ** -4
    F2: tl.constexpr = 1.0 if HAS_QH else 2.0 ** -8
    F3: tl.constexpr = 1.0 if HAS_QH else 2.0 ** -12
    F4: tl.constexpr = 1.0 if HAS_QH else 2.0 ** -16
    lo0, lo1, lo2, lo3 = _x_quads(x_ptr, k0)
    hi0, hi1, hi2, hi3 = _x_quads(x_ptr, k0 + 32)
    dot = v0 * lo0[None, :]
    dot = tl.fma(v2, (lo1 * F2)[None, :], dot)
    dot = tl.fma(v4, (lo2 * F4)[None, :], dot)
    dot = tl.fma(v6, (lo3 * F3)[None, :], dot)
    acc = tl.fma(dot, dsc_lo[:, None], acc)
    dot = v1 * (hi0 * F1)[None, :]
    dot = tl.fma(v3, (hi1 * F3)[None, :], dot)
    dot = tl.fma(v5, (hi2 * F2)[None, :], dot)
    dot = tl.fma(v7, (hi3 * F4)[None, :], dot)
    acc = tl.fma(dot, dsc_hi[:, None], acc)
    acc = tl.fma(-dm_lo[:, None], (((lo0 + lo1) + lo2) + lo3)[None, :], acc)
    return tl.fma(-dm_hi[:, None], (((hi0 + hi1) + hi2) + hi3)[None, :], acc)


@triton.jit
def _dmin_gemv_kernel(x_ptr, w_ptr, part_ptr, b_ptr, y_ptr, N, sb_per_split, stride_xm, stride_wn, stride_ps,
                      stride_pm, stride_ym, ROWS: tl.constexpr, HAS_QH: tl.constexpr, BLOCK_N: tl.constexpr,
                      DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """Q4_K (``HAS_QH`` False, 36 words a super-block) or Q5_K (44 words) against ``ROWS`` activation rows."""
    WORDS: tl.constexpr = 44 if HAS_QH else 36
    QS: tl.constexpr = 12 if HAS_QH else 4          # first word of the nibbles
    pdl_wait(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    pid_k = tl.program_id(1)
    w8 = tl.arange(0, 8)
    acc0 = tl.zeros([BLOCK_N, 8], tl.float32)
    acc1 = tl.zeros([BLOCK_N, 8], tl.float32)
    acc2 = tl.zeros([BLOCK_N, 8], tl.float32)
    acc3 = tl.zeros([BLOCK_N, 8], tl.float32)
    for i in range(0, sb_per_split):
        sb = pid_k * sb_per_split + i
        row = w_ptr + n * stride_wn + sb * WORDS
        d, dmin, s0, s1, s2 = _dmin_head(row, n_ok)
        if HAS_QH:
            qh = tl.load(row[:, None] + 4 + w8[None, :], mask=n_ok[:, None], other=0)
        else:
            qh = tl.zeros([BLOCK_N, 8], tl.int32)
        for c in tl.static_range(4):
            words = tl.load(row[:, None] + QS + 8 * c + w8[None, :], mask=n_ok[:, None], other=0)
            sc, mn = _scale_min(s0, s1, s2, 2 * c)
            dsc_lo = d * sc
            dm_lo = dmin * mn
            sc, mn = _scale_min(s0, s1, s2, 2 * c + 1)
            dsc_hi = d * sc
            dm_hi = dmin * mn
            v0, v1, v2, v3, v4, v5, v6, v7 = _q4k_codes(words, qh, c, HAS_QH)
            k0 = sb * 256 + 64 * c
            acc0 = _dmin_row(acc0, x_ptr, k0, v0, v1, v2, v3, v4, v5, v6, v7, dsc_lo, dm_lo, dsc_hi, dm_hi, HAS_QH)
            if ROWS > 1:
                acc1 = _dmin_row(acc1, x_ptr + stride_xm, k0, v0, v1, v2, v3, v4, v5, v6, v7, dsc_lo, dm_lo, dsc_hi,
                                 dm_hi, HAS_QH)
            if ROWS > 2:
                acc2 = _dmin_row(acc2, x_ptr + 2 * stride_xm, k0, v0, v1, v2, v3, v4, v5, v6, v7, dsc_lo, dm_lo,
                                 dsc_hi, dm_hi, HAS_QH)
            if ROWS > 3:
                acc3 = _dmin_row(acc3, x_ptr + 3 * stride_xm, k0, v0, v1, v2, v3, v4, v5, v6, v7, dsc_lo, dm_lo,
                                 dsc_hi, dm_hi, HAS_QH)
    pdl_release(PDL)
    _store_rows(acc0, acc1, acc2, acc3, part_ptr, b_ptr, y_ptr, n, N, pid_k, stride_ps, stride_pm, stride_ym, ROWS,
                DIRECT, HAS_BIAS)


@triton.jit
def _store_rows(acc0, acc1, acc2, acc3, part_ptr, b_ptr, y_ptr, n, N, pid_k, stride_ps, stride_pm, stride_ym,
                ROWS: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Each row's ``[BLOCK_N, cols]`` accumulator summed over its columns and stored (``_finish``: to y with the
    bias, or as the split's fp32 partial)."""
    m = tl.arange(0, 1)
    _finish(tl.sum(acc0, axis=1), part_ptr, b_ptr, y_ptr, m, n, 1, N, pid_k, stride_ps, 0, 0, False, DIRECT,
            HAS_BIAS)
    if ROWS > 1:
        _finish(tl.sum(acc1, axis=1), part_ptr + stride_pm, b_ptr, y_ptr + stride_ym, m, n, 1, N, pid_k, stride_ps,
                0, 0, False, DIRECT, HAS_BIAS)
    if ROWS > 2:
        _finish(tl.sum(acc2, axis=1), part_ptr + 2 * stride_pm, b_ptr, y_ptr + 2 * stride_ym, m, n, 1, N, pid_k,
                stride_ps, 0, 0, False, DIRECT, HAS_BIAS)
    if ROWS > 3:
        _finish(tl.sum(acc3, axis=1), part_ptr + 3 * stride_pm, b_ptr, y_ptr + 3 * stride_ym, m, n, 1, N, pid_k,
                stride_ps, 0, 0, False, DIRECT, HAS_BIAS)


@triton.jit
def _q6k_codes(ql, qh, r: tl.constexpr, e: tl.constexpr):
    """``q - 32`` in fp32 of quarter ``r`` of a half, byte ``e`` of each halfword: ``ql`` the quarter's nibble
    halfwords, ``qh`` the half's high-bit halfwords (both ``[BLOCK_N, 16]``, zero-extended to int32)."""
    low = (ql >> (8 * e + 4 * (r // 2))) & 15
    high = (qh >> (8 * e + 2 * r)) & 3
    return (low | (high << 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0     # 2^23 + 32


@triton.jit
def _q6k_row(acc, x_ptr, k0, c0, c1, dsc, NG: tl.constexpr):
    """One activation row's products with one quarter (32 weights from input ``k0``: halfword column ``u`` holds
    inputs ``k0 + 2u`` and ``k0 + 2u + 1``) into its ``[BLOCK_N, 16]`` accumulator, scaled per group of 16."""
    xx = tl.load(x_ptr + k0 + tl.arange(0, 32)).to(tl.float32)
    x0, x1 = tl.split(tl.reshape(xx, [NG, 2]))
    dot = c0 * x0[None, :]
    dot = tl.fma(c1, x1[None, :], dot)
    return tl.fma(dot, dsc, acc)


@triton.jit
def _q6k_gemv_kernel(x_ptr, w_ptr, part_ptr, b_ptr, y_ptr, N, sb_per_split, stride_xm, stride_wn, stride_ps,
                     stride_pm, stride_ym, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """Q6_K (105 halfwords a super-block: ``ql`` 0..63, ``qh`` 64..95, int8 scales 96..103, fp16 ``d`` 104)
    against ``ROWS`` activation rows."""
    pdl_wait(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    pid_k = tl.program_id(1)
    u = tl.arange(0, 16)
    first = (u < 8)[None, :]                 # halfword columns 0..7: the quarter's first group of 16
    acc0 = tl.zeros([BLOCK_N, 16], tl.float32)
    acc1 = tl.zeros([BLOCK_N, 16], tl.float32)
    acc2 = tl.zeros([BLOCK_N, 16], tl.float32)
    acc3 = tl.zeros([BLOCK_N, 16], tl.float32)
    for i in range(0, sb_per_split):
        sb = pid_k * sb_per_split + i
        row = w_ptr + n * stride_wn + sb * 105
        d = _fp16_bits(tl.load(row + 104, mask=n_ok, other=0).to(tl.int32))
        for h in tl.static_range(2):
            qh = tl.load(row[:, None] + 64 + 16 * h + u[None, :], mask=n_ok[:, None], other=0).to(tl.int32) & 0xFFFF
            for r in tl.static_range(4):
                ql = tl.load(row[:, None] + 32 * h + 16 * (r % 2) + u[None, :], mask=n_ok[:, None], other=0)
                ql = ql.to(tl.int32) & 0xFFFF
                sc2 = tl.load(row + 96 + 4 * h + r, mask=n_ok, other=0).to(tl.int32)     # the two int8 scales
                dsc = tl.where(first, (d * ((sc2 << 24) >> 24).to(tl.float32))[:, None],
                               (d * (sc2 >> 8).to(tl.float32))[:, None])
                c0 = _q6k_codes(ql, qh, r, 0)
                c1 = _q6k_codes(ql, qh, r, 1)
                k0 = sb * 256 + 128 * h + 32 * r
                acc0 = _q6k_row(acc0, x_ptr, k0, c0, c1, dsc, 16)
                if ROWS > 1:
                    acc1 = _q6k_row(acc1, x_ptr + stride_xm, k0, c0, c1, dsc, 16)
                if ROWS > 2:
                    acc2 = _q6k_row(acc2, x_ptr + 2 * stride_xm, k0, c0, c1, dsc, 16)
                if ROWS > 3:
                    acc3 = _q6k_row(acc3, x_ptr + 3 * stride_xm, k0, c0, c1, dsc, 16)
    pdl_release(PDL)
    _store_rows(acc0, acc1, acc2, acc3, part_ptr, b_ptr, y_ptr, n, N, pid_k, stride_ps, stride_pm, stride_ym, ROWS,
                DIRECT, HAS_BIAS)


def kquant_gemv_config(kind: int, N: int, K: int, sms: int, launch: dict[str, int] | None = None) -> dict[str, int]:
    """Launch of one product of ggml type ``kind``: its :data:`GEMV_LAUNCH` (``launch`` over it) and the K split,
    the smallest divisor of the super-blocks that reaches ``WAVES`` programs per SM with at least ``MIN_SB``
    super-blocks each (``wave_splits``). It depends on the matrix only, never on the row count."""
    cfg = {**GEMV_LAUNCH[kind], **(launch or {})}
    if "SPLIT_K" not in cfg:
        cfg["SPLIT_K"] = wave_splits(triton.cdiv(N, cfg["BLOCK_N"]), K // 256, cfg["WAVES"] * sms, cfg["MIN_SB"])
    return cfg


def kquant_gemv(packed, x2: torch.Tensor, bias: torch.Tensor | None = None,
                launch: dict[str, int] | None = None) -> torch.Tensor:
    """``x2 [M, in] @ W^T (+ bias)`` for ``1 <= M <= GEMV_MAX_ROWS`` rows and a Q4_K / Q5_K / Q6_K weight on CUDA
    (``x2`` bf16, fp16 or fp32, rows contiguous), output in x2's dtype; ``launch`` overrides
    :func:`kquant_gemv_config`'s keys (sweeps)."""
    kind = int(packed.ggml_type)
    M, K = x2.shape
    N = packed.out_features
    if kind not in LAYOUTS:
        raise ValueError(f"{packed.format}: no K-quant GEMV for ggml type {kind}")
    if x2.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{packed.format} GEMV: x must be bf16, fp16 or fp32, got {x2.dtype}")
    if not 1 <= M <= GEMV_MAX_ROWS:
        raise ValueError(f"{packed.format} GEMV: {M} rows, give 1..{GEMV_MAX_ROWS}")
    if K != packed.in_features or x2.stride(-1) != 1:
        raise ValueError(f"{packed.format} GEMV: x {tuple(x2.shape)} must be [rows, {packed.in_features}] with "
                         "contiguous rows")
    cfg = kquant_gemv_config(kind, N, K, sm_count(x2.device), launch)
    nb = K // 256
    splits = max(d for d in range(1, min(cfg["SPLIT_K"], nb) + 1) if nb % d == 0)
    out = RowBlockOutputs.new(M, N, splits, x2)
    ps, pm = out.part_strides
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), splits)
    pdl = pdl_launch(x2.device)
    common = dict(ROWS=M, BLOCK_N=cfg["BLOCK_N"], DIRECT=out.direct, HAS_BIAS=bias is not None, PDL=bool(pdl),
                  num_warps=cfg["num_warps"], num_stages=1, enable_fp_fusion=False, **pdl)
    b = bias if bias is not None else out.y
    if kind == 14:
        w = packed.blocks.view(torch.int16)            # 105 halfwords a super-block: rows always 2-byte aligned
        _q6k_gemv_kernel[grid](x2, w, out.part, b, out.y, N, nb // splits, x2.stride(0), w.stride(0), ps, pm,
                               out.y.stride(0), **common)
    else:
        w = packed.blocks.view(torch.int32)
        _dmin_gemv_kernel[grid](x2, w, out.part, b, out.y, N, nb // splits, x2.stride(0), w.stride(0), ps, pm,
                                out.y.stride(0), HAS_QH=kind == 13, **common)
    return out.finish(bias, pdl)
