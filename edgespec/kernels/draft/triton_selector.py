"""The DFlash2 selector's greedy walk in one Triton program (contract: :mod:`edgespec.kernels.draft.selector`).

One program loops over the ``D`` positions: it adds the predecessor's row of the bilinear terms to the unary
logits, stores the ``K`` scores, takes the first maximum and carries its index to the next position. ``K`` (16 in
the published drafters) fits one vector, so each step is a couple of loads and a reduction in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _selector_walk_kernel(unary_ptr, trans_ptr, choice_ptr, score_ptr, D, K,
                          stride_u, stride_td, stride_tp, stride_s, BLOCK_K: tl.constexpr):
    k = tl.arange(0, BLOCK_K)
    ok = k < K
    prev = tl.program_id(0) * 0                       # the anchor's row (all rows of position 0 are the same)
    for d in range(D):
        u = tl.load(unary_ptr + d * stride_u + k, mask=ok, other=float("-inf")).to(tl.float32)
        t = tl.load(trans_ptr + d * stride_td + prev * stride_tp + k, mask=ok, other=0.0)
        s = u + t
        tl.store(score_ptr + d * stride_s + k, s, mask=ok)
        prev = tl.argmax(s, 0, tie_break_left=True).to(tl.int32)
        tl.store(choice_ptr + d, prev.to(tl.int64))


def selector_walk_triton(unary: torch.Tensor, transitions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One program; shapes checked by :func:`edgespec.kernels.draft.selector.selector_walk`."""
    D, K = unary.shape
    if unary.stride(-1) != 1:
        unary = unary.contiguous()
    if transitions.stride(-1) != 1 or transitions.dtype != torch.float32:
        transitions = transitions.float().contiguous()
    choice = torch.empty(D, dtype=torch.int64, device=unary.device)
    scores = torch.empty(D, K, dtype=torch.float32, device=unary.device)
    _selector_walk_kernel[(1,)](unary, transitions, choice, scores, D, K, unary.stride(0), transitions.stride(0),
                                transitions.stride(1), scores.stride(0), BLOCK_K=triton.next_power_of_2(K))
    return choice, scores


__all__ = ["selector_walk_triton"]
