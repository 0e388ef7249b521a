"""The NVFP4 and block-FP8 expert products for a few rows (a plain decode step: 1 row; a short verify: up to
``PACKED_GEMV_TUNING["max_rows"]``) on the CUDA cores: the int4 one-row path of
``edgespec.kernels.moe.triton_moe_gemv`` over the stacks of ``edgespec.kernels.moe.moe_packed``.

The same three launches after the grouping, the same grid (slot, weight block, K split) and slot set-up
(``_slot_block``), the same fixed-order sums (the SwiGLU of the up splits in split order, ``_swiglu_tile``; the
slots then the down splits, ``_slot_sum_kernel``), one 128-input tile at a time:

* nvfp4: a tile of a row is 16 int32 words (8 codes each) and its eight e4m3 block scales, loaded as one int64
  (``triton_quant_wide._nvfp4_row_scales``). The dense tile's decode (``_nvfp4_word_pairs``: e2m1 bits placed
  under a bf16 exponent, one pair multiply by the block scale times 2^63, exact) gives each word's eight
  block-scaled weights as bf16 halves of four registers; a bf16 half widens to fp32 with one shift or AND, and
  multiplies its input in fp32. The matrix's global scale and 2^-63 are applied once per row sum.
* fp8_block: a tile of a row is 128 e4m3 bytes, converted to fp32 (as the dense one-row path converts them) and
  multiplied by the inputs times the tile's 128x128 block scale (a program's rows lie in one block row: the block
  widths divide 128).

The K splits are sized for one row's pairs (k'), whatever the row count: a row then sums in the same order at 1
and 2 rows, so a decode row and the same row of a 2-row verify are bit-identical. No atomics; grids sized for the
worst case, unused slots exit at once (CUDA-graph capturable). Contract:
``edgespec.kernels.moe.moe_packed.stacked_packed_expert_product_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels import sm_count
from edgespec.kernels.moe.stacks import TILE, StackedFP8Block, StackedNVFP4, StackedPacked
from edgespec.kernels.moe.triton_moe_gemv import (
    _SUM_BLOCK,
    _slot_block,
    _slot_sum_kernel,
    _swiglu_tile,
    _word_inputs,
    expert_splits,
)
from edgespec.kernels.quant.triton_quant_tiles import NVFP4_BF16_SHIFT
from edgespec.kernels.quant.triton_quant_wide import _nvfp4_row_scales, _nvfp4_word_pairs

# Launch knobs, as ``triton_moe_gemv.GEMV_TUNING`` (whose values, the int4 sweep's best on the 35B-A3B layer, they
# start from; tools/moe_int4_bench.py layer --format sweeps them). ``max_rows``: the most rows this path takes (more
# go to the tensor-core tiles of edgespec.kernels.moe.triton_moe_quant). The block widths must divide 128 (fp8: one
# scale block row per program).
PACKED_GEMV_TUNING = {"max_rows": 2, "up_block_n": 16, "down_block_n": 32, "waves": 8, "down_min_tiles": 1,
                      "num_warps": 4}
_WORDS = tl.constexpr(TILE // 8)          # int32 words of e2m1 codes per tile row


@triton.jit
def _next_ok(ok, i, tiles):
    """``ok`` where tile ``i + 1`` exists: the comparison is made a tensor of ``ok``'s shape first, because Triton
    3.9's interpreter refuses a mask of a tensor and a Python bool."""
    return ok & ((ok.to(tl.int32) * 0 + i + 1) < tiles)


