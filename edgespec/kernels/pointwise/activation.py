"""Small pointwise steps of a layer, each one kernel on CUDA instead of a chain of torch ops.

* :func:`silu_mul`: the SwiGLU product ``silu(gate) * up`` of a merged ``[gate | up]`` projection (2 kernels -> 1).
* :func:`gdn_gates`: the Gated DeltaNet decay and write strength from the ``a``/``b`` projections,
  ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` (about 8 kernels -> 1).

On a batch-1 decode step these ops move a few kilobytes: their cost is launches and latency, which add up over
dozens of layers (unfused, a Qwen3.5-4B decode step runs ~400 elementwise kernels; ``tools/step_profile.py``
counts them). The torch references below define the rounding the kernels reproduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgespec.kernels import use_triton


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [..., 2I]`` = ``[gate | up]``, in its dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gdn_gates_ref(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a, b [T, Hv]`` (projection outputs) -> ``g, beta [T, Hv]`` in fp32 (sigmoid rounds to b's dtype first,
    as the reference model computes it)."""
    beta = torch.sigmoid(b).float()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, beta


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        from edgespec.kernels.pointwise.triton_activation import silu_mul_triton
        return silu_mul_triton(gate_up)
    if gate_up.device.type == "cpu":
        from edgespec.kernels.cpu.cpu_step import silu_mul_cpu
        out = silu_mul_cpu(gate_up)
        if out is not None:
            return out
    return silu_mul_ref(gate_up)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``out``: preallocated contiguous fp32 ``(g, beta)`` to write (a deferred verify keeps them for its commit)."""
    if use_triton(a):
        from edgespec.kernels.pointwise.triton_activation import gdn_gates_triton
        return gdn_gates_triton(a, b, A_log, dt_bias, out)
    g, beta = gdn_gates_ref(a, b, A_log, dt_bias)
    if out is None:
        return g, beta
    out[0].copy_(g)
    out[1].copy_(beta)
    return out
