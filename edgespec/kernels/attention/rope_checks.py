"""The input checks of :func:`edgespec.kernels.attention.rope.head_norm_rope`, shared by its torch reference and
its Triton twin (:mod:`edgespec.kernels.attention.triton_rope`)."""

from __future__ import annotations

import torch


def check_head_norm_rope(x: torch.Tensor, n: int, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                          ) -> torch.Tensor:
    """Validate :func:`head_norm_rope`'s inputs (ValueError naming the problem); return the weight as a
    ``[Bw, nw, hd]`` view, ``Bw`` in ``{1, B}`` and ``nw`` in ``{1, n}`` (1: shared, broadcast)."""
    if x.dim() not in (3, 4):
        raise ValueError(f"x {tuple(x.shape)} must be [T, H_all, hd] or [B, T, H_all, hd]")
    if not x.is_floating_point():
        raise ValueError(f"x dtype {x.dtype} is not floating point")
    B = x.shape[0] if x.dim() == 4 else 1
    T, h_all, hd = x.shape[-3:]
    if not 0 < n <= h_all:
        raise ValueError(f"n={n} heads to norm must be in [1, H_all={h_all}]")
    # 3-D [B, n, hd] weights cannot go through torch broadcasting against [B, T, n, hd] (B would meet T),
    # hence one explicit list of forms, all reduced to [Bw, nw, hd].
    shape = tuple(weight.shape)
    if weight.dim() == 1:
        w3 = weight[None, None]
    elif weight.dim() == 2:
        w3 = weight[None]
    elif weight.dim() == 3:
        w3 = weight
    elif weight.dim() == 4 and weight.shape[1] == 1:
        w3 = weight[:, 0]
    else:
        w3 = None
    if w3 is None or w3.shape[0] not in (1, B) or w3.shape[1] not in (1, n) or w3.shape[2] != hd:
        raise ValueError(f"weight {shape} does not fit B={B}, n={n}, hd={hd}: use [hd], [n, hd], [B, n, hd], "
                         f"[B, 1, hd] or [B, 1, n|1, hd] (B and n may be 1)")
    if torch.promote_types(weight.dtype, x.dtype) != x.dtype:
        # ``x̂ * w`` would promote the heads to the weight's dtype; the op returns x's dtype.
        raise ValueError(f"weight is {weight.dtype}: it must not promote x's dtype {x.dtype}")
    for name, c in (("cos", cos), ("sin", sin)):
        if c.dim() not in (2, 3) or c.shape[0] != T or (c.dim() == 3 and c.shape[1] != 1):
            raise ValueError(f"{name} {tuple(c.shape)} must be [T={T}, 1, rotary_dim] or [T, rotary_dim]")
        if c.dtype != x.dtype:
            raise ValueError(f"{name} is {c.dtype}; it must be in x's dtype {x.dtype} (angles(..., dtype))")
    rot = cos.shape[-1]
    if sin.shape[-1] != rot or rot % 2 or not 0 < rot <= hd:
        raise ValueError(f"rotary_dim {rot} (sin {sin.shape[-1]}) must be even, equal for cos/sin and in "
                         f"(0, hd={hd}]")
    if any(t.device != x.device for t in (weight, cos, sin)):
        raise ValueError("x, weight, cos and sin must be on one device")
    return w3