@triton.jit
def _nvfp4_word_dot(words, s8, xf):
    """``[BLOCK_N, 8, 2]``: per weight row, scale block and word, the sum of the word's eight block-scaled weights
    (times 2^-63) times their inputs (of ``xf [128]`` fp32); ``s8 [BLOCK_N]``: the rows' eight block scales as one
    int64."""
    t0, t1, t2, t3 = _nvfp4_word_pairs(words, _nvfp4_row_scales(s8, NVFP4_BF16_SHIFT), True)
    x0, x1, x2, x3, x4, x5, x6, x7 = _word_inputs(xf, 16)      # [16] each: word w = 2 * block + word of the block
    part = (t0 << 16).to(tl.float32, bitcast=True) * tl.reshape(x0, [8, 2])[None, :, :]      # low half: nibble p
    part += (t1 << 16).to(tl.float32, bitcast=True) * tl.reshape(x1, [8, 2])[None, :, :]
    part += (t2 << 16).to(tl.float32, bitcast=True) * tl.reshape(x2, [8, 2])[None, :, :]
    part += (t3 << 16).to(tl.float32, bitcast=True) * tl.reshape(x3, [8, 2])[None, :, :]
    part += (t0 & -65536).to(tl.float32, bitcast=True) * tl.reshape(x4, [8, 2])[None, :, :]  # high: nibble p + 4
    part += (t1 & -65536).to(tl.float32, bitcast=True) * tl.reshape(x5, [8, 2])[None, :, :]
    part += (t2 & -65536).to(tl.float32, bitcast=True) * tl.reshape(x6, [8, 2])[None, :, :]
    part += (t3 & -65536).to(tl.float32, bitcast=True) * tl.reshape(x7, [8, 2])[None, :, :]
    return part


@triton.jit
def _row_sum(acc):
    """``[BLOCK_N, 8, 2]`` -> ``[BLOCK_N]``."""
    return tl.sum(tl.sum(acc, 2), 1)


@triton.jit
def _nvfp4_slot(q_ptr, s_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, N, tiles_per_split, stride_qe,
                stride_qn, stride_se, stride_sn, BLOCK_N: tl.constexpr):
    """``_slot_block`` for NVFP4 (``s_ptr``: the block scales viewed as int64, eight a tile): (pair count, first
    pair, weight rows, their mask and the words' mask, K split, first tile, the words' pointers as
    ``[BLOCK_N, 8, 2]``, the scales' pointers, the slot's expert)."""
    cnt, first, n, n_ok, pid_k, lo_t, q0, sp, _ = _slot_block(
        q_ptr, s_ptr, s_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, N, tiles_per_split, stride_qe,
        stride_qn, stride_se, stride_sn, _WORDS, BLOCK_N)
    e = tl.load(slot_expert_ptr + tl.program_id(0), mask=cnt > 0, other=0).to(tl.int64)
    return cnt, first, n, n_ok, n_ok[:, None, None], pid_k, lo_t, tl.reshape(q0, [BLOCK_N, 8, 2]), sp, e


@triton.jit
def _nvfp4_up_kernel(x_ptr, q_ptr, s_ptr, g_ptr, part_ptr, pair_row_ptr, slot_first_ptr, slot_count_ptr,
                     slot_expert_ptr, I, P, tiles_per_split, stride_xm, stride_qe, stride_qn, stride_se, stride_sn,
                     BLOCK_N: tl.constexpr):
    # the up rows follow the gate rows
    cnt, first, n, n_ok, w_ok, pid_k, lo_t, q0, sg, e = _nvfp4_slot(
        q_ptr, s_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, I, tiles_per_split, stride_qe, stride_qn,
        stride_se, stride_sn, BLOCK_N)
    for r in range(0, cnt):
        pos = first + r
        row = tl.load(pair_row_ptr + pos)
        x_ptrs = x_ptr + row * stride_xm + lo_t * 128 + tl.arange(0, 128)
        qg = q0
        acc_g = tl.zeros([BLOCK_N, 8, 2], tl.float32)
        acc_u = tl.zeros([BLOCK_N, 8, 2], tl.float32)
        nxt_g = tl.load(qg, mask=w_ok, other=0)      # the next tile's words loaded before this tile is decoded
        nxt_u = tl.load(qg + I * stride_qn, mask=w_ok, other=0)
        for i in range(0, tiles_per_split):
            wg = nxt_g
            wu = nxt_u
            more = _next_ok(w_ok, i, tiles_per_split)
            qg += _WORDS
            nxt_g = tl.load(qg, mask=more, other=0)
            nxt_u = tl.load(qg + I * stride_qn, mask=more, other=0)
            xf = tl.load(x_ptrs).to(tl.float32)
            acc_g += _nvfp4_word_dot(wg, tl.load(sg + i, mask=n_ok, other=0), xf)
            acc_u += _nvfp4_word_dot(wu, tl.load(sg + I * stride_sn + i, mask=n_ok, other=0), xf)
            x_ptrs += 128
        out = part_ptr + pid_k * P * 2 * I + pos * (2 * I) + n
        unshift = 2.0 ** NVFP4_BF16_SHIFT
        tl.store(out, _row_sum(acc_g) * (tl.load(g_ptr + e * 2) * unshift), mask=n_ok)
        tl.store(out + I, _row_sum(acc_u) * (tl.load(g_ptr + e * 2 + 1) * unshift), mask=n_ok)


