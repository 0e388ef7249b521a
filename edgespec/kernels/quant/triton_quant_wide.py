"""Weight-major tiles of the packed products (``int4``, ``nvfp4``, ``fp8_block``): ``y^T = W x^T`` with the
dequantized weight tile as the *left* operand of the tensor-core product and the activation rows as its narrow
right side, for 1..64 activation rows (decode, chain and tree verifies).

Why this orientation: :mod:`edgespec.kernels.quant.triton_quant_gemv`'s tiles put the activation rows on the left
(``x W^T``), so on Hopper the freshly dequantized weights are the right operand, which the warp-group MMA (wgmma)
reads from shared memory only: every weight is decoded in registers, stored to shared memory as 16-bit values and
read back (``STS.U16``, one per two weights per warp in the 64-row tile). With the weights on the left, wgmma takes
them straight from registers, and the activation tile (one copy per call, already in the weights' column order) is
the shared-memory operand that Triton's pipeline fetches ahead (``num_stages``). The weights are read and decoded
once per call whatever the row count; the activation rows are the MMA's N side (16, 32 or 64).

Each weight tile is one quantization group (int4: ``group_size`` inputs; nvfp4 and fp8: 128) of ``BLOCK_N`` rows:

* int4: the pair decode of ``triton_quant_tiles._int4_pair_tile`` (``q - z`` exact in the activation type); the
  group scale is applied to the tile's fp32 product. The zero points and scales (1-2 bytes per row, too narrow for
  the asynchronous copies) are loaded one group ahead by hand. (Folding the scale into the weights, so the MMA
  accumulates across groups, compiled to a layout conversion in 20 barriered rounds: left out.)
* nvfp4: words loaded as ``[BLOCK_N, 16]`` like int4's; a row's eight e4m3 block scales of a tile are one int64,
  taken apart in registers and each scale pair shared by the two words of its block (``_nvfp4_word_tile``), so the
  per-weight work is the e2m1 bit placement and one fused pair multiply by the block scale (exact, see
  ``_NVFP4_PAIRS_BF16_ASM``).
* fp8_block: e4m3 converted to the activation type; one 128x128 block scale per tile and program.

Launch: ``quant_matmul(..., config={"T": 1, ...})`` or the ``T`` entries of
:func:`edgespec.kernels.quant.triton_quant_gemv.quant_config`. ``DEQUANT=0`` in :func:`wide_t_matmul`'s kernels (the
``NO_DECODE`` config key) skips the decode and feeds the raw words to the MMA: wrong values, the tile's cost without
its dequantization, for ``tools/tile_sweep.py`` only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels.launch.triton_pdl import pdl_launch, pdl_release, pdl_wait
from edgespec.kernels.quant.triton_gemv import _split_sum_kernel
from edgespec.kernels.quant.triton_quant_tiles import (
    _NVFP4_PAIRS_BF16_ASM,
    _NVFP4_PAIRS_FP16_ASM,
    NVFP4_BF16_SHIFT,
    NVFP4_FP16_SHIFT,
    _finish,
    _int4_pair_tile,
    _pair_columns,
    _pair_program,
    pair_order,
    wave_splits,
)


@triton.jit
def _half_pair_bits(v, IS_BF16: tl.constexpr):
    """fp32 ``v`` rounded to the activation type, its 16 bits repeated in both halves of an int32."""
    dt: tl.constexpr = tl.bfloat16 if IS_BF16 else tl.float16
    b = v.to(dt).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _int4_word_tile(words, z, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, IS_BF16: tl.constexpr,
                    DEQUANT: tl.constexpr):
    """``[BLOCK_N, GROUP]`` values ``q - z`` in pair order (column 8w + 2p + h = input 8w + p + 4h);
    ``DEQUANT=False``: the raw words (timing only)."""
    if not DEQUANT:
        return _pair_columns(words, words, words, words, BLOCK_N, GROUP, IS_BF16)
    return _int4_pair_tile(words, z, BLOCK_N, GROUP, IS_BF16)


@triton.jit
def _nvfp4_word_pairs(words, sc, IS_BF16: tl.constexpr):
    """``[BLOCK_N, 8, 2]`` words (block, word of the block) and their ``[BLOCK_N, 8]`` block scales (fp32, already
    times 2^SHIFT) -> four int32 tensors of the words' shape: pair p of a word holds nibbles p and p + 4 as block-
    scaled 16-bit values (times 2^-SHIFT, exact; see ``_NVFP4_PAIRS_BF16_ASM``), low half nibble p."""
    spair = _half_pair_bits(sc, IS_BF16)[:, :, None] + tl.zeros_like(words)
    asm: tl.constexpr = _NVFP4_PAIRS_BF16_ASM if IS_BF16 else _NVFP4_PAIRS_FP16_ASM
    return tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r", [words, spair], dtype=(tl.int32,) * 4, is_pure=True,
                                     pack=1)


@triton.jit
def _nvfp4_row_scales(s8, SHIFT: tl.constexpr):
    """A row's eight e4m3 block scales of a 128-input tile, loaded as one int64 per row (``s8 [BLOCK_N]``), taken
    apart in registers -> ``[BLOCK_N, 8]`` fp32 times 2^SHIFT (an ``[BLOCK_N, 8]`` byte load lays a row in one
    thread)."""
    byte = (tl.arange(0, 8) * 8).to(tl.int64)
    sc = ((s8[:, None] >> byte[None, :]) & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return sc * (2.0 ** SHIFT)


@triton.jit
def _nvfp4_word_tile(words, sc, BLOCK_N: tl.constexpr, IS_BF16: tl.constexpr, DEQUANT: tl.constexpr):
    """``[BLOCK_N, 128]`` block-scaled e2m1 weights (times 2^-SHIFT) in pair order from ``[BLOCK_N, 8, 2]`` words
    (block, word of the block) and the ``[BLOCK_N, 8]`` block scales (fp32, already times 2^SHIFT): a block's scale
    pair is made once and broadcast over its two words. (Words as ``[BLOCK_N, 16]`` with the scale pairs joined to
    them made Triton lay a whole row in one thread and convert the tile in 16 barriered rounds.)"""
    if DEQUANT:
        t0, t1, t2, t3 = _nvfp4_word_pairs(words, sc, IS_BF16)
    else:
        t0, t1, t2, t3 = words, words, words, words
    return _pair_columns(tl.reshape(t0, [BLOCK_N, 16]), tl.reshape(t1, [BLOCK_N, 16]), tl.reshape(t2, [BLOCK_N, 16]),
                         tl.reshape(t3, [BLOCK_N, 16]), BLOCK_N, 128, IS_BF16)


@triton.jit
def _finish_t(acc, part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, stride_pm, stride_ym,
              DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Store a weight-major ``[BLOCK_N, BLOCK_M]`` result as ``y[m, n]`` (or its fp32 partial)."""
    _finish(tl.trans(acc), part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, stride_pm, stride_ym, True,
            DIRECT, HAS_BIAS)


