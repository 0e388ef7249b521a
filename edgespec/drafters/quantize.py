"""Serve a drafter's linear layers quantized (the ``drafter_weights`` setting).

A speculative cycle reads the target's weights once (the verify) and the drafter's once per draft forward, so on a
bandwidth-bound device the drafter's bytes are paid every cycle: the Qwen3.5-27B DFlash drafter is 3.3 GB in bf16,
~0.9 GB in int4. Drafts are only proposals (the target verifies every token), so quantizing the drafter can move
acceptance but never the output. Layers are quantized one at a time after loading, each dense weight dropped before
the next, so the dense drafter is never held twice; the drafter's own embedding and head (if it has them) stay
dense, as does a layer whose shape the format refuses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from edgespec.models.layers import Linear, merge_all_projections
from edgespec.weights.base import PackedLinear
from edgespec.weights.requantize import PACKED_CHOICES, quantize_weight

DRAFTER_WEIGHTS = ("model", *PACKED_CHOICES)
KEEP_DENSE = ("lm_head", "embed_tokens")


def quantize_linears(root: nn.Module, fmt: str, compute_dtype: torch.dtype) -> int:
    """Replace every dense :class:`Linear` under ``root`` (names in ``KEEP_DENSE`` excepted) by a
    :class:`PackedLinear` in ``fmt``, in place; returns how many were packed. Merge projections first (the merged
    q/k/v and gate/up are then quantized as one matrix each)."""
    if fmt == "model":
        return 0
    packed = 0
    for name, module in list(root.named_modules()):
        leaf = name.rpartition(".")[2]
        if not isinstance(module, Linear) or leaf in KEEP_DENSE:
            continue
        with torch.no_grad():
            q = quantize_weight(fmt, module.weight.detach(), compute_dtype)
            if q is None:
                continue
            bias = module.bias.detach() if module.bias is not None else None
            parent = root.get_submodule(name.rpartition(".")[0]) if "." in name else root
            setattr(parent, leaf, PackedLinear(q, bias))
        packed += 1
    return packed


def serve_quantized(drafter: nn.Module, fmt: str, compute_dtype: torch.dtype,
                    choose_kernels: Callable[[nn.Module], int] | None = None) -> None:
    """Serve a loaded drafter's linear layers in ``fmt`` (``drafter_weights``; ``model``: nothing changes): merge
    q/k/v and gate/up first so each merged matrix is quantized whole, pack the layers, then pick each packed
    layer's product (before any graph is captured) with ``choose_kernels`` (the engine's
    ``ArchHooks.choose_weight_kernels``; None: the portable choice every arch shares)."""
    if fmt == "model":
        return
    merge_all_projections(drafter)
    quantize_linears(drafter, fmt, compute_dtype)
    if choose_kernels is None:
        from edgespec.arch.base import ArchHooks
        choose_kernels = ArchHooks().choose_weight_kernels
    choose_kernels(drafter)


__all__ = ["DRAFTER_WEIGHTS", "quantize_linears", "serve_quantized"]
