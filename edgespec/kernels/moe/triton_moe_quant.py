"""The routed (and shared) NVFP4 and block-FP8 expert products for 1-64 rows in Triton: the int4 expert kernel's
launches (``edgespec.kernels.moe.triton_moe_int4``) over the stacks of ``edgespec.kernels.moe.moe_packed``, with the
dense tiles' decode of these formats.

Three launches, as for int4: the int4 module's grouping launch (``group_pairs``: pairs sorted by expert on the
device, a list of touched experts, the routed union added to the routing log), then

* ``_up_kernel`` over (slot, 16-row block, width block): the expert's gate and up rows of one width block, read
  once for all its rows, 128 inputs per tile on the tensor cores; stores ``silu(gate) * up`` per pair;
* ``_down_kernel`` over (slot, 16-row block, hidden block): the expert's down rows against those activations, times
  the pair's routing weight, in fp32 at the pair's place; the k' slots of a row are summed in slot order.

Decode per format (each exact in the activation type, so the products round only in the fp32 accumulator):

* nvfp4: ``triton_quant_wide._nvfp4_word_tile`` (the dense weight-major tile's decode): e2m1 bits placed under the
  exponent and one pair multiply by the e4m3 block scale times 2^SHIFT, the tile's columns in the pair order of
  ``triton_quant_tiles._pair_order_x`` (the activation tile is permuted to match); the accumulator is scaled by the
  matrix's global scale (gate, up and down each their own) and 2^-SHIFT once.
* fp8_block: e4m3 converted to the activation type; one 128x128 block scale per tile and program (a program's
  rows lie in one block row: its row count divides 128).

The grid is sized for the worst case (P slots) and programs of unused slots exit at once, so CUDA graphs capture it
whatever the routing; rows always run in 16-row blocks, so a row rounds the same at any row count on this path. fp32
activations multiply the exact decoded tile on the FMA path (``input_precision="ieee"``). Contract:
``edgespec.kernels.moe.moe_packed.stacked_packed_expert_product_ref``.

Up to ``PACKED_GEMV_TUNING["max_rows"]`` rows take the CUDA-core path of
``edgespec.kernels.moe.triton_moe_gemv_packed`` instead (:func:`grouped_packed_product` picks), as int4's do; a decode
row and the same row in a 16-row verify then differ in the last bits of fp32 sums, which the fp32 speculative ==
plain tests bound. :func:`stacked_packed_moe_triton` routes and groups in the fused routing launch of
``edgespec.kernels.moe.triton_moe_route`` first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels import sm_count
from edgespec.kernels.moe.stacks import TILE, StackedFP8Block, StackedNVFP4, StackedPacked
from edgespec.kernels.moe.triton_moe_gemv_packed import PACKED_GEMV_TUNING, packed_expert_gemv
from edgespec.kernels.moe.triton_moe_int4 import MAX_ROWS, ROW_BLOCK, TUNING, _block_n, _slot_rows, group_pairs
from edgespec.kernels.quant.triton_quant_tiles import NVFP4_BF16_SHIFT, NVFP4_FP16_SHIFT, _pair_order_x
from edgespec.kernels.quant.triton_quant_wide import _nvfp4_word_tile


@triton.jit
def _dot_acc(acc, x, w, F32: tl.constexpr):
    """``acc + x @ w^T`` in fp32: tensor cores for 16-bit x, the FMA path for fp32 x (exact products)."""
    if F32:
        return tl.dot(x, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w.to(x.dtype)), acc)


@triton.jit
def _nvfp4_tile_ptrs(q_ptr, s_ptr, e, n, stride_qe, stride_qn, stride_se, stride_sn):
    """The first 128-input tile of rows ``n`` of expert ``e``: words as ``[BLOCK_N, 8 blocks, 2 words]`` (int32, 8
    codes each) and the rows' eight block scales ``[BLOCK_N, 8]``; a tile further is +16 words, +8 scales."""
    w = (q_ptr + e * stride_qe + n[:, None, None] * stride_qn + tl.arange(0, 8)[None, :, None] * 2
         + tl.arange(0, 2)[None, None, :])
    s = s_ptr + e * stride_se + n[:, None] * stride_sn + tl.arange(0, 8)[None, :]
    return w, s


