"""The grouped dynamic causal convolution of a DFlash2 drafter layer, over the rows of one draft block.

DFlash2 wraps each attention and MLP sublayer of its drafter in a short convolution along the block's rows, so a
draft position sees the positions before it without another pass of the backbone. Its kernel is part learnt
(``base [taps, H]``, per channel) and part computed from the sublayer's input (``dynamic [T, taps, G]``, one
coefficient per row, tap and group of ``group_size`` channels)::

    out[t, c] = sum_{o < taps} (base[o, c] + dynamic[t, o, c // group_size]) * x[t - o, c]     (x[< 0] = 0)

Rows before the block's first are zero: the convolution never reaches into the context. The reference works in
float32 and rounds once to ``x``'s dtype; on CUDA one Triton launch does the same
(:mod:`edgespec.kernels.recurrent.triton_dynamic_conv`), where the torch path would take five small launches per tap and
call, twenty calls per draft of a five-layer drafter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgespec.kernels import use_triton


def dynamic_conv_ref(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """The torch reference: ``x [..., T, H]``, ``dynamic [..., T, taps, H // group_size]``, ``base [taps, H]`` ->
    ``[..., T, H]`` in ``x``'s dtype (see the module docstring); leading dimensions are independent blocks (the
    training objective's many blocks at once). Differentiable."""
    T = x.shape[-2]
    coeff = base.float() + dynamic.float().repeat_interleave(group_size, dim=-1)     # [..., T, taps, H]
    xf = x.float()
    out = coeff[..., 0, :] * xf
    for o in range(1, min(base.shape[0], T)):
        out = out + coeff[..., o, :] * F.pad(xf[..., :-o, :], (0, 0, o, 0))
    return out.to(x.dtype)


def _check(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int) -> None:
    if x.dim() != 2 or base.dim() != 2 or dynamic.dim() != 3:
        raise ValueError(f"dynamic conv shapes: x{tuple(x.shape)} dynamic{tuple(dynamic.shape)} "
                         f"base{tuple(base.shape)}: expected [T, H], [T, taps, H / group] and [taps, H]")
    T, H = x.shape
    taps = base.shape[0]
    if group_size < 1 or H % group_size or base.shape[1] != H or dynamic.shape != (T, taps, H // group_size):
        raise ValueError(f"dynamic conv shapes: x{tuple(x.shape)} dynamic{tuple(dynamic.shape)} "
                         f"base{tuple(base.shape)} group {group_size}: expected dynamic ({T}, {taps}, "
                         f"{H // max(group_size, 1)}) and base ({taps}, {H})")


def dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """The block convolution of ``x [T, H]`` (module docstring): one Triton launch on CUDA, the reference
    elsewhere. ``dynamic`` may be a strided view (one side of a sublayer's coefficients). Raises ValueError on
    shapes that do not fit."""
    _check(x, dynamic, base, group_size)
    if use_triton(x):
        from edgespec.kernels.recurrent.triton_dynamic_conv import dynamic_conv_triton
        return dynamic_conv_triton(x, dynamic, base, group_size)
    return dynamic_conv_ref(x, dynamic, base, group_size)


__all__ = ["dynamic_conv", "dynamic_conv_ref"]