@triton.jit
def _nvfp4_down_kernel(part_ptr, q_ptr, s_ptr, g_ptr, out_ptr, pair_dst_ptr, pair_w_ptr, slot_first_ptr,
                       slot_count_ptr, slot_expert_ptr, H, I, P, up_splits, tiles_per_split, stride_qe, stride_qn,
                       stride_se, stride_sn, BLOCK_N: tl.constexpr, ACT: tl.constexpr):
    cnt, first, n, n_ok, w_ok, pid_k, lo_t, q0, sp, e = _nvfp4_slot(
        q_ptr, s_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, H, tiles_per_split, stride_qe, stride_qn,
        stride_se, stride_sn, BLOCK_N)
    for r in range(0, cnt):
        pos = first + r
        a_ptrs = part_ptr + pos * (2 * I) + lo_t * 128 + tl.arange(0, 128)
        q_ptrs = q0
        acc = tl.zeros([BLOCK_N, 8, 2], tl.float32)
        nxt = tl.load(q_ptrs, mask=w_ok, other=0)
        for i in range(0, tiles_per_split):
            words = nxt
            q_ptrs += _WORDS
            nxt = tl.load(q_ptrs, mask=_next_ok(w_ok, i, tiles_per_split), other=0)
            act = _swiglu_tile(a_ptrs, up_splits, P * 2 * I, I, 128, ACT)
            acc += _nvfp4_word_dot(words, tl.load(sp + i, mask=n_ok, other=0), act)
            a_ptrs += 128
        w = tl.load(pair_w_ptr + pos) * (tl.load(g_ptr + e) * (2.0 ** NVFP4_BF16_SHIFT))
        dst = tl.load(pair_dst_ptr + pos)
        tl.store(out_ptr + pid_k * P * H + dst * H + n, _row_sum(acc) * w, mask=n_ok)