@triton.jit
def _int4_t_kernel(x_ptr, q_ptr, s_ptr, z_ptr, part_ptr, b_ptr, y_ptr, M, N, tiles_per_split,
                   stride_xm, stride_qn, stride_sn, stride_zn, stride_ps, stride_pm, stride_ym,
                   GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_BF16: tl.constexpr,
                   DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, DEQUANT: tl.constexpr, PDL: tl.constexpr):
    """int4, weights on the left: ``acc[n, m]`` over the program's groups, each group's product scaled by its
    rows' scales; x is in pair order (host-permuted)."""
    WORDS: tl.constexpr = GROUP // 8
    pdl_wait(PDL)
    pid_k, n, n_ok, m, lo_t = _pair_program(N, tiles_per_split, BLOCK_M, BLOCK_N)
    w_ptrs = q_ptr + n[:, None] * stride_qn + (lo_t * WORDS + tl.arange(0, WORDS))[None, :]
    xt_ptrs = x_ptr + m[None, :] * stride_xm + (lo_t * GROUP + tl.arange(0, GROUP))[:, None]
    # the group's zero points and scales are too narrow for the asynchronous copies that pipeline the words and x
    # (1-2 bytes per row), so the next group's are loaded one iteration ahead by hand
    z_nxt = tl.load(z_ptr + n * stride_zn + lo_t, mask=n_ok, other=0)
    s_nxt = tl.load(s_ptr + n * stride_sn + lo_t, mask=n_ok, other=0.0)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for i in range(0, tiles_per_split):
        z = z_nxt.to(tl.int32)
        s = s_nxt.to(tl.float32)
        more = n_ok & (i + 1 < tiles_per_split)
        z_nxt = tl.load(z_ptr + n * stride_zn + lo_t + i + 1, mask=more, other=0)
        s_nxt = tl.load(s_ptr + n * stride_sn + lo_t + i + 1, mask=more, other=0.0)
        words = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        w = _int4_word_tile(words, z, BLOCK_N, GROUP, IS_BF16, DEQUANT)
        xt = tl.load(xt_ptrs, mask=m[None, :] < M, other=0.0)
        acc += tl.dot(w, xt) * s[:, None]
        w_ptrs += WORDS
        xt_ptrs += GROUP
    pdl_release(PDL)
    _finish_t(acc, part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, stride_pm, stride_ym, DIRECT, HAS_BIAS)