@triton.jit
def _nvfp4_tile_dot(acc, x, w_ptrs, s_ptrs, n_ok, BLOCK_N: tl.constexpr, IS_BF16: tl.constexpr, F32: tl.constexpr):
    """``acc`` plus ``x [16, 128]`` (pair order) times one decoded tile (values x block scale x 2^-SHIFT)."""
    SHIFT: tl.constexpr = NVFP4_BF16_SHIFT if IS_BF16 else NVFP4_FP16_SHIFT
    words = tl.load(w_ptrs, mask=n_ok[:, None, None], other=0)
    sc = tl.load(s_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32) * (2.0 ** SHIFT)
    return _dot_acc(acc, x, _nvfp4_word_tile(words, sc, BLOCK_N, IS_BF16, True), F32)


@triton.jit
def _nvfp4_unshift(acc, g_ptr, IS_BF16: tl.constexpr):
    """The accumulator of decoded tiles times the matrix's global scale and 2^SHIFT (undoing the decode's shift)."""
    SHIFT: tl.constexpr = NVFP4_BF16_SHIFT if IS_BF16 else NVFP4_FP16_SHIFT
    return acc * (tl.load(g_ptr) * (2.0 ** SHIFT))


@triton.jit
def _fp8_tile_dot(acc, x, w_ptrs, s, n_ok, F32: tl.constexpr):
    """``acc`` plus ``x [16, 128]`` times one e4m3 tile, the product scaled by the tile's block scale ``s``."""
    w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
    return acc + _dot_acc(tl.zeros_like(acc), x, w, F32) * s


