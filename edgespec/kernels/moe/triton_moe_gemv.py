"""The int4 expert product for a few rows (a plain decode step: 1 row; a short verify: up to
``GEMV_TUNING["max_rows"]``) on the CUDA cores, without the 16-row tensor-core tile.

At one row the tensor-core path of ``edgespec.kernels.moe.triton_moe_int4`` pads each touched expert's rows to a
16-row tile and runs one program per (expert, weight block): a 35B-A3B layer touches 9 experts (8 routed + the
shared one), too few programs to keep enough bytes in flight, and the tile does 16x the arithmetic. Here each
program takes a block of one touched expert's packed words for each of that expert's rows in turn (a second row
reads them from L2), as the dense one-row kernel does for its one row, and unpacks them with that kernel's word
code (``_int4_word_values`` of ``edgespec.kernels.quant.triton_quant_tiles``: eight ``q - z`` per int32 word in fp16
pair arithmetic, exact), multiplying in fp32; K is split across programs
(``wave_splits``) until the touched experts fill ``waves`` programs per SM. Three launches after the grouping:

* ``_gemv_up_kernel`` over (slot, width block, K split): the expert's gate and up rows of the block, fp32
  partial sums per split into ``[splits, pairs, 2I]``.
* ``_gemv_down_kernel`` over (slot, hidden block, K split): sums the up partials in split order, applies
  ``silu(gate) * up`` (rounded to x's dtype, as the reference rounds the SwiGLU) for its K range, multiplies by the
  expert's down rows and the pair's routing weight, and stores fp32 partials at the pair's original place
  (``[splits, T * k', H]``).
* ``_slot_sum_kernel`` over (row, hidden block): the row's k' slots and the down splits summed in a fixed order,
  stored in x's dtype.

No atomics: every sum has a fixed order, so a replay gives the same bits. The grids are sized for the worst case
(every pair its own expert); programs of unused slots exit at once, so the launches are CUDA-graph capturable
whatever the routing. Contract: ``edgespec.kernels.moe.moe_quant.stacked_int4_expert_product_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels import sm_count
from edgespec.kernels.moe.stacks import StackedInt4
from edgespec.kernels.quant.triton_quant_tiles import _int4_word_values, wave_splits

# Launch knobs (tools/moe_int4_bench.py layer sweeps them; the model bench takes the best with --tuning):
# ``max_rows``: the most rows this path takes (more go to the tensor-core tiles); weight rows per program of the
# up (gate and up rows each) and down kernels; programs wanted per SM (K is split until the touched experts'
# blocks reach them); the fewest K tiles a down split keeps; warps per program. The values are the sweep's best on
# the 35B-A3B layer (H200, docs/benchmarks.md): this path beats the tensor-core tiles at 1 and 2 rows and loses at 4,
# so it takes up to 2.
GEMV_TUNING = {"max_rows": 2, "up_block_n": 16, "down_block_n": 32, "waves": 8, "down_min_tiles": 1,
               "num_warps": 4}
_SUM_BLOCK = 512


@triton.jit
def _word_inputs(xf, WORDS: tl.constexpr):
    """``xf [8 * WORDS]`` -> eight ``[WORDS]``: piece j holds input 8w + j (nibble j of word w)."""
    xa, xb = tl.split(tl.reshape(xf, [WORDS, 4, 2]))            # j even / odd
    x0, x2 = tl.split(tl.reshape(xa, [WORDS, 2, 2]))            # j in {0, 4} / {2, 6}
    x1, x3 = tl.split(tl.reshape(xb, [WORDS, 2, 2]))            # j in {1, 5} / {3, 7}
    x0, x4 = tl.split(x0)
    x2, x6 = tl.split(x2)
    x1, x5 = tl.split(x1)
    x3, x7 = tl.split(x3)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _word_dot(words, z, s, xf, WORDS: tl.constexpr):
    """``[BLOCK_N, WORDS]``: per weight row and word, the sum over the word's eight inputs (of ``xf [8 * WORDS]``)
    of ``(q - z) * x``, times the row's group scale ``s``."""
    zh = z | 0x6400
    zpair = (zh | (zh << 16))[:, None] + tl.zeros_like(words)
    v0, v1, v2, v3, v4, v5, v6, v7 = _int4_word_values(words, zpair)
    x0, x1, x2, x3, x4, x5, x6, x7 = _word_inputs(xf, WORDS)
    part = v0 * x0[None, :] + v1 * x1[None, :] + v2 * x2[None, :] + v3 * x3[None, :]
    part += v4 * x4[None, :] + v5 * x5[None, :] + v6 * x6[None, :] + v7 * x7[None, :]
    return part * s[:, None]


