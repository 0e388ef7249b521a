"""Depthwise causal conv1d + SiLU of the Gated DeltaNet input, over T new rows, with per-step state saves.

``x [T, C]`` new pre-conv inputs; ``state [C, K-1]`` the K-1 previous inputs (oldest first), updated in place;
``weight [C, K]``. Output ``silu(conv) [T, C]``. With ``slots [>=T+1, C, K-1]`` the state after row i is saved
in slot i+1, so a rollback to any row is one copy (see ``edgespec.cache.state``). A deferred verify instead leaves
the state alone and saves its inputs (``x_save``) for the commit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgespec.kernels import use_triton
from edgespec.kernels.pointwise.activation import gdn_gates


def causal_conv1d_ref(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                      slots: torch.Tensor | None = None, *, update_state: bool = True,
                      out: torch.Tensor | None = None, x_save: torch.Tensor | None = None) -> torch.Tensor:
    T, K = x.shape[0], weight.shape[1]
    seq = torch.cat([state, x.t().to(state.dtype)], dim=1)               # [C, K-1+T]
    conv = F.conv1d(seq.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])[0]  # [C, T]
    if slots is not None:
        for t in range(T):
            slots[t + 1].copy_(seq[:, t + 1:t + K])
    if x_save is not None:
        x_save.copy_(seq[:, K - 1:].t())
    if update_state:
        state.copy_(seq[:, T:])
    # Row-major like the Triton kernel's output: later reductions over a row then see the same memory layout
    # whatever T is, so a verify row and a decode step (or a deferred commit) round alike.
    y = F.silu(conv).t().to(x.dtype).contiguous()
    if out is None:
        return y
    out.copy_(y)
    return out


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                  slots: torch.Tensor | None = None, *, update_state: bool = True,
                  out: torch.Tensor | None = None, x_save: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: Triton on CUDA for short (decode/verify) inputs, else the torch reference.

    Deferred verify: ``update_state=False`` leaves the window as it was, ``x_save [T, C]`` (state dtype) receives
    the inputs as the window stores them and ``out [T, C]`` the result, so a later commit can advance the window by
    the accepted rows (:meth:`edgespec.cache.state.GDNStateBank.advance`)."""
    if x.shape[0] <= 64 and use_triton(x):
        from edgespec.kernels.recurrent.triton_conv import causal_conv1d_triton
        return causal_conv1d_triton(x, state, weight, slots, update_state=update_state, out=out, x_save=x_save)
    return causal_conv1d_ref(x, state, weight, slots, update_state=update_state, out=out, x_save=x_save)


def causal_conv1d_gates(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, a: torch.Tensor,
                        b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                        slots: torch.Tensor | None = None, *, update_state: bool = True,
                        out: torch.Tensor | None = None, x_save: torch.Tensor | None = None,
                        gates_out: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GDN layer's conv (:func:`causal_conv1d`) and its gates
    (:func:`edgespec.kernels.pointwise.activation.gdn_gates`) together: one launch on CUDA for decode/verify inputs.
    Returns ``(conv output, g, beta)``."""
    if x.shape[0] <= 64 and use_triton(x):
        from edgespec.kernels.pointwise.triton_activation import check_gates
        from edgespec.kernels.recurrent.triton_conv import causal_conv1d_triton
        a, b, g, beta = check_gates(a, b, A_log, dt_bias, gates_out)
        y = causal_conv1d_triton(x, state, weight, slots, update_state=update_state, out=out, x_save=x_save,
                                 gates=(a, b, A_log, dt_bias, g, beta))
        return y, g, beta
    y = causal_conv1d(x, state, weight, slots, update_state=update_state, out=out, x_save=x_save)
    g, beta = gdn_gates(a, b, A_log, dt_bias, out=gates_out)
    return y, g, beta