@triton.jit
def _up_kernel(x_ptr, q_ptr, s_ptr, g_ptr, act_ptr, pair_row_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr,
               I, stride_xm, stride_qe, stride_qn, stride_se, stride_sn, K_TILES: tl.constexpr,
               BLOCK_N: tl.constexpr, NVFP4: tl.constexpr, IS_BF16: tl.constexpr, F32: tl.constexpr):
    s_id = tl.program_id(0)
    rb = tl.program_id(1)
    if rb * 16 < tl.load(slot_count_ptr + s_id):
        r_ok, pos, rows, e = _slot_rows(pair_row_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, s_id, rb)
        n0 = tl.program_id(2) * BLOCK_N
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < I
        x_ptrs = x_ptr + rows[:, None] * stride_xm + tl.arange(0, 128)[None, :]
        acc_g = tl.zeros([16, BLOCK_N], tl.float32)
        acc_u = tl.zeros([16, BLOCK_N], tl.float32)
        if NVFP4:
            wg, sg = _nvfp4_tile_ptrs(q_ptr, s_ptr, e, n, stride_qe, stride_qn, stride_se, stride_sn)
            wu = wg + I * stride_qn                 # the up rows follow the gate rows
            su = sg + I * stride_sn
            for _ in range(0, K_TILES):
                x = _pair_order_x(x_ptrs, r_ok[:, None], 16, 128)
                acc_g = _nvfp4_tile_dot(acc_g, x, wg, sg, n_ok, BLOCK_N, IS_BF16, F32)
                acc_u = _nvfp4_tile_dot(acc_u, x, wu, su, n_ok, BLOCK_N, IS_BF16, F32)
                wg += 16
                wu += 16
                sg += 8
                su += 8
                x_ptrs += 128
            acc_g = _nvfp4_unshift(acc_g, g_ptr + e * 2, IS_BF16)
            acc_u = _nvfp4_unshift(acc_u, g_ptr + e * 2 + 1, IS_BF16)
        else:
            wg = q_ptr + e * stride_qe + n[:, None] * stride_qn + tl.arange(0, 128)[None, :]
            wu = wg + I * stride_qn
            sg = s_ptr + e * stride_se + (n0 // 128) * stride_sn        # the program's block row of scales
            su = sg + (I // 128) * stride_sn
            for t in range(0, K_TILES):
                x = tl.load(x_ptrs, mask=r_ok[:, None], other=0.0)
                acc_g = _fp8_tile_dot(acc_g, x, wg, tl.load(sg + t), n_ok, F32)
                acc_u = _fp8_tile_dot(acc_u, x, wu, tl.load(su + t), n_ok, F32)
                wg += 128
                wu += 128
                x_ptrs += 128
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(act_ptr + pos[:, None] * I + n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, q_ptr, s_ptr, g_ptr, y_ptr, pair_row_ptr, pair_dst_ptr, pair_w_ptr, slot_first_ptr,
                 slot_count_ptr, slot_expert_ptr, H, I, stride_qe, stride_qn, stride_se, stride_sn,
                 K_TILES: tl.constexpr, BLOCK_N: tl.constexpr, NVFP4: tl.constexpr, IS_BF16: tl.constexpr,
                 F32: tl.constexpr):
    s_id = tl.program_id(0)
    rb = tl.program_id(1)
    if rb * 16 < tl.load(slot_count_ptr + s_id):
        r_ok, pos, rows, e = _slot_rows(pair_row_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, s_id, rb)
        n0 = tl.program_id(2) * BLOCK_N
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < H
        a_ptrs = act_ptr + pos[:, None] * I + tl.arange(0, 128)[None, :]
        acc = tl.zeros([16, BLOCK_N], tl.float32)
        if NVFP4:
            w_ptrs, s_ptrs = _nvfp4_tile_ptrs(q_ptr, s_ptr, e, n, stride_qe, stride_qn, stride_se, stride_sn)
            for _ in range(0, K_TILES):
                a = _pair_order_x(a_ptrs, r_ok[:, None], 16, 128)
                acc = _nvfp4_tile_dot(acc, a, w_ptrs, s_ptrs, n_ok, BLOCK_N, IS_BF16, F32)
                w_ptrs += 16
                s_ptrs += 8
                a_ptrs += 128
            acc = _nvfp4_unshift(acc, g_ptr + e, IS_BF16)
        else:
            w_ptrs = q_ptr + e * stride_qe + n[:, None] * stride_qn + tl.arange(0, 128)[None, :]
            s_row = s_ptr + e * stride_se + (n0 // 128) * stride_sn
            for t in range(0, K_TILES):
                a = tl.load(a_ptrs, mask=r_ok[:, None], other=0.0)
                acc = _fp8_tile_dot(acc, a, w_ptrs, tl.load(s_row + t), n_ok, F32)
                w_ptrs += 128
                a_ptrs += 128
        w = tl.load(pair_w_ptr + pos, mask=r_ok, other=0.0)
        dst = tl.load(pair_dst_ptr + pos, mask=r_ok, other=0)
        tl.store(y_ptr + dst[:, None].to(tl.int64) * H + n[None, :], acc * w[:, None],
                 mask=r_ok[:, None] & n_ok[None, :])


def _operands(stack: StackedPacked) -> tuple[tuple, tuple, bool]:
    """(gate+up operands, down operands, is NVFP4): each ``(codes, scales, global scales)`` as the kernels read
    them (NVFP4 codes as int32 words of 8; fp8 has no global scale: the codes stand in, never read)."""
    if isinstance(stack, StackedNVFP4):
        return ((stack.q13.view(torch.int32), stack.s13, stack.g13), (stack.q2.view(torch.int32), stack.s2, stack.g2),
                True)
    if isinstance(stack, StackedFP8Block):
        return (stack.q13, stack.s13, stack.q13), (stack.q2, stack.s2, stack.q2), False
    raise ValueError(f"packed expert product: {type(stack).__name__} is not an NVFP4 or block-FP8 expert stack")


def check_packed_input(x: torch.Tensor, stack: StackedPacked) -> None:
    """The rows, hidden size and dtype the packed expert kernels take; a named error otherwise."""
    T, H = x.shape
    if T > MAX_ROWS or H != stack.hidden or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{stack.format} expert product: x {tuple(x.shape)} {x.dtype} must be 1-{MAX_ROWS} rows "
                         f"of hidden {stack.hidden} in bf16, fp16 or fp32")


def stacked_packed_expert_product_triton(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                                         stack: StackedPacked, shared_weight: torch.Tensor | None = None,
                                         log: tuple[torch.Tensor, torch.Tensor] | None = None,
                                         path: str = "auto") -> torch.Tensor:
    """``x [T, H]`` (T <= 64; bf16, fp16 or fp32), routing ``weights``/``experts [T, k]``, the shared expert's
    gate ``[T, 1]`` when stacked -> ``[T, H]`` in x's dtype (see the module doc). ``path``: see
    :func:`grouped_packed_product`."""
    check_packed_input(x, stack)
    _operands(stack)            # an unknown stack type is named before any launch
    grp = group_pairs(experts, weights, stack, shared_weight, log)
    return grouped_packed_product(x.contiguous(), grp, stack, experts.shape[1] + int(stack.shared), path)


def stacked_packed_moe_triton(x: torch.Tensor, logits: torch.Tensor, k: int, normalise: bool, stack: StackedPacked,
                              log: tuple[torch.Tensor, torch.Tensor] | None = None,
                              path: str = "auto") -> torch.Tensor:
    """The MoE block after its router GEMM (``logits [T, E (+1)]``, the shared gate logit last when stacked):
    routed and grouped in one launch (``edgespec.kernels.moe.triton_moe_route.route_group_pairs``), then the packed
    product (:func:`grouped_packed_product`)."""
    from edgespec.kernels.moe.triton_moe_route import route_group_pairs
    check_packed_input(x, stack)
    if logits.shape[0] != x.shape[0]:
        raise ValueError(f"fused routing: {logits.shape[0]} logit rows for {x.shape[0]} rows of x")
    _, _, _, grp = route_group_pairs(logits, k, normalise, stack, log)
    return grouped_packed_product(x.contiguous(), grp, stack, k + int(stack.shared), path)


def grouped_packed_product(x: torch.Tensor, grp: dict[str, torch.Tensor], stack: StackedPacked, k1: int,
                           path: str = "auto") -> torch.Tensor:
    """The expert product of rows already grouped (``group_pairs`` or the fused routing launch), ``k1`` slots a
    row. ``path``: ``"gemv"`` the CUDA-core path (``edgespec.kernels.moe.triton_moe_gemv_packed``, up to its
    ``max_rows``), ``"mma"`` the 16-row tensor-core tiles of this module, ``"auto"`` the first for up to
    ``PACKED_GEMV_TUNING["max_rows"]`` rows, else the second."""
    if path not in ("auto", "gemv", "mma"):
        raise ValueError(f"{stack.format} expert product: path {path!r} is not one of auto, gemv, mma")
    if path == "gemv" or path == "auto" and x.shape[0] <= PACKED_GEMV_TUNING["max_rows"]:
        return packed_expert_gemv(x, grp, stack, k1)
    return _mma_product(x, grp, stack, k1)


def _mma_product(x: torch.Tensor, grp: dict[str, torch.Tensor], stack: StackedPacked, k1: int) -> torch.Tensor:
    """The tensor-core path: gate+up, then down into per-pair fp32 rows, then the slots summed."""
    T, H = x.shape
    (q13, s13, g13), (q2, s2, g2), nvfp4 = _operands(stack)
    I = stack.width
    P = T * k1
    rb = triton.cdiv(T, ROW_BLOCK)
    touched = min(P, stack.experts)
    sms = sm_count(x.device)
    common = dict(NVFP4=nvfp4, IS_BF16=x.dtype == torch.bfloat16, F32=x.dtype == torch.float32,
                  num_warps=TUNING["num_warps"], num_stages=TUNING["num_stages"])
    # a program's rows must lie in one 128-row scale block (fp8) and one tile's rows: at most 128
    act = torch.empty((P, I), dtype=x.dtype, device=x.device)
    bn = min(128, _block_n(TUNING["up_block_n"], touched, rb, I, sms))
    _up_kernel[(P, rb, triton.cdiv(I, bn))](
        x, q13, s13, g13, act, grp["pair_row"], grp["slot_first"], grp["slot_count"], grp["slot_expert"], I,
        x.stride(0), q13.stride(0), q13.stride(1), s13.stride(0), s13.stride(1), K_TILES=H // TILE, BLOCK_N=bn,
        **common)
    y = torch.empty((P, H), dtype=torch.float32, device=x.device)
    bn = min(128, _block_n(TUNING["down_block_n"], touched, rb, H, sms))
    _down_kernel[(P, rb, triton.cdiv(H, bn))](
        act, q2, s2, g2, y, grp["pair_row"], grp["pair_dst"], grp["pair_w"], grp["slot_first"], grp["slot_count"],
        grp["slot_expert"], H, I, q2.stride(0), q2.stride(1), s2.stride(0), s2.stride(1), K_TILES=I // TILE,
        BLOCK_N=bn, **common)
    return y.view(T, k1, H).sum(dim=1).to(x.dtype)