@triton.jit
def _nvfp4_t_kernel(x_ptr, q_ptr, s_ptr, scale2_ptr, part_ptr, b_ptr, y_ptr, M, N, tiles_per_split,
                    stride_xm, stride_qn, stride_sn, stride_ps, stride_pm, stride_ym,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_BF16: tl.constexpr, DIRECT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, DEQUANT: tl.constexpr, PDL: tl.constexpr):
    """nvfp4, weights on the left, block scales folded into the weights (exact), the MMA accumulating across
    tiles; the global scale and 2^SHIFT applied once to the accumulator."""
    SHIFT: tl.constexpr = NVFP4_BF16_SHIFT if IS_BF16 else NVFP4_FP16_SHIFT
    pdl_wait(PDL)
    pid_k, n, n_ok, m, lo_t = _pair_program(N, tiles_per_split, BLOCK_M, BLOCK_N)
    w_ptrs = q_ptr + n[:, None] * stride_qn + (lo_t * 16 + tl.arange(0, 16))[None, :]
    # a row's eight e4m3 scales of a tile are one int64 (s_ptr is the scales viewed as int64)
    s_ptrs = s_ptr + n * stride_sn + lo_t
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    xt_ptrs = x_ptr + m[None, :] * stride_xm + (lo_t * 128 + tl.arange(0, 128))[:, None]
    for _ in range(0, tiles_per_split):
        words = tl.reshape(tl.load(w_ptrs, mask=n_ok[:, None], other=0), [BLOCK_N, 8, 2])
        sc = _nvfp4_row_scales(tl.load(s_ptrs, mask=n_ok, other=0), SHIFT)
        w = _nvfp4_word_tile(words, sc, BLOCK_N, IS_BF16, DEQUANT)
        xt = tl.load(xt_ptrs, mask=m[None, :] < M, other=0.0)
        acc = tl.dot(w, xt, acc)
        w_ptrs += 16
        s_ptrs += 1
        xt_ptrs += 128
    acc = acc * (tl.load(scale2_ptr) * (2.0 ** SHIFT))
    pdl_release(PDL)
    _finish_t(acc, part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, stride_pm, stride_ym, DIRECT, HAS_BIAS)


