"""NVFP4 and block-FP8 experts stacked per layer and their routed product (torch reference; Triton twin in
``edgespec.kernels.moe.triton_moe_quant``), beside the int4 stacks of ``edgespec.kernels.moe.moe_quant``.

The experts' packed buffers keep the dense formats' contract layouts (``edgespec.kernels.quant.quant_ref``), one more
leading axis for the expert. Like the int4 stacks, the shared expert (same width and format) is the last expert,
and the experts' own buffers are views of the stacks (``edgespec.models.expert_stacks``), so no byte is held twice.

* :class:`StackedNVFP4`: ``q13 [E', 2I, H/2]`` uint8 (two e2m1 codes a byte, low nibble = even input),
  ``s13 [E', 2I, H/16]`` e4m3 block scales, ``g13 [E', 2]`` fp32 global scales (gate, up: ModelOpt exports one
  per matrix, and a release may give gate and up different ones), ``q2 [E', H, I/2]``, ``s2 [E', H, I/16]``,
  ``g2 [E']``.
* :class:`StackedFP8Block`: ``q13 [E', 2I, H]`` e4m3, ``s13 [E', 2I/128, H/128]`` fp32 block scales, ``q2 [E', H,
  I]``, ``s2 [E', H/128, I/128]``.

The kernels take whole 128-input tiles and 128-row scale blocks, so both formats stack only when the hidden size
and the expert width are multiples of 128 (every Qwen3.5/3.6 MoE release: 2048 x 512, and Qwen3-30B-A3B's 768);
other experts stay per expert on the host-grouped path.
"""

from __future__ import annotations

import torch

from edgespec.kernels import use_triton
from edgespec.kernels.moe.moe_quant import route_with_shared_ref, stacked_product_ref, with_shared_slot
from edgespec.kernels.moe.stacks import StackedPacked


def stacked_packed_expert_product_ref(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                                      stack: StackedPacked, shared_weight: torch.Tensor | None = None
                                      ) -> torch.Tensor:
    """``x [T, H]``, routing ``weights``/``experts [T, k]`` (and the shared expert's gate ``[T, 1]`` when stacked)
    -> ``[T, H]`` in x's dtype (``edgespec.kernels.moe.moe_quant.stacked_product_ref`` over the dequantized experts):
    the oracle of the Triton kernels."""
    weights, experts = with_shared_slot(weights, experts, stack, shared_weight)
    return stacked_product_ref(x, weights, experts, stack.hidden, stack.dequant)


def stacked_packed_expert_product(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                                  stack: StackedPacked, shared_weight: torch.Tensor | None = None,
                                  log: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """:func:`stacked_packed_expert_product_ref`'s result; the Triton kernel of ``stack.format`` on CUDA (bf16, fp16
    or fp32 x). ``log``: a routing log's ``(sums, calls)`` buffers, to which this forward's routed union is added."""
    if use_triton(x):
        from edgespec.kernels.moe.triton_moe_quant import stacked_packed_expert_product_triton
        return stacked_packed_expert_product_triton(x, weights, experts, stack, shared_weight, log)
    if log is not None and x.shape[0] < log[0].shape[0]:
        log[0][x.shape[0]] += len(torch.unique(experts))
        log[1][x.shape[0]] += 1
    return stacked_packed_expert_product_ref(x, weights, experts, stack, shared_weight)


def stacked_packed_moe(x: torch.Tensor, logits: torch.Tensor, k: int, normalise: bool, stack: StackedPacked,
                       log: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The MoE block after its router GEMM: ``logits [T, E (+1)]`` (the shared gate logit last when the stack
    holds the shared expert) routed (``edgespec.kernels.moe.moe_quant.route_with_shared_ref``) and the stacked product
    taken. On CUDA one Triton launch routes and groups (``edgespec.kernels.moe.triton_moe_route``) and the product
    follows (``edgespec.kernels.moe.triton_moe_quant.stacked_packed_moe_triton``); elsewhere the torch references.
    ``log``: as :func:`stacked_packed_expert_product`."""
    if use_triton(x):
        from edgespec.kernels.moe.triton_moe_quant import stacked_packed_moe_triton
        return stacked_packed_moe_triton(x, logits, k, normalise, stack, log)
    weights, experts, gate = route_with_shared_ref(logits, k, normalise, stack)
    return stacked_packed_expert_product(x, weights, experts, stack, gate, log)
