"""A loaded MoE layer's NVFP4 or block-FP8 experts stacked per layer (``edgespec.kernels.moe.moe_packed``) as views.

The stacked Triton products read every expert of a layer from one set of tensors indexed on the device. Stacking
copies each expert's buffers into the layer's stacks once and then points the expert's buffers at its rows of
them, so the weights are held once (one layer's extra copy while stacking) and the per-expert modules, their
``state_dict`` and the host-grouped reference path keep working on the same bytes.

Gate and up are stacked as one ``[2I, H]`` matrix per expert whether the loader merged them (``gate_up_proj``) or
not (NVFP4 gate and up under different global scales do not merge; their scales then stay two columns of ``g13``).
The shared expert joins as the last expert when it has the routed experts' format and width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from edgespec.errors import CheckpointError
from edgespec.kernels.moe.stacks import TILE, StackedFP8Block, StackedNVFP4, StackedPacked
from edgespec.weights.base import PackedWeight

FORMATS = ("nvfp4", "fp8_block")


def _gate_up(mlp: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, linear) of an MLP's gate and up rows: the merged layer, or both parts in order."""
    if mlp.gate_up_proj is not None:
        return [("gate_up_proj", mlp.gate_up_proj)]
    return [("gate_proj", mlp.gate_proj), ("up_proj", mlp.up_proj)]


def _format(linear: nn.Module) -> str:
    w = linear.weight
    return w.format if isinstance(w, PackedWeight) else f"dense {str(w.dtype).removeprefix('torch.')}"


def _role_formats(mlp: nn.Module) -> dict[str, str]:
    """The weight format of an MLP's gate, up and down rows (a merged gate/up gives both)."""
    if mlp.gate_up_proj is not None:
        fmt = _format(mlp.gate_up_proj)
        return {"gate_proj": fmt, "up_proj": fmt, "down_proj": _format(mlp.down_proj)}
    return {name: _format(getattr(mlp, name)) for name in ("gate_proj", "up_proj", "down_proj")}


def expert_formats(experts: Sequence[nn.Module]) -> dict[str, str]:
    """The weight format of the routed experts' gate, up and down rows (``int4``, ``nvfp4``, ``fp8_block``,
    ``dense bfloat16`` ...): one per role, the same in every expert, else a :class:`CheckpointError` naming the first
    expert that differs (no release quantizes the experts of a layer apart)."""
    first = _role_formats(experts[0])
    for i, mlp in enumerate(experts[1:], start=1):
        for role, fmt in _role_formats(mlp).items():
            if fmt != first[role]:
                raise CheckpointError(f"MoE experts of mixed formats: expert {i} {role} is {fmt} but expert 0 {role} "
                                      f"is {first[role]}; the routed experts of a layer must share their formats")
    return first


def _fits(mlp: nn.Module, fmt: str, hidden: int, width: int) -> bool:
    """Whether ``mlp`` is of ``fmt`` with the stacked experts' shape (and, fp8, their 128x128 blocks)."""
    layers = [m for _, m in _gate_up(mlp)] + [mlp.down_proj]
    if any(_format(m) != fmt for m in layers):
        return False
    if fmt == "fp8_block" and any(m.weight.block != (TILE, TILE) for m in layers):
        return False
    return mlp.down_proj.in_features == width and mlp.down_proj.out_features == hidden


def _stack_rows(parts: list[list[PackedWeight]], buf: str) -> torch.Tensor:
    """``[E', rows, ...]``: buffer ``buf`` of each expert's parts, their rows one after another; each part's buffer
    then becomes a view of its rows (the memory counted once)."""
    stack = torch.stack([torch.cat([getattr(p, buf) for p in ps]) for ps in parts])
    for i, ps in enumerate(parts):
        r = 0
        for p in ps:
            n = getattr(p, buf).shape[0]
            setattr(p, buf, stack[i, r:r + n])
            r += n
    return stack


def _global_scales(parts: list[list[PackedWeight]], columns: int) -> torch.Tensor:
    """``[E', columns]`` (or ``[E']`` for one column) of the parts' NVFP4 global scales, a merged gate/up's scale
    repeated in both columns; each part's 0-d buffer becomes a view of its entry."""
    stack = torch.stack([torch.stack([ps[min(c, len(ps) - 1)].weight_scale_2 for c in range(columns)])
                         for ps in parts])
    for i, ps in enumerate(parts):
        for c, p in enumerate(ps):
            p.weight_scale_2 = stack[i, c]
    return stack if columns > 1 else stack[:, 0]


def stack_packed_experts(experts: Sequence[nn.Module], shared: nn.Module) -> StackedPacked | None:
    """The routed experts (and ``shared``, last, where it fits) stacked as :class:`StackedNVFP4` or
    :class:`StackedFP8Block`, their buffers turned into views of the stacks; None (nothing changed) for other
    formats (gate, up and down of different formats too), weights on the meta device, or shapes off the kernel's
    128 tiles. Experts that differ from each other raise (:func:`expert_formats`)."""
    fmts = set(expert_formats(experts).values())
    fmt = fmts.pop()
    down = experts[0].down_proj
    if fmts or fmt not in FORMATS or down.weight.weight.device.type == "meta":
        return None
    H, I = down.out_features, down.in_features
    if H % TILE or I % TILE or not all(_fits(e, fmt, H, I) for e in experts):
        return None
    mlps = [*experts, shared] if _fits(shared, fmt, H, I) else list(experts)
    up = [[m.weight for _, m in _gate_up(mlp)] for mlp in mlps]
    dn = [[mlp.down_proj.weight] for mlp in mlps]
    with torch.no_grad():
        if fmt == "nvfp4":
            stack: StackedPacked = StackedNVFP4(
                _stack_rows(up, "weight"), _stack_rows(up, "weight_scale"), _global_scales(up, 2),
                _stack_rows(dn, "weight"), _stack_rows(dn, "weight_scale"), _global_scales(dn, 1),
                shared=len(mlps) > len(experts))
        else:
            stack = StackedFP8Block(_stack_rows(up, "weight"), _stack_rows(up, "weight_scale_inv"),
                                    _stack_rows(dn, "weight"), _stack_rows(dn, "weight_scale_inv"),
                                    shared=len(mlps) > len(experts))
    stack.check()
    return stack
