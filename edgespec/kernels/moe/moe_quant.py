"""int4 experts stacked per layer and their routed product (torch reference; Triton twins in
``edgespec.kernels.moe.triton_moe_int4`` (tensor cores, 16-row tiles), ``edgespec.kernels.moe.triton_moe_gemv`` (CUDA
cores, 1-4 rows) and ``edgespec.kernels.moe.triton_moe_route`` (routing fused into the grouping launch)).

A quantized expert layer holds E small SwiGLU MLPs in the int4 contract layout of ``edgespec.kernels.quant.quant_ref``
(``qweight`` uint8 ``[out, in/2]``, fp16 ``scales`` and uint8 ``zeros`` ``[out, in/g]``). Stacked per layer
(:class:`StackedInt4`), a forward can read the experts its rows touched from one set of tensors, with the expert
ids on the device: no host round trip, so the product is captured in a CUDA graph whatever the routing is.

The shared expert of Qwen3.5 MoE, when it has the routed experts' width and format, is stacked as expert E: every
row is then routed to it as one more slot whose weight is ``sigmoid(shared_expert_gate(x))``, and the shared MLP
runs in the same launches as the routed ones (its weights read once per forward, like any touched expert).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from edgespec.kernels import use_triton
from edgespec.kernels.moe.moe import route
from edgespec.kernels.moe.stacks import ExpertStack, StackedInt4
from edgespec.kernels.pointwise.activation import silu_mul_ref
from edgespec.kernels.quant.quant_ref import dequant_int4


def with_shared_slot(weights: torch.Tensor, experts: torch.Tensor, stack: ExpertStack,
                     shared_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing with the shared expert as one more slot per row (expert E' - 1, weight ``shared_weight [T, 1]``)
    when the stack holds it; as given otherwise."""
    if not stack.shared:
        return weights, experts
    if shared_weight is None:
        raise ValueError("stacked experts hold the shared expert: its gate weight [T, 1] is needed")
    shared_ids = torch.full_like(experts[:, :1], stack.experts - 1)
    return torch.cat([weights, shared_weight.to(weights.dtype)], 1), torch.cat([experts, shared_ids], 1)


def stacked_product_ref(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, hidden: int,
                        dequant: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``x [T, H]``, routing ``weights``/``experts [T, k]`` (the shared expert already a slot, see
    :func:`with_shared_slot`) -> ``[T, H]`` in x's dtype: per (row, slot) pair, ``w * down(silu(gate x) * up x)``
    with expert ``e``'s ``(w13 [2I, H], w2 [H, I])`` from ``dequant(e)`` in fp32, the SwiGLU rounded to x's dtype
    (as the kernels store it), the slots summed in fp32 in slot order. Each touched expert is dequantized once: the
    oracle of every stacked format's Triton kernel."""
    T, k = experts.shape
    xf = x.float()
    y = torch.zeros(T, k, hidden, dtype=torch.float32, device=x.device)
    for e in torch.unique(experts).tolist():
        w13, w2 = dequant(e)
        for t, j in (experts == e).nonzero().tolist():
            act = silu_mul_ref(xf[t:t + 1] @ w13.t()).to(x.dtype).float()
            y[t, j] = (act @ w2.t())[0] * weights[t, j].float()
    return y.sum(dim=1).to(x.dtype)


def stacked_int4_expert_product_ref(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                                    stack: StackedInt4, shared_weight: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`stacked_product_ref` over int4 experts (and the shared expert's gate ``[T, 1]`` when stacked): the
    oracle of the Triton kernel."""
    weights, experts = with_shared_slot(weights, experts, stack, shared_weight)
    g = stack.group_size

    def dequant(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (dequant_int4(stack.q13[e], stack.s13[e], stack.z13[e], g, torch.float32),
                dequant_int4(stack.q2[e], stack.s2[e], stack.z2[e], g, torch.float32))
    return stacked_product_ref(x, weights, experts, stack.hidden, dequant)


def stacked_int4_expert_product(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, stack: StackedInt4,
                                shared_weight: torch.Tensor | None = None,
                                log: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """:func:`stacked_int4_expert_product_ref`'s result; the Triton kernel on CUDA (bf16, fp16 or fp32 x).
    ``log``: a routing log's ``(sums, calls)`` buffers, to which the kernel adds this forward's routed union."""
    if use_triton(x):
        from edgespec.kernels.moe.triton_moe_int4 import stacked_int4_expert_product_triton
        return stacked_int4_expert_product_triton(x, weights, experts, stack, shared_weight, log)
    if log is not None and x.shape[0] < log[0].shape[0]:
        routed = experts.shape[1]
        log[0][x.shape[0]] += len(torch.unique(experts[:, :routed]))
        log[1][x.shape[0]] += 1
    return stacked_int4_expert_product_ref(x, weights, experts, stack, shared_weight)


def route_with_shared_ref(logits: torch.Tensor, k: int, normalise: bool, stack: ExpertStack
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``logits [T, E (+1)]`` -> (weights, experts ``[T, k]``, the shared gate ``[T, 1]`` or None): the routed
    experts' columns through :func:`edgespec.kernels.moe.moe.route`, the shared gate logit (last column, when the
    stack holds the shared expert) through a sigmoid. The oracle of the fused routing launch."""
    E = stack.experts - int(stack.shared)
    if logits.dim() != 2 or logits.shape[1] != E + int(stack.shared):
        raise ValueError(f"fused routing: logits {tuple(logits.shape)} must be [T, {E + int(stack.shared)}] "
                         f"({E} experts{' + the shared gate logit' if stack.shared else ''})")
    weights, experts = route(logits[:, :E], k, normalise)
    return weights, experts, torch.sigmoid(logits[:, E:]) if stack.shared else None


def stacked_int4_moe(x: torch.Tensor, logits: torch.Tensor, k: int, normalise: bool, stack: StackedInt4,
                     log: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The MoE block after its router GEMM: ``logits [T, E (+1)]`` routed (:func:`route_with_shared_ref`) and the
    stacked product taken. On CUDA one Triton launch routes and groups (``edgespec.kernels.moe.triton_moe_route``) and
    the product follows; elsewhere the torch references. ``log``: as :func:`stacked_int4_expert_product`."""
    if use_triton(x):
        from edgespec.kernels.moe.triton_moe_route import stacked_int4_moe_triton
        return stacked_int4_moe_triton(x, logits, k, normalise, stack, log)
    weights, experts, gate = route_with_shared_ref(logits, k, normalise, stack)
    return stacked_int4_expert_product(x, weights, experts, stack, gate, log)
