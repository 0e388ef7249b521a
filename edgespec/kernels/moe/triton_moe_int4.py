"""The routed (and shared) int4 expert product for 1-64 rows in Triton: each touched expert's packed weights read
once per forward, static launch shapes, no host round trip (CUDA-graph capturable whatever the routing).

Layout: :class:`edgespec.kernels.moe.stacks.StackedInt4`. A forward of T rows routed to k experts (plus the shared
expert as slot k when stacked) has P = T * k' (row, slot) pairs. Three launches:

* ``_group_kernel`` (one program): sorts the pairs by expert (``tl.sort`` of ``expert * P' + pair``), counts
  each expert's pairs (``tl.histogram``) and writes a device-side list of touched experts ("slots": first pair,
  pair count, expert id; the unused slots have count 0), and adds the routed union to the routing log.
* ``_up_kernel`` over (slot, 16-row block, width block): the expert's gate and up rows of one width block, read
  once for all its rows, unpacked with the dense int4 tile's pair code (``_int4_pair_tile``) and multiplied on the
  tensor cores; stores ``silu(gate) * up`` per pair.
* ``_down_kernel`` over (slot, 16-row block, hidden block): the expert's down rows against those activations,
  times the pair's routing weight, stored in fp32 at the pair's original place; the k' slots of a row are then
  summed in slot order (deterministic, no atomics).

The grid is sized for the worst case (P slots); programs of unused slots exit at once. The row block is always 16
rows, so a row's product takes the same mma shape whether it runs alone or with 63 others: on this path a row
rounds the same at any T. fp32 activations multiply the exact integer tile on
the FMA path (``input_precision="ieee"``). Contract: ``stacked_int4_expert_product_ref``.

Up to ``GEMV_TUNING["max_rows"]`` rows (a decode step, a short verify) take the CUDA-core path of
``edgespec.kernels.moe.triton_moe_gemv`` instead (:func:`grouped_int4_product` picks): a decode row and the same row
in a verify then differ in the last bits of fp32 sums (as the dense products' one-row and tile kernels do), which
the fp32 speculative == plain tests bound; ``group_pairs`` and
``grouped_int4_product`` also serve the fused routing launch (``edgespec.kernels.moe.triton_moe_route``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels import sm_count
from edgespec.kernels.moe.stacks import KERNEL_GROUPS, StackedInt4
from edgespec.kernels.moe.triton_moe_gemv import GEMV_TUNING, int4_expert_gemv
from edgespec.kernels.quant.triton_quant_tiles import _int4_pair_tile, _pair_order_x

ROW_BLOCK = 16
MAX_ROWS = 64
# Launch knobs (tools/moe_int4_bench.py sweeps them): weight rows per program of the up and down kernels (halved
# while the touched experts' programs are fewer than ``waves`` per SM), warps and pipeline stages.
TUNING = {"up_block_n": 32, "down_block_n": 64, "waves": 4, "num_warps": 4, "num_stages": 3}


@triton.jit
def _group_kernel(experts_ptr, weights_ptr, shared_ptr, pair_row_ptr, pair_dst_ptr, pair_w_ptr, slot_first_ptr,
                  slot_count_ptr, slot_expert_ptr, log_sums_ptr, log_calls_ptr, T, E_SHARED,
                  K: tl.constexpr, K1: tl.constexpr, P_PAD: tl.constexpr, BINS: tl.constexpr,
                  SHARED: tl.constexpr, LOG: tl.constexpr):
    _group_body(experts_ptr, weights_ptr, shared_ptr, pair_row_ptr, pair_dst_ptr, pair_w_ptr, slot_first_ptr,
                slot_count_ptr, slot_expert_ptr, log_sums_ptr, log_calls_ptr, T, E_SHARED, K, K1, P_PAD, BINS,
                SHARED, LOG)


@triton.jit
def _group_body(experts_ptr, weights_ptr, shared_ptr, pair_row_ptr, pair_dst_ptr, pair_w_ptr, slot_first_ptr,
                slot_count_ptr, slot_expert_ptr, log_sums_ptr, log_calls_ptr, T, E_SHARED,
                K: tl.constexpr, K1: tl.constexpr, P_PAD: tl.constexpr, BINS: tl.constexpr,
                SHARED: tl.constexpr, LOG: tl.constexpr):
    """The grouping of ``_group_kernel`` (also the tail of the fused routing launch,
    ``edgespec.kernels.moe.triton_moe_route``): routing ``experts``/``weights [T, K]`` and the shared gate ``[T]`` read
    from memory, the sorted pairs and the touched-expert slots written."""
    p = tl.arange(0, P_PAD)
    P = T * K1
    ok = p < P
    row = p // K1
    j = p % K1
    routed = ok & (j < K)
    e = tl.load(experts_ptr + row * K + j, mask=routed, other=0).to(tl.int32)
    if SHARED:
        e = tl.where(ok & (j == K), E_SHARED, e)
    e = tl.where(ok, e, BINS - 1)                   # padding: a bin of its own, sorted last
    # sorted position -> pair: keys are unique, so the order within an expert is the pair order (stable)
    src = tl.sort(e * P_PAD + p) % P_PAD
    src_row = src // K1
    src_j = src % K1
    w = tl.load(weights_ptr + src_row * K + src_j, mask=ok & (src_j < K), other=0.0).to(tl.float32)
    if SHARED:
        w = tl.where(src_j == K, tl.load(shared_ptr + src_row, mask=ok & (src_j == K), other=0.0).to(tl.float32), w)
    tl.store(pair_row_ptr + p, src_row, mask=ok)
    tl.store(pair_dst_ptr + p, src, mask=ok)
    tl.store(pair_w_ptr + p, w, mask=ok)
    # touched experts, in expert order: slot s = the s-th expert with pairs
    counts = tl.histogram(e, BINS)
    b = tl.arange(0, BINS)
    used = (counts > 0) & (b < BINS - 1)
    first = tl.cumsum(counts, 0) - counts
    slot = tl.cumsum(used.to(tl.int32), 0) - 1
    tl.store(slot_count_ptr + p, tl.zeros_like(p), mask=ok)       # unused slots: no pairs
    tl.debug_barrier()
    tl.store(slot_count_ptr + slot, counts, mask=used)
    tl.store(slot_first_ptr + slot, first, mask=used)
    tl.store(slot_expert_ptr + slot, b, mask=used)
    if LOG:
        routed_used = used
        if SHARED:
            routed_used = used & (b < E_SHARED)         # the shared expert is read by every forward: not counted
        union = tl.sum(routed_used.to(tl.float32), 0)
        tl.store(log_sums_ptr + T, tl.load(log_sums_ptr + T) + union)
        tl.store(log_calls_ptr + T, tl.load(log_calls_ptr + T) + 1.0)


@triton.jit
def _slot_rows(pair_row_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, s, rb):
    """(rows in bounds, their sorted pair positions, their token rows, the slot's expert) of row block ``rb`` of
    slot ``s``."""
    cnt = tl.load(slot_count_ptr + s)
    r = rb * 16 + tl.arange(0, 16)
    r_ok = r < cnt
    pos = tl.load(slot_first_ptr + s) + r
    rows = tl.load(pair_row_ptr + pos, mask=r_ok, other=0)
    return r_ok, pos, rows, tl.load(slot_expert_ptr + s).to(tl.int64)


@triton.jit
def _int4_group_dot(acc, x, q_ptrs, s_ptr, z_ptr, t, n_ok, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                    IS_BF16: tl.constexpr, F32: tl.constexpr):
    """``acc`` plus one quantization group's product ``x [16, GROUP] @ W^T`` (pair-ordered x), scaled by the
    rows' group scales; the weight tile is unpacked by the dense int4 kernel's pair code."""
    words = tl.load(q_ptrs, mask=n_ok[:, None], other=0)
    z = tl.load(z_ptr + t, mask=n_ok, other=0).to(tl.int32)
    s = tl.load(s_ptr + t, mask=n_ok, other=0.0).to(tl.float32)
    w = _int4_pair_tile(words, z, BLOCK_N, GROUP, IS_BF16)
    if F32:
        part = tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        part = tl.dot(x, tl.trans(w))
    return acc + part * s[None, :]


@triton.jit
def _up_kernel(x_ptr, q_ptr, s_ptr, z_ptr, act_ptr, pair_row_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr,
               I, stride_xm, stride_qe, stride_qn, stride_se, stride_sn, K_TILES: tl.constexpr,
               GROUP: tl.constexpr, BLOCK_N: tl.constexpr, IS_BF16: tl.constexpr, F32: tl.constexpr):
    s_id = tl.program_id(0)
    rb = tl.program_id(1)
    if rb * 16 < tl.load(slot_count_ptr + s_id):
        r_ok, pos, rows, e = _slot_rows(pair_row_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, s_id, rb)
        WORDS: tl.constexpr = GROUP // 8
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < I
        qg = q_ptr + e * stride_qe + n[:, None] * stride_qn + tl.arange(0, WORDS)[None, :]
        qu = qg + I * stride_qn
        # scales and zeros share a layout ([E', 2I, H/g], contiguous): one set of strides
        sg = s_ptr + e * stride_se + n * stride_sn
        zg = z_ptr + e * stride_se + n * stride_sn
        x_ptrs = x_ptr + rows[:, None] * stride_xm + tl.arange(0, GROUP)[None, :]
        acc_g = tl.zeros([16, BLOCK_N], tl.float32)
        acc_u = tl.zeros([16, BLOCK_N], tl.float32)
        for t in range(0, K_TILES):
            x = _pair_order_x(x_ptrs, r_ok[:, None], 16, GROUP)
            acc_g = _int4_group_dot(acc_g, x, qg, sg, zg, t, n_ok, BLOCK_N, GROUP, IS_BF16, F32)
            acc_u = _int4_group_dot(acc_u, x, qu, sg + I * stride_sn, zg + I * stride_sn, t, n_ok, BLOCK_N, GROUP,
                                    IS_BF16, F32)
            qg += WORDS
            qu += WORDS
            x_ptrs += GROUP
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(act_ptr + pos[:, None] * I + n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, q_ptr, s_ptr, z_ptr, y_ptr, pair_row_ptr, pair_dst_ptr, pair_w_ptr, slot_first_ptr,
                 slot_count_ptr, slot_expert_ptr, H, I, stride_qe, stride_qn, stride_se, stride_sn,
                 K_TILES: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, IS_BF16: tl.constexpr,
                 F32: tl.constexpr):
    s_id = tl.program_id(0)
    rb = tl.program_id(1)
    if rb * 16 < tl.load(slot_count_ptr + s_id):
        r_ok, pos, rows, e = _slot_rows(pair_row_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, s_id, rb)
        WORDS: tl.constexpr = GROUP // 8
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < H
        q_ptrs = q_ptr + e * stride_qe + n[:, None] * stride_qn + tl.arange(0, WORDS)[None, :]
        sp = s_ptr + e * stride_se + n * stride_sn
        zp = z_ptr + e * stride_se + n * stride_sn
        a_ptrs = act_ptr + pos[:, None] * I + tl.arange(0, GROUP)[None, :]
        acc = tl.zeros([16, BLOCK_N], tl.float32)
        for t in range(0, K_TILES):
            a = _pair_order_x(a_ptrs, r_ok[:, None], 16, GROUP)
            acc = _int4_group_dot(acc, a, q_ptrs, sp, zp, t, n_ok, BLOCK_N, GROUP, IS_BF16, F32)
            q_ptrs += WORDS
            a_ptrs += GROUP
        w = tl.load(pair_w_ptr + pos, mask=r_ok, other=0.0)
        dst = tl.load(pair_dst_ptr + pos, mask=r_ok, other=0)
        tl.store(y_ptr + dst[:, None].to(tl.int64) * H + n[None, :], acc * w[:, None],
                 mask=r_ok[:, None] & n_ok[None, :])


def _block_n(start: int, slots: int, row_blocks: int, n: int, sms: int) -> int:
    """Weight rows per program: ``start``, halved down to 16 while the touched slots' programs are fewer than
    ``waves`` per SM (a one-row decode touches k' experts only)."""
    bn = start
    while bn > 16 and slots * row_blocks * triton.cdiv(n, bn) < TUNING["waves"] * sms:
        bn //= 2
    return bn


def group_buffers(pairs: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The grouping launch's outputs for ``pairs`` (row, slot) pairs (see :func:`group_pairs`), unfilled."""
    out = {name: torch.empty(pairs, dtype=torch.int32, device=device)
           for name in ("pair_row", "pair_dst", "slot_first", "slot_count", "slot_expert")}
    out["pair_w"] = torch.empty(pairs, dtype=torch.float32, device=device)
    return out


def group_pairs(experts: torch.Tensor, weights: torch.Tensor, stack: StackedInt4,
                shared_weight: torch.Tensor | None, log: tuple[torch.Tensor, torch.Tensor] | None
                ) -> dict[str, torch.Tensor]:
    """The device-side grouping of ``_group_kernel``: ``pair_row``/``pair_dst``/``pair_w`` per sorted pair and
    ``slot_first``/``slot_count``/``slot_expert`` per touched expert (P each)."""
    T, k = experts.shape
    k1 = k + int(stack.shared)
    P = T * k1
    out = group_buffers(P, experts.device)
    if stack.shared and shared_weight is None:
        raise ValueError("stacked int4 experts hold the shared expert: its gate weight [T, 1] is needed")
    shared = shared_weight.reshape(-1) if shared_weight is not None else weights
    sums, calls = log if log is not None else (out["pair_w"], out["pair_w"])
    _group_kernel[(1,)](experts.contiguous(), weights.contiguous(), shared, out["pair_row"], out["pair_dst"],
                        out["pair_w"], out["slot_first"], out["slot_count"], out["slot_expert"], sums, calls, T,
                        stack.experts - 1, K=k, K1=k1, P_PAD=max(16, triton.next_power_of_2(P)),
                        BINS=triton.next_power_of_2(stack.experts + 1), SHARED=stack.shared,
                        LOG=log is not None and T < sums.shape[0], num_warps=4)
    return out


def check_product_input(x: torch.Tensor, stack: StackedInt4) -> None:
    """The rows, hidden size, dtype and group size the int4 expert kernels take; a named error otherwise."""
    T, H = x.shape
    if T > MAX_ROWS or H != stack.hidden or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"int4 expert product: x {tuple(x.shape)} {x.dtype} must be 1-{MAX_ROWS} rows of hidden "
                         f"{stack.hidden} in bf16, fp16 or fp32")
    if stack.group_size not in KERNEL_GROUPS:
        raise ValueError(f"int4 expert product: group size {stack.group_size} must be one of {KERNEL_GROUPS}")


def stacked_int4_expert_product_triton(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                                       stack: StackedInt4, shared_weight: torch.Tensor | None = None,
                                       log: tuple[torch.Tensor, torch.Tensor] | None = None,
                                       path: str = "auto") -> torch.Tensor:
    """``x [T, H]`` (T <= 64; bf16, fp16 or fp32), routing ``weights``/``experts [T, k]``, the shared expert's
    gate ``[T, 1]`` when stacked -> ``[T, H]`` in x's dtype (see the module doc). ``path``: see
    :func:`grouped_int4_product`."""
    check_product_input(x, stack)
    grp = group_pairs(experts, weights, stack, shared_weight, log)
    return grouped_int4_product(x.contiguous(), grp, stack, experts.shape[1] + int(stack.shared), path)


def grouped_int4_product(x: torch.Tensor, grp: dict[str, torch.Tensor], stack: StackedInt4, k1: int,
                         path: str = "auto") -> torch.Tensor:
    """The expert product of rows already grouped (:func:`group_pairs`, or the fused routing launch of
    ``edgespec.kernels.moe.triton_moe_route``), ``k1`` slots a row. ``path``: ``"gemv"`` the CUDA-core one-row path
    (``edgespec.kernels.moe.triton_moe_gemv``, up to its ``max_rows``), ``"mma"`` the 16-row tensor-core tiles of
    this module, ``"auto"`` the first for up to ``GEMV_TUNING["max_rows"]`` rows, else the second."""
    T = x.shape[0]
    if path not in ("auto", "gemv", "mma"):
        raise ValueError(f"int4 expert product: path {path!r} is not one of auto, gemv, mma")
    if path == "gemv" or path == "auto" and T <= GEMV_TUNING["max_rows"]:
        return int4_expert_gemv(x, grp, stack, k1)
    return _mma_product(x, grp, stack, k1)


def _mma_product(x: torch.Tensor, grp: dict[str, torch.Tensor], stack: StackedInt4, k1: int) -> torch.Tensor:
    """The tensor-core path: gate+up, then down into per-pair fp32 rows, then the slots summed."""
    T, H = x.shape
    I, g = stack.width, stack.group_size
    P = T * k1
    rb = triton.cdiv(T, ROW_BLOCK)
    touched = min(P, stack.experts)
    sms = sm_count(x.device)
    common = dict(IS_BF16=x.dtype == torch.bfloat16, F32=x.dtype == torch.float32, GROUP=g,
                  num_warps=TUNING["num_warps"], num_stages=TUNING["num_stages"])
    act = torch.empty((P, I), dtype=x.dtype, device=x.device)
    q13, q2 = stack.q13.view(torch.int32), stack.q2.view(torch.int32)      # 8 codes per word
    bn = _block_n(TUNING["up_block_n"], touched, rb, I, sms)
    _up_kernel[(P, rb, triton.cdiv(I, bn))](
        x, q13, stack.s13, stack.z13, act, grp["pair_row"], grp["slot_first"], grp["slot_count"],
        grp["slot_expert"], I, x.stride(0), q13.stride(0), q13.stride(1), stack.s13.stride(0),
        stack.s13.stride(1), K_TILES=H // g, BLOCK_N=bn, **common)
    y = torch.empty((P, H), dtype=torch.float32, device=x.device)
    bn = _block_n(TUNING["down_block_n"], touched, rb, H, sms)
    _down_kernel[(P, rb, triton.cdiv(H, bn))](
        act, q2, stack.s2, stack.z2, y, grp["pair_row"], grp["pair_dst"], grp["pair_w"], grp["slot_first"],
        grp["slot_count"], grp["slot_expert"], H, I, q2.stride(0), q2.stride(1), stack.s2.stride(0),
        stack.s2.stride(1), K_TILES=I // g, BLOCK_N=bn, **common)
    return y.view(T, k1, H).sum(dim=1).to(x.dtype)
