"""RMSNorm variants: standard (``w * x̂``), zero-centred (``(1 + w) * x̂``, Qwen3.5) and gated (GDN output)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgespec.kernels import use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """Normalise the last dim in fp32. Standard form casts back before the weight (as Llama does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: ``w * x̂ * silu(gate)`` per head (plain weight, not zero-centred)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm residual step: ``s = residual + x`` (in x's dtype), returns ``(s, rms_norm(s))``."""
    s = residual + x
    return s, rms_norm_ref(s, weight, eps, zero_centred)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with the next RMSNorm (one kernel on CUDA instead of two); see :func:`add_rms_norm_ref`."""
    if use_triton(x):
        from edgespec.kernels.pointwise.triton_norm import add_rms_norm_triton
        return add_rms_norm_triton(x, residual, weight, eps, zero_centred)
    if not zero_centred and x.device.type == "cpu":
        from edgespec.kernels.cpu.cpu_step import add_rms_norm_cpu
        done = add_rms_norm_cpu(x, residual, weight, eps)
        if done is not None:
            return done
    return add_rms_norm_ref(x, residual, weight, eps, zero_centred)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    if use_triton(x):
        from edgespec.kernels.pointwise.triton_norm import rms_norm_triton
        return rms_norm_triton(x, weight, eps, zero_centred)
    if not zero_centred and x.device.type == "cpu":
        # the compiled norm, as add_rms_norm's: a CPU forward's norms all round alike (edgespec.models.cpu_stack)
        from edgespec.kernels.cpu.cpu_step import add_rms_norm_cpu
        done = add_rms_norm_cpu(None, x, weight, eps)
        if done is not None:
            return done[1]
    return rms_norm_ref(x, weight, eps, zero_centred)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        from edgespec.kernels.pointwise.triton_norm import gated_rms_norm_triton
        return gated_rms_norm_triton(x, gate, weight, eps)
    return gated_rms_norm_ref(x, gate, weight, eps)
