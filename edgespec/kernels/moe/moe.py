"""Mixture-of-experts routing and the grouped expert product (torch reference).

A verify of T rows routes each row to k experts. Looping over rows would read an expert's weights once per row
that picked it; grouping the rows by expert reads every touched expert exactly once per forward, so the bytes a
forward moves are set by the *union* of the experts its rows touched (a 16-row verify of a 256-expert layer with
k=8 touches at most 128, typically far fewer on trained routers). :func:`group_by_expert` is that grouping as a
pure function; :func:`grouped_expert_product` runs each touched expert once on its rows and scatters the weighted
outputs back. The expert is any callable ``[rows, H] -> [rows, H]`` (a dense or packed SwiGLU MLP), so every weight
format the dense layers load works here too.

The grouping needs the routing on the host (which experts, how many rows each): one small device-to-host copy per
layer. Experts stacked per layer (dense weights) take :func:`stacked_expert_product` instead, whose Triton kernel
(``edgespec.kernels.moe.triton_moe``) keeps the ids on the device; :func:`stacked_expert_product_ref` is its contract.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from edgespec.kernels import use_triton
from edgespec.kernels.pointwise.activation import silu_mul_ref


def route(logits: torch.Tensor, k: int, normalise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: ``logits [T, E]`` -> ``(weights [T, k] in logits' dtype, experts [T, k] int64)``.

    Softmax in float32 over all experts, the k largest kept (descending), renormalised to sum to one over the
    chosen k when ``normalise`` (Qwen3.5 MoE always does), then cast back, as the reference model rounds it.
    Ties go to the lower expert id (a stable sort: ``torch.topk``, which the reference model calls, leaves the
    order of ties unspecified, and its CUDA kernel can return the higher id first); without ties the choice is
    ``torch.topk``'s. The fused routing launch (``edgespec.kernels.moe.triton_moe_route``) follows the same rule.

    >>> w, e = route(torch.tensor([[0.0, 2.0, 1.0]]), k=2)
    >>> e.tolist(), round(w.sum().item(), 6)
    ([[1, 2]], 1.0)
    """
    if not 0 < k <= logits.shape[-1]:
        raise ValueError(f"top-k of {k} experts out of {logits.shape[-1]}")
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, experts = top[..., :k], experts[..., :k].contiguous()
    if normalise:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), experts


@dataclass
class ExpertGroups:
    """Rows of one forward grouped by the expert they were routed to (host lists: the loop that follows is
    host-driven). ``rows[i]`` / ``slots[i]``: the row ids and top-k slot of each (row, expert) pair of expert
    ``experts[i]``, rows ascending."""

    experts: list[int]               # touched experts, ascending
    rows: list[torch.Tensor]         # [n_i] int64 row ids per touched expert
    slots: list[torch.Tensor]        # [n_i] int64 top-k slot of each of those rows

    @property
    def union(self) -> int:
        """Distinct experts this forward reads."""
        return len(self.experts)


def group_by_expert(experts: torch.Tensor) -> ExpertGroups:
    """Group ``experts [T, k]`` (the routed expert ids) by expert.

    >>> g = group_by_expert(torch.tensor([[3, 1], [1, 0]]))
    >>> g.experts, [r.tolist() for r in g.rows], [s.tolist() for s in g.slots]
    ([0, 1, 3], [[1], [0, 1], [0]], [[1], [1, 0], [0]])
    """
    T, k = experts.shape
    flat = experts.reshape(-1)
    # A stable sort keeps each expert's pairs in row order: the scatter then adds in the reference model's order.
    order = torch.argsort(flat, stable=True)
    ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
    sizes = counts.tolist()
    rows = (order // k).split(sizes)
    slots = (order % k).split(sizes)
    return ExpertGroups(ids.tolist(), list(rows), list(slots))


def grouped_expert_product(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                           expert_fns: Sequence[Callable[[torch.Tensor], torch.Tensor]],
                           groups: ExpertGroups | None = None) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_fns[experts[t, j]](x[t])`` for every row ``t`` of ``x [T, H]``.

    Each touched expert runs once on all its rows (its weights are read once per forward, whatever T is); the
    weighted outputs are added into the result per expert, ascending. ``groups``: the grouping of ``experts`` when
    the caller already has it (telemetry reads the union from it).
    """
    groups = groups or group_by_expert(experts)
    out = torch.zeros_like(x)
    for e, rows, slots in zip(groups.experts, groups.rows, groups.slots, strict=True):
        y = expert_fns[e](x.index_select(0, rows))
        out.index_add_(0, rows, y * weights[rows, slots, None])
    return out


def moe_ref(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
            expert_fns: Sequence[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
    """Row-by-row oracle of :func:`grouped_expert_product` (reads an expert once per row that picked it)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            out[t] += weights[t, j] * expert_fns[int(experts[t, j])](x[t:t + 1])[0]
    return out


def stacked_expert_product_ref(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor,
                               w2: torch.Tensor) -> torch.Tensor:
    """The routed sum over experts stacked per layer, ``w13 [E, 2I, H]`` (gate rows then up rows) and
    ``w2 [E, H, I]``: each (row, slot) pair's expert gathered and applied (torch reference of the Triton kernel;
    it reads an expert once per pair), products in fp32, the k slots summed, result in x's dtype."""
    T, k = experts.shape
    flat = experts.reshape(-1)
    xs = x.float().repeat_interleave(k, dim=0)                               # [T*k, H]
    gate_up = torch.bmm(w13[flat].float(), xs[:, :, None])[..., 0]          # [T*k, 2I]
    act = silu_mul_ref(gate_up).to(x.dtype).float()                         # rounded like the kernel's store
    y = torch.bmm(w2[flat].float(), act[:, :, None])[..., 0] * weights.reshape(-1, 1).float()
    return y.view(T, k, -1).sum(dim=1).to(x.dtype)


def stacked_expert_product(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor,
                           w2: torch.Tensor) -> torch.Tensor:
    """:func:`stacked_expert_product_ref`'s result; the Triton kernel on CUDA."""
    if use_triton(x):
        from edgespec.kernels.moe.triton_moe import stacked_expert_product_triton
        return stacked_expert_product_triton(x, weights, experts, w13, w2)
    return stacked_expert_product_ref(x, weights, experts, w13, w2)
