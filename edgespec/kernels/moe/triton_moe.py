"""Routed-expert products in Triton for 1-64 rows, over experts stacked per layer, with no host round trip.

Layout (``edgespec.models.moe.SparseMoE.stack_experts``): ``w13 [E, 2I, H]`` (each expert's gate rows then its up
rows, the merged ``gate_up_proj``) and ``w2 [E, H, I]``. A forward of T rows routed to k experts each has T*k
(row, expert) pairs. The pairs are sorted by expert on the device, and two kernels run over (pair, output block):

* up: ``act[p] = silu(x[row] . gate_e) * (x[row] . up_e)`` for ``BLOCK_N`` columns of the expert's width;
* down: ``y[p] = weight[p] * (act[p] . down_e)`` for ``BLOCK_N`` hidden columns, in fp32;

then the k pair outputs of each row are summed. Programs of the same output block and neighbouring pairs run
together, so the pairs of one expert read its tile from DRAM once and from L2 after that: a forward's DRAM bytes
are about those of the experts its rows touched. Nothing depends on host values (the expert ids stay on the
device), so the launch is CUDA-graph capturable. Contract: :func:`edgespec.kernels.moe.moe.stacked_expert_product_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels import sm_count


@triton.jit
def _up_kernel(x_ptr, w_ptr, rows_ptr, ids_ptr, act_ptr, I, H, stride_we, stride_wn,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    row = tl.load(rows_ptr + p)
    e = tl.load(ids_ptr + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    w_gate = w_ptr + e * stride_we + n[:, None] * stride_wn
    w_up = w_gate + I * stride_wn
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for i in range(0, tl.cdiv(H, BLOCK_K)):
        k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < H
        x = tl.load(x_ptr + row * H + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        m = n_ok[:, None] & k_ok[None, :]
        acc_g += tl.load(w_gate + k[None, :], mask=m, other=0.0).to(tl.float32) * x
        acc_u += tl.load(w_up + k[None, :], mask=m, other=0.0).to(tl.float32) * x
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + p * I + n, act.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_kernel(act_ptr, w_ptr, ids_ptr, scale_ptr, y_ptr, H, I, stride_we, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for i in range(0, tl.cdiv(I, BLOCK_K)):
        k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < I
        a = tl.load(act_ptr + p * I + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        w = tl.load(w_ptr + e * stride_we + n[:, None] * stride_wn + k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * a
    y = tl.sum(acc, axis=1) * tl.load(scale_ptr + p).to(tl.float32)
    tl.store(y_ptr + p * H + n, y, mask=n_ok)


def _block_n(pairs: int, n: int, sms: int) -> int:
    """Output columns per program: 16, halved down to 2 until the launch has ~4 programs per SM (a one-row
    decode has only k pairs: with 16 columns its 8 x 32 programs left the chip latency bound; docs/benchmarks.md,
    "Design figures")."""
    bn = 16
    while bn > 2 and pairs * triton.cdiv(n, bn) < 4 * sms:
        bn //= 2
    return bn


def stacked_expert_product_triton(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                                  w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``x [T, H]``, routing ``weights``/``experts [T, k]``, stacked ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` ->
    ``[T, H]`` in x's dtype (see the module doc)."""
    T, H = x.shape
    k = experts.shape[1]
    E, I2, H1 = w13.shape
    I = I2 // 2
    if H1 != H or tuple(w2.shape) != (E, H, I) or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError(f"stacked experts: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x "
                         f"{tuple(x.shape)} as [E, 2I, H] and [E, H, I] with contiguous rows")
    x = x.contiguous()
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)           # pairs of one expert adjacent: its tiles come from L2
    ids = flat[order]
    rows = (order // k).to(torch.int32)
    scale = weights.reshape(-1)[order].contiguous()
    P = T * k
    act = torch.empty((P, I), dtype=x.dtype, device=x.device)
    sms = sm_count(x.device)
    bn_up, bk_up = _block_n(P, I, sms), min(256, triton.next_power_of_2(H))
    _up_kernel[(P, triton.cdiv(I, bn_up))](x, w13, rows, ids, act, I, H, w13.stride(0), w13.stride(1),
                                          BLOCK_N=bn_up, BLOCK_K=bk_up, num_warps=4, num_stages=3)
    y = torch.empty((P, H), dtype=torch.float32, device=x.device)
    bn_dn, bk_dn = _block_n(P, H, sms), min(256, triton.next_power_of_2(I))
    _down_kernel[(P, triton.cdiv(H, bn_dn))](act, w2, ids, scale, y, H, I, w2.stride(0), w2.stride(1),
                                            BLOCK_N=bn_dn, BLOCK_K=bk_dn, num_warps=4, num_stages=2)
    # Back to (row, slot) order and a plain sum over the k slots: deterministic (no atomics), so a row rounds the
    # same whatever else the forward routed.
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return unsorted.view(T, k, H).sum(dim=1).to(x.dtype)