@triton.jit
def _fp8_scale_row(s_ptr, slot_expert_ptr, cnt, row0, lo_t, stride_se, stride_sn):
    """The slot's expert's block scale of rows ``row0..`` (one 128-row block) at K tile ``lo_t``."""
    e = tl.load(slot_expert_ptr + tl.program_id(0), mask=cnt > 0, other=0).to(tl.int64)
    return s_ptr + e * stride_se + (row0 // 128) * stride_sn + lo_t


@triton.jit
def _fp8_up_kernel(x_ptr, q_ptr, s_ptr, part_ptr, pair_row_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr,
                   I, P, tiles_per_split, stride_xm, stride_qe, stride_qn, stride_se, stride_sn,
                   BLOCK_N: tl.constexpr):
    # the codes' pointers only: the scales are one per program and tile (_fp8_scale_row)
    cnt, first, n, n_ok, pid_k, lo_t, q0, _, _ = _slot_block(
        q_ptr, s_ptr, s_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, I, tiles_per_split, stride_qe,
        stride_qn, 0, 0, 128, BLOCK_N)
    sg = _fp8_scale_row(s_ptr, slot_expert_ptr, cnt, tl.program_id(1) * BLOCK_N, lo_t, stride_se, stride_sn)
    su = sg + (I // 128) * stride_sn           # the up rows follow the gate rows (I is a multiple of 128)
    w_ok = n_ok[:, None]
    for r in range(0, cnt):
        pos = first + r
        row = tl.load(pair_row_ptr + pos)
        x_ptrs = x_ptr + row * stride_xm + lo_t * 128 + tl.arange(0, 128)
        qg = q0
        acc_g = tl.zeros([BLOCK_N, 128], tl.float32)
        acc_u = tl.zeros([BLOCK_N, 128], tl.float32)
        nxt_g = tl.load(qg, mask=w_ok, other=0.0)
        nxt_u = tl.load(qg + I * stride_qn, mask=w_ok, other=0.0)
        for i in range(0, tiles_per_split):
            wg = nxt_g
            wu = nxt_u
            more = _next_ok(w_ok, i, tiles_per_split)
            qg += 128
            nxt_g = tl.load(qg, mask=more, other=0.0)
            nxt_u = tl.load(qg + I * stride_qn, mask=more, other=0.0)
            xf = tl.load(x_ptrs).to(tl.float32)
            acc_g += wg.to(tl.float32) * (xf * tl.load(sg + i))[None, :]
            acc_u += wu.to(tl.float32) * (xf * tl.load(su + i))[None, :]
            x_ptrs += 128
        out = part_ptr + pid_k * P * 2 * I + pos * (2 * I) + n
        tl.store(out, tl.sum(acc_g, 1), mask=n_ok)
        tl.store(out + I, tl.sum(acc_u, 1), mask=n_ok)


@triton.jit
def _fp8_down_kernel(part_ptr, q_ptr, s_ptr, out_ptr, pair_dst_ptr, pair_w_ptr, slot_first_ptr, slot_count_ptr,
                     slot_expert_ptr, H, I, P, up_splits, tiles_per_split, stride_qe, stride_qn, stride_se,
                     stride_sn, BLOCK_N: tl.constexpr, ACT: tl.constexpr):
    cnt, first, n, n_ok, pid_k, lo_t, q0, _, _ = _slot_block(
        q_ptr, s_ptr, s_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, H, tiles_per_split, stride_qe,
        stride_qn, 0, 0, 128, BLOCK_N)
    sp = _fp8_scale_row(s_ptr, slot_expert_ptr, cnt, tl.program_id(1) * BLOCK_N, lo_t, stride_se, stride_sn)
    w_ok = n_ok[:, None]
    for r in range(0, cnt):
        pos = first + r
        a_ptrs = part_ptr + pos * (2 * I) + lo_t * 128 + tl.arange(0, 128)
        q_ptrs = q0
        acc = tl.zeros([BLOCK_N, 128], tl.float32)
        nxt = tl.load(q_ptrs, mask=w_ok, other=0.0)
        for i in range(0, tiles_per_split):
            words = nxt
            q_ptrs += 128
            nxt = tl.load(q_ptrs, mask=_next_ok(w_ok, i, tiles_per_split), other=0.0)
            act = _swiglu_tile(a_ptrs, up_splits, P * 2 * I, I, 128, ACT)
            acc += words.to(tl.float32) * (act * tl.load(sp + i))[None, :]
            a_ptrs += 128
        w = tl.load(pair_w_ptr + pos)
        dst = tl.load(pair_dst_ptr + pos)
        tl.store(out_ptr + pid_k * P * H + dst * H + n, tl.sum(acc, 1) * w, mask=n_ok)


_ACT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def packed_splits(stack: StackedPacked, k1: int, sms: int) -> tuple[int, int]:
    """(up splits, down splits): K split until one row's touched experts (``k1`` pairs) reach the tuning's waves
    (``triton_moe_gemv.expert_splits``); the same at any row count, so a row sums in one order."""
    return expert_splits(min(k1, stack.experts), stack.width, stack.hidden, TILE, sms, PACKED_GEMV_TUNING)


def packed_expert_gemv(x: torch.Tensor, grp: dict[str, torch.Tensor], stack: StackedPacked, k1: int
                       ) -> torch.Tensor:
    """``x [T, H]`` (T <= ``PACKED_GEMV_TUNING["max_rows"]``, contiguous) with its pairs grouped by expert
    (``grp``: ``edgespec.kernels.moe.triton_moe_int4.group_pairs`` or the fused routing launch), ``k1`` slots a row ->
    ``[T, H]`` in x's dtype (see the module doc)."""
    T, H = x.shape
    tune = PACKED_GEMV_TUNING
    if not 0 < T <= tune["max_rows"]:
        raise ValueError(f"{stack.format} expert gemv: {T} rows; this path takes 1-{tune['max_rows']} (more rows "
                         "go to the tensor-core tiles)")
    if 128 % tune["up_block_n"] or 128 % tune["down_block_n"]:
        raise ValueError(f"{stack.format} expert gemv: block widths {tune['up_block_n']}/{tune['down_block_n']} "
                         "must divide 128")
    I = stack.width
    P = T * k1
    up_splits, down_splits = packed_splits(stack, k1, sm_count(x.device))
    common = (grp["slot_first"], grp["slot_count"], grp["slot_expert"])
    warps = tune["num_warps"]
    part = torch.empty((up_splits, P, 2 * I), dtype=torch.float32, device=x.device)
    down = torch.empty((down_splits, P, H), dtype=torch.float32, device=x.device)
    up_grid = (P, triton.cdiv(I, tune["up_block_n"]), up_splits)
    down_grid = (P, triton.cdiv(H, tune["down_block_n"]), down_splits)
    if isinstance(stack, StackedNVFP4):
        q13, q2 = stack.q13.view(torch.int32), stack.q2.view(torch.int32)      # 8 codes per word
        s13, s2 = stack.s13.view(torch.int64), stack.s2.view(torch.int64)      # 8 block scales per tile
        _nvfp4_up_kernel[up_grid](
            x, q13, s13, stack.g13, part, grp["pair_row"], *common, I, P, H // TILE // up_splits, x.stride(0),
            q13.stride(0), q13.stride(1), s13.stride(0), s13.stride(1), BLOCK_N=tune["up_block_n"], num_warps=warps)
        _nvfp4_down_kernel[down_grid](
            part, q2, s2, stack.g2, down, grp["pair_dst"], grp["pair_w"], *common, H, I, P, up_splits,
            I // TILE // down_splits, q2.stride(0), q2.stride(1), s2.stride(0), s2.stride(1),
            BLOCK_N=tune["down_block_n"], ACT=_ACT[x.dtype], num_warps=warps)
    elif isinstance(stack, StackedFP8Block):
        q13, q2, s13, s2 = stack.q13, stack.q2, stack.s13, stack.s2
        _fp8_up_kernel[up_grid](
            x, q13, s13, part, grp["pair_row"], *common, I, P, H // TILE // up_splits, x.stride(0), q13.stride(0),
            q13.stride(1), s13.stride(0), s13.stride(1), BLOCK_N=tune["up_block_n"], num_warps=warps)
        _fp8_down_kernel[down_grid](
            part, q2, s2, down, grp["pair_dst"], grp["pair_w"], *common, H, I, P, up_splits,
            I // TILE // down_splits, q2.stride(0), q2.stride(1), s2.stride(0), s2.stride(1),
            BLOCK_N=tune["down_block_n"], ACT=_ACT[x.dtype], num_warps=warps)
    else:
        raise ValueError(f"packed expert gemv: {type(stack).__name__} is not an NVFP4 or block-FP8 expert stack")
    y = torch.empty((T, H), dtype=x.dtype, device=x.device)
    _slot_sum_kernel[(T, triton.cdiv(H, _SUM_BLOCK))](down, y, H, P, k1, down_splits, BLOCK=_SUM_BLOCK,
                                                       num_warps=4)
    return y
