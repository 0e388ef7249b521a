"""Serve a drafter's linear layers quantized (the ``drafter_weights`` setting).

A speculative cycle reads the target's weights once (the verify) and the drafter's once per draft forward, so on a
bandwidth-bound device the drafter's bytes are paid every cycle: the Qwen3.5-27B DFlash drafter is 3.3 GB in bf16,
~0.9 GB in int4. Drafts are only proposals (the target verifies every token), so quantizing the drafter can move
acceptance but never the output. Layers are quantized one at a time after loading, each dense weight dropped before
the next, so the dense drafter is never held twice; the drafter's own embedding and head (if it has them) stay
dense, as does a layer whose shape the format refuses.
"""

from __future__ import annotations

import torch
from torch import nn

from edgespec.errors import ConfigError
from edgespec.models.layers import Linear
from edgespec.weights.base import PackedLinear, PackedWeight
from edgespec.weights.fp8_block import FP8BlockWeight
from edgespec.weights.int4 import Int4Weight
from edgespec.weights.nvfp4 import NVFP4Weight

DRAFTER_WEIGHTS = ("model", "fp8", "int4", "nvfp4")
INT4_GROUPS = (128, 64, 32)     # the largest that divides the layer's inputs (the products take 32..256)
KEEP_DENSE = ("lm_head", "embed_tokens")


def quantize_weight(fmt: str, w: torch.Tensor, compute_dtype: torch.dtype) -> PackedWeight | None:
    """``w [out, in]`` in ``fmt`` (fp8: 128x128 blocks, int4: group 128 (64, 32 for narrow layers), nvfp4:
    16-blocks), or None when the format cannot hold this shape (int4: ``in`` a multiple of 32; nvfp4: of 16)."""
    in_f = w.shape[1]
    if fmt == "fp8":
        return FP8BlockWeight.quantize(w, compute_dtype=compute_dtype)
    if fmt == "int4":
        group = next((g for g in INT4_GROUPS if in_f % g == 0), None)
        return Int4Weight.quantize(w, group, compute_dtype) if group else None
    if fmt == "nvfp4":
        return NVFP4Weight.quantize(w, compute_dtype) if in_f % 16 == 0 else None
    raise ConfigError(f"drafter_weights {fmt!r}: choose one of {', '.join(DRAFTER_WEIGHTS)}")


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


__all__ = ["DRAFTER_WEIGHTS", "quantize_linears", "quantize_weight"]
