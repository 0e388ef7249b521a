"""Depthwise causal conv1d + SiLU of the Gated DeltaNet input, over T new rows, with per-step state saves.

``x [T, C]`` new pre-conv inputs; ``state [C, K-1]`` the K-1 previous inputs (oldest first), updated in place;
``weight [C, K]``. Output ``silu(conv) [T, C]``. With ``slots [>=T+1, C, K-1]`` the state after row i is saved
in slot i+1, so a rollback to any row is one copy (see ``edgespec.cache.state``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgespec.kernels import use_triton


def causal_conv1d_ref(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                      slots: torch.Tensor | None = None) -> torch.Tensor:
    T, K = x.shape[0], weight.shape[1]
    seq = torch.cat([state, x.t().to(state.dtype)], dim=1)               # [C, K-1+T]
    out = F.conv1d(seq.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])[0]  # [C, T]
    if slots is not None:
        for t in range(T):
            slots[t + 1].copy_(seq[:, t + 1:t + K])
    state.copy_(seq[:, T:])
    return F.silu(out).t().to(x.dtype)


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                  slots: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: Triton on CUDA for short (decode/verify) inputs, else the torch reference."""
    if x.shape[0] <= 64 and use_triton(x):
        from edgespec.kernels.triton_conv import causal_conv1d_triton
        return causal_conv1d_triton(x, state, weight, slots)
    return causal_conv1d_ref(x, state, weight, slots)