@triton.jit
def _fp8_t_kernel(x_ptr, w_ptr, s_ptr, part_ptr, b_ptr, y_ptr, M, N, tiles_per_split,
                  stride_xm, stride_wn, stride_sn, stride_ps, stride_pm, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  DEQUANT: tl.constexpr, PDL: tl.constexpr):
    """block-FP8 (K a multiple of 128, ``BLOCK_N`` dividing 128), weights on the left: one scale per tile."""
    pdl_wait(PDL)
    pid_k, n, n_ok, m, lo_t = _pair_program(N, tiles_per_split, BLOCK_M, BLOCK_N)
    w_ptrs = w_ptr + n[:, None] * stride_wn + (lo_t * 128 + tl.arange(0, 128))[None, :]
    xt_ptrs = x_ptr + m[None, :] * stride_xm + (lo_t * 128 + tl.arange(0, 128))[:, None]
    s_ptr_t = s_ptr + ((tl.program_id(0) * BLOCK_N) // 128) * stride_sn + lo_t
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for i in range(0, tiles_per_split):
        xt = tl.load(xt_ptrs, mask=m[None, :] < M, other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0).to(xt.dtype)     # (DEQUANT: a conversion either way)
        acc += tl.dot(w, xt) * tl.load(s_ptr_t + i)
        w_ptrs += 128
        xt_ptrs += 128
    pdl_release(PDL)
    _finish_t(acc, part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, stride_pm, stride_ym, DIRECT, HAS_BIAS)


# ---- launch ---------------------------------------------------------------------------------------------------

def t_tile_applies(packed, block_n: int) -> bool:
    """Whether the weight-major tile takes this matrix: fp8 needs whole 128-input tiles and one scale block per
    program; nvfp4 reads a row's eight block scales of a tile as one int64 (8-byte aligned)."""
    fmt, K = packed.format, packed.in_features
    if fmt == "fp8_block":
        return K % 128 == 0 and 128 % block_n == 0
    if fmt == "nvfp4":
        s = packed.weight_scale
        return s.stride(-1) == 1 and s.data_ptr() % 8 == 0 and s.stride(0) % 8 == 0
    return fmt == "int4"


def wide_t_matmul(packed, x2: torch.Tensor, bias: torch.Tensor | None, cfg: dict[str, int],
                  sms: int) -> torch.Tensor | None:
    """``x2 [M, in] @ W^T (+ bias)`` for 1..64 rows through the weight-major tile of ``packed.format`` with the
    launch ``cfg`` (``BLOCK_N``, ``num_warps``, ``num_stages``; optional ``SPLIT_K``, ``WAVES``, ``PDL``,
    ``NO_DECODE``), or None where the tile does not take the matrix (:func:`t_tile_applies`). The caller has checked
    ``x2`` (2-D, contiguous rows, bf16/fp16)."""
    fmt = packed.format
    M, K = x2.shape
    N = packed.out_features
    if M > 64:
        raise ValueError(f"{fmt} weight-major tile: {M} rows, at most 64")
    block_m = max(16, triton.next_power_of_2(M))
    block_n = cfg["BLOCK_N"]
    if not t_tile_applies(packed, block_n):
        return None
    n_tiles = K // (packed.group_size if fmt == "int4" else 128)
    n_blocks = triton.cdiv(N, block_n)
    splits = cfg.get("SPLIT_K") or wave_splits(n_blocks, n_tiles, cfg.get("WAVES", 2) * sms)
    splits = max(d for d in range(1, min(splits, n_tiles) + 1) if n_tiles % d == 0)
    per_split = n_tiles // splits
    y = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    direct = splits == 1
    part = y if direct else torch.empty((splits, M, N), dtype=torch.float32, device=x2.device)
    ps, pm = (part.stride(0), part.stride(1)) if not direct else (0, 0)
    b = bias if bias is not None else y
    grid = (n_blocks, splits)
    pdl = pdl_launch(x2.device) if cfg.get("PDL", 0) else {}
    common = dict(BLOCK_M=block_m, BLOCK_N=block_n, DIRECT=direct, HAS_BIAS=bias is not None,
                  DEQUANT=not cfg.get("NO_DECODE", 0), PDL=bool(pdl), num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"], **pdl)
    _launch_t(packed, x2, part, b, y, grid, per_split, ps, pm, x2.dtype == torch.bfloat16, common)
    if not direct:
        _split_sum_kernel[(M, triton.cdiv(N, 1024))](
            part, bias if bias is not None else part, y, M, N, splits, part.stride(0), part.stride(1), y.stride(0),
            HAS_BIAS=bias is not None, SPLITS_P2=max(2, triton.next_power_of_2(splits)), BLOCK=1024, num_warps=4,
            PDL=bool(pdl), **pdl)
    return y


def _launch_t(packed, x2, part, b, y, grid, per_split, ps, pm, is_bf16, common) -> None:
    """The weight-major kernel of ``packed.format`` (``T`` launches)."""
    fmt, M, N = packed.format, x2.shape[0], packed.out_features
    if fmt == "int4":
        xk = pair_order(x2)
        q = packed.qweight.view(torch.int32)      # 8 codes per word: rows of in/2 bytes are whole words
        _int4_t_kernel[grid](xk, q, packed.scales, packed.zeros, part, b, y, M, N, per_split, xk.stride(0),
                             q.stride(0), packed.scales.stride(0), packed.zeros.stride(0), ps, pm, y.stride(0),
                             GROUP=packed.group_size, IS_BF16=is_bf16, **common)
    elif fmt == "nvfp4":
        xk = pair_order(x2)
        q = packed.weight.view(torch.int32)
        s = packed.weight_scale.view(torch.int64)    # eight block scales per tile (in_features % 128 == 0)
        _nvfp4_t_kernel[grid](xk, q, s, packed.weight_scale_2, part, b, y, M, N, per_split, xk.stride(0),
                              q.stride(0), s.stride(0), ps, pm, y.stride(0), IS_BF16=is_bf16, **common)
    elif fmt == "fp8_block":
        w, s = packed.weight, packed.weight_scale_inv
        _fp8_t_kernel[grid](x2, w, s, part, b, y, M, N, per_split, x2.stride(0), w.stride(0), s.stride(0), ps, pm,
                            y.stride(0), **common)
    else:
        raise ValueError(f"no weight-major tile for weight format {fmt!r}")