@triton.jit
def _slot_block(q_ptr, s_ptr, z_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, N, tiles_per_split, stride_qe,
                stride_qn, stride_se, stride_sn, WORDS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The program's (slot, weight block, K split) of grid axes 0, 1, 2: (the slot's pair count, its first sorted
    pair, weight rows and their in-bounds mask, K split, first K tile, and the expert's word, scale and zero
    pointers at that tile). An unused slot (count 0) reads expert 0's pointers and runs no row."""
    s_id = tl.program_id(0)
    cnt = tl.load(slot_count_ptr + s_id)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    lo_t = pid_k * tiles_per_split          # the host makes the splits divide the tiles evenly
    e = tl.load(slot_expert_ptr + s_id, mask=cnt > 0, other=0).to(tl.int64)
    first = tl.load(slot_first_ptr + s_id, mask=cnt > 0, other=0)
    q0 = q_ptr + e * stride_qe + n[:, None] * stride_qn + (lo_t * WORDS + tl.arange(0, WORDS))[None, :]
    return (cnt, first, n, n < N, pid_k, lo_t, q0, s_ptr + e * stride_se + n * stride_sn + lo_t,
            z_ptr + e * stride_se + n * stride_sn + lo_t)


@triton.jit
def _gemv_up_kernel(x_ptr, q_ptr, s_ptr, z_ptr, part_ptr, pair_row_ptr, slot_first_ptr, slot_count_ptr,
                    slot_expert_ptr, I, P, tiles_per_split, stride_xm, stride_qe, stride_qn, stride_se, stride_sn,
                    GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    WORDS: tl.constexpr = GROUP // 8
    # scales and zeros share a layout ([E', 2I, H/g], contiguous): one set of strides; up rows follow gate rows
    cnt, first, n, n_ok, pid_k, lo_t, q0, sg, zg = _slot_block(
        q_ptr, s_ptr, z_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, I, tiles_per_split, stride_qe,
        stride_qn, stride_se, stride_sn, WORDS, BLOCK_N)
    # one row at a time, as the dense one-row kernel: a second row of the same expert reads the words from L2
    for r in range(0, cnt):
        pos = first + r
        row = tl.load(pair_row_ptr + pos)
        x_ptrs = x_ptr + row * stride_xm + lo_t * GROUP + tl.arange(0, GROUP)
        qg = q0
        acc_g = tl.zeros([BLOCK_N, WORDS], tl.float32)
        acc_u = tl.zeros([BLOCK_N, WORDS], tl.float32)
        # the next tile's words are loaded before this tile is unpacked: twice the bytes in flight per thread
        nxt_g = tl.load(qg, mask=n_ok[:, None], other=0)
        nxt_u = tl.load(qg + I * stride_qn, mask=n_ok[:, None], other=0)
        for i in range(0, tiles_per_split):
            wg = nxt_g
            wu = nxt_u
            more = n_ok[:, None] & (i + 1 < tiles_per_split)
            qg += WORDS
            nxt_g = tl.load(qg, mask=more, other=0)
            nxt_u = tl.load(qg + I * stride_qn, mask=more, other=0)
            xf = tl.load(x_ptrs).to(tl.float32)
            acc_g += _word_dot(wg, tl.load(zg + i, mask=n_ok, other=0).to(tl.int32),
                               tl.load(sg + i, mask=n_ok, other=0.0).to(tl.float32), xf, WORDS)
            acc_u += _word_dot(wu, tl.load(zg + I * stride_sn + i, mask=n_ok, other=0).to(tl.int32),
                               tl.load(sg + I * stride_sn + i, mask=n_ok, other=0.0).to(tl.float32), xf, WORDS)
            x_ptrs += GROUP
        out = part_ptr + pid_k * P * 2 * I + pos * (2 * I) + n
        tl.store(out, tl.sum(acc_g, 1), mask=n_ok)
        tl.store(out + I, tl.sum(acc_u, 1), mask=n_ok)


@triton.jit
def _swiglu_tile(a_ptrs, up_splits, split_stride, I, TILE: tl.constexpr, ACT: tl.constexpr):
    """``silu(gate) * up`` of ``TILE`` activations at ``a_ptrs`` (gate partials; the up ones ``I`` further), the up
    kernel's K splits (``split_stride`` apart) summed in split order, rounded to x's dtype as the reference stores
    the SwiGLU, as fp32."""
    g = tl.zeros([TILE], tl.float32)
    u = tl.zeros([TILE], tl.float32)
    for sk in range(0, up_splits):
        g += tl.load(a_ptrs + sk * split_stride)
        u += tl.load(a_ptrs + sk * split_stride + I)
    return (g / (1.0 + tl.exp(-g)) * u).to(ACT).to(tl.float32)


@triton.jit
def _gemv_down_kernel(part_ptr, q_ptr, s_ptr, z_ptr, out_ptr, pair_dst_ptr, pair_w_ptr, slot_first_ptr,
                      slot_count_ptr, slot_expert_ptr, H, I, P, up_splits, tiles_per_split, stride_qe, stride_qn,
                      stride_se, stride_sn, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr):
    WORDS: tl.constexpr = GROUP // 8
    cnt, first, n, n_ok, pid_k, lo_t, q0, sp, zp = _slot_block(
        q_ptr, s_ptr, z_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, H, tiles_per_split, stride_qe,
        stride_qn, stride_se, stride_sn, WORDS, BLOCK_N)
    for r in range(0, cnt):
        pos = first + r
        a_ptrs = part_ptr + pos * (2 * I) + lo_t * GROUP + tl.arange(0, GROUP)
        q_ptrs = q0
        acc = tl.zeros([BLOCK_N, WORDS], tl.float32)
        nxt = tl.load(q_ptrs, mask=n_ok[:, None], other=0)
        for i in range(0, tiles_per_split):
            words = nxt
            q_ptrs += WORDS
            nxt = tl.load(q_ptrs, mask=n_ok[:, None] & (i + 1 < tiles_per_split), other=0)
            act = _swiglu_tile(a_ptrs, up_splits, P * 2 * I, I, GROUP, ACT)
            acc += _word_dot(words, tl.load(zp + i, mask=n_ok, other=0).to(tl.int32),
                             tl.load(sp + i, mask=n_ok, other=0.0).to(tl.float32), act, WORDS)
            a_ptrs += GROUP
        w = tl.load(pair_w_ptr + pos)
        dst = tl.load(pair_dst_ptr + pos)
        tl.store(out_ptr + pid_k * P * H + dst * H + n, tl.sum(acc, 1) * w, mask=n_ok)


@triton.jit
def _slot_sum_kernel(part_ptr, y_ptr, H, P, K1, splits, BLOCK: tl.constexpr):
    """``y[t] = sum over slots j, then down splits, of part[split, t * K1 + j]``, in x's dtype."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(0, K1):
        for sk in range(0, splits):
            acc += tl.load(part_ptr + (sk * P + t * K1 + j) * H + n, mask=n_ok, other=0.0)
    tl.store(y_ptr + t * H + n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv_splits(stack: StackedInt4, rows: int, k1: int, sms: int) -> tuple[int, int]:
    """(up splits, down splits) of a call of ``rows`` rows: K split until the touched experts' weight blocks
    reach ``waves`` programs per SM (the splits divide the K tiles evenly)."""
    return expert_splits(min(rows * k1, stack.experts), stack.width, stack.hidden, stack.group_size, sms,
                         GEMV_TUNING)


def expert_splits(touched: int, width: int, hidden: int, tile: int, sms: int, tuning: dict[str, int]
                  ) -> tuple[int, int]:
    """(up splits, down splits) for ``touched`` experts of ``width`` x ``hidden`` read ``tile`` inputs at a time,
    under ``tuning``'s block widths, waves and fewest down tiles (see :func:`gemv_splits`)."""
    want = tuning["waves"] * sms
    up = wave_splits(touched * triton.cdiv(width, tuning["up_block_n"]), hidden // tile, want)
    down = wave_splits(touched * triton.cdiv(hidden, tuning["down_block_n"]), width // tile, want,
                       tuning["down_min_tiles"])
    return up, down


_ACT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def int4_expert_gemv(x: torch.Tensor, grp: dict[str, torch.Tensor], stack: StackedInt4, k1: int) -> torch.Tensor:
    """``x [T, H]`` (T <= ``GEMV_TUNING["max_rows"]``, contiguous) with its pairs grouped by expert (``grp``:
    ``edgespec.kernels.moe.triton_moe_int4.group_pairs`` or the fused routing launch), ``k1`` slots a row ->
    ``[T, H]`` in x's dtype (see the module doc)."""
    T, H = x.shape
    if not 0 < T <= GEMV_TUNING["max_rows"]:
        raise ValueError(f"int4 expert gemv: {T} rows; this path takes 1-{GEMV_TUNING['max_rows']} "
                         "(more rows go to the tensor-core tiles)")
    I, g = stack.width, stack.group_size
    P = T * k1
    up_splits, down_splits = gemv_splits(stack, T, k1, sm_count(x.device))
    q13, q2 = stack.q13.view(torch.int32), stack.q2.view(torch.int32)      # 8 codes per word
    warps = GEMV_TUNING["num_warps"]
    common = (grp["slot_first"], grp["slot_count"], grp["slot_expert"])
    part = torch.empty((up_splits, P, 2 * I), dtype=torch.float32, device=x.device)
    bn = GEMV_TUNING["up_block_n"]
    _gemv_up_kernel[(P, triton.cdiv(I, bn), up_splits)](
        x, q13, stack.s13, stack.z13, part, grp["pair_row"], *common, I, P, H // g // up_splits, x.stride(0),
        q13.stride(0), q13.stride(1), stack.s13.stride(0), stack.s13.stride(1), GROUP=g, BLOCK_N=bn,
        num_warps=warps)
    down = torch.empty((down_splits, P, H), dtype=torch.float32, device=x.device)
    bn = GEMV_TUNING["down_block_n"]
    _gemv_down_kernel[(P, triton.cdiv(H, bn), down_splits)](
        part, q2, stack.s2, stack.z2, down, grp["pair_dst"], grp["pair_w"], *common, H, I, P, up_splits,
        I // g // down_splits, q2.stride(0), q2.stride(1), stack.s2.stride(0), stack.s2.stride(1), GROUP=g,
        BLOCK_N=bn, ACT=_ACT[x.dtype], num_warps=warps)
    y = torch.empty((T, H), dtype=x.dtype, device=x.device)
    _slot_sum_kernel[(T, triton.cdiv(H, _SUM_BLOCK))](down, y, H, P, k1, down_splits, BLOCK=_SUM_BLOCK,
                                                       num_warps=4)
    return y
