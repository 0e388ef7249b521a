"""Router logits to grouped expert pairs in one Triton launch, then the int4 expert product: the MoE block of a
decode step as a handful of launches (router GEMM, this, and the product's three or four).

``_route_group_kernel`` (one program) takes the router logits ``[T, E]`` (plus, when the shared expert is
stacked, its gate logit as column E: the router and the shared gate are one GEMM), and for each row:

* softmax over the E experts in fp32 (max subtracted, as ``torch.softmax``);
* the k largest, chosen on the logits (softmax is monotone, and the logits are exact where the probabilities
  are rounded), ties to the lower expert id: the rule of :func:`edgespec.kernels.moe.moe.route`, whose stable sort is
  the reference (``torch.topk`` leaves the order of ties unspecified and differs between CPU and CUDA);
* the chosen probabilities, renormalised over the k when the config says so, rounded to the logits' dtype;
* ``sigmoid`` of the shared gate logit, rounded the same way;

writes ``experts``/``weights [T, k]`` and the shared gate ``[T]``, then runs the grouping of
``edgespec.kernels.moe.triton_moe_int4`` (``_group_body``) on them in the same program. No host round trip, so a
captured graph re-routes at every replay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from edgespec.kernels.moe.stacks import ExpertStack, StackedInt4
from edgespec.kernels.moe.triton_moe_int4 import _group_body, check_product_input, group_buffers, grouped_int4_product

_ROW_BLOCK = 16     # most logits rows softmaxed at a time (16 x 256 experts: 32 fp32 a thread at 4 warps)


@triton.jit
def _route_group_kernel(logits_ptr, stride_l, experts_ptr, weights_ptr, shared_ptr, pair_row_ptr, pair_dst_ptr,
                        pair_w_ptr, slot_first_ptr, slot_count_ptr, slot_expert_ptr, log_sums_ptr, log_calls_ptr,
                        T, E, ROW_BLOCKS: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                        K1: tl.constexpr, E_PAD: tl.constexpr, RB: tl.constexpr, P_PAD: tl.constexpr,
                        BINS: tl.constexpr, SHARED: tl.constexpr, NORMALISE: tl.constexpr, LOG: tl.constexpr):
    c = tl.arange(0, E_PAD)
    kk = tl.arange(0, K_PAD)
    for b in tl.static_range(ROW_BLOCKS):
        t = b * RB + tl.arange(0, RB)
        t_ok = t < T
        ok = t_ok[:, None] & (c < E)[None, :]
        logit = tl.load(logits_ptr + t[:, None] * stride_l + c[None, :], mask=ok, other=float("-inf"))
        logit = logit.to(tl.float32)
        top = tl.max(logit, 1)
        top = tl.where(t_ok, top, 0.0)
        ex = tl.where(ok, libdevice.exp(logit - top[:, None]), 0.0)
        denom = tl.sum(ex, 1)
        denom = tl.where(t_ok, denom, 1.0)
        probs = tl.zeros([RB, K_PAD], tl.float32)
        ids = tl.zeros([RB, K_PAD], tl.int32)
        cur = tl.where(ok, logit, float("-inf"))
        for j in tl.static_range(K):
            best = tl.max(cur, 1)
            idx = tl.min(tl.where(cur == best[:, None], c[None, :], E_PAD), 1)     # ties: the lower id
            pick = c[None, :] == idx[:, None]
            p = tl.sum(tl.where(pick, ex, 0.0), 1) / denom
            probs = tl.where(kk[None, :] == j, p[:, None], probs)
            ids = tl.where(kk[None, :] == j, idx[:, None], ids)
            cur = tl.where(pick, float("-inf"), cur)
        if NORMALISE:
            probs = probs / tl.sum(probs, 1)[:, None]
        out_ok = t_ok[:, None] & (kk < K)[None, :]
        tl.store(experts_ptr + t[:, None] * K + kk[None, :], ids, mask=out_ok)
        tl.store(weights_ptr + t[:, None] * K + kk[None, :], probs.to(weights_ptr.dtype.element_ty), mask=out_ok)
        if SHARED:
            s_logit = tl.load(logits_ptr + t * stride_l + E, mask=t_ok, other=0.0).to(tl.float32)
            gate = 1.0 / (1.0 + libdevice.exp(-s_logit))
            tl.store(shared_ptr + t, gate.to(shared_ptr.dtype.element_ty), mask=t_ok)
    tl.debug_barrier()      # the grouping below reads what every thread of this program stored
    _group_body(experts_ptr, weights_ptr, shared_ptr, pair_row_ptr, pair_dst_ptr, pair_w_ptr, slot_first_ptr,
                slot_count_ptr, slot_expert_ptr, log_sums_ptr, log_calls_ptr, T, E, K, K1, P_PAD, BINS, SHARED, LOG)


def route_group_pairs(logits: torch.Tensor, k: int, normalise: bool, stack: ExpertStack,
                      log: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """``logits [T, E (+1)]`` (the shared gate logit last when the stack holds the shared expert) ->
    (``weights [T, k]`` in logits' dtype, ``experts [T, k]`` int32, the shared gate ``[T, 1]`` or None, the
    grouping dict of ``edgespec.kernels.moe.triton_moe_int4.group_pairs``), in one launch. ``log``: a routing log's
    ``(sums, calls)``, to which the launch adds the routed union."""
    T = logits.shape[0]
    E = stack.experts - int(stack.shared)
    if logits.dim() != 2 or logits.shape[1] != E + int(stack.shared) or logits.stride(1) != 1:
        raise ValueError(f"fused routing: logits {tuple(logits.shape)} must be [T, {E + int(stack.shared)}] "
                         f"({E} experts{' + the shared gate logit' if stack.shared else ''}), rows contiguous")
    if not 0 < k <= E:
        raise ValueError(f"fused routing: top-k of {k} experts out of {E}")
    k1 = k + int(stack.shared)
    P = T * k1
    dev = logits.device
    grp = group_buffers(P, dev)
    experts = torch.empty((T, k), dtype=torch.int32, device=dev)
    weights = torch.empty((T, k), dtype=logits.dtype, device=dev)
    shared = torch.empty((T, 1), dtype=logits.dtype, device=dev)
    sums, calls = log if log is not None else (grp["pair_w"], grp["pair_w"])
    rb = min(_ROW_BLOCK, triton.next_power_of_2(T))      # a decode row softmaxes one row, not 16
    _route_group_kernel[(1,)](
        logits, logits.stride(0), experts, weights, shared, grp["pair_row"], grp["pair_dst"], grp["pair_w"],
        grp["slot_first"], grp["slot_count"], grp["slot_expert"], sums, calls, T, E,
        ROW_BLOCKS=triton.cdiv(T, rb), K=k, K_PAD=triton.next_power_of_2(k), K1=k1,
        E_PAD=triton.next_power_of_2(E), RB=rb,
        P_PAD=max(16, triton.next_power_of_2(P)), BINS=triton.next_power_of_2(stack.experts + 1),
        SHARED=stack.shared, NORMALISE=normalise, LOG=log is not None and T < sums.shape[0], num_warps=4)
    return weights, experts, shared if stack.shared else None, grp


def stacked_int4_moe_triton(x: torch.Tensor, logits: torch.Tensor, k: int, normalise: bool, stack: StackedInt4,
                            log: tuple[torch.Tensor, torch.Tensor] | None = None,
                            path: str = "auto") -> torch.Tensor:
    """The MoE block after its router GEMM: ``x [T, H]`` and ``logits [T, E (+1)]`` -> the routed experts'
    weighted sum plus the gated shared expert (when stacked), ``[T, H]`` in x's dtype. ``path``: see
    ``edgespec.kernels.moe.triton_moe_int4.grouped_int4_product``."""
    check_product_input(x, stack)
    if logits.shape[0] != x.shape[0]:
        raise ValueError(f"fused routing: {logits.shape[0]} logit rows for {x.shape[0]} rows of x")
    _, _, _, grp = route_group_pairs(logits, k, normalise, stack, log)
    return grouped_int4_product(x.contiguous(), grp, stack, k + int(stack.shared), path)
