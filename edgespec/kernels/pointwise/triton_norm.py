"""RMSNorm variants in Triton: standard, zero-centred (Qwen3.5) and gated (GDN output norm).

Contract: :mod:`edgespec.kernels.pointwise.norm`. The reference's rounding points are reproduced, not just its maths, so
the kernels agree with it to the last bit in most elements:

* standard: ``x̂`` is rounded to x's dtype, then multiplied by the weight in ``promote(w, x)`` (fp32 weights
  on bf16 activations give fp32 out, as in torch);
* zero-centred: ``x̂ (1 + w)`` in fp32, rounded once to x's dtype;
* gated: ``y = w * x̂`` as in standard, then ``y * silu(gate)`` in fp32, rounded to x's dtype.

One program normalises ``BLOCK_R`` rows of the flattened ``[N, D]`` view; several rows per program keep the
many-short-rows case (per-head norms: D = 128, N = T * heads) from being launch- and latency-bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels.launch.triton_pdl import pdl_enter, pdl_launch

_STANDARD, _ZERO_CENTRED, _GATED = 0, 1, 2


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, gate_ptr, out_ptr, res_ptr, sum_ptr, N, D, eps,
    stride_x, stride_g, stride_o, stride_r, stride_s,
    MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, MID_TY: tl.constexpr,
    HAS_RES: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    ok = (r[:, None] < N) & (d[None, :] < D)
    x = tl.load(x_ptr + r[:, None] * stride_x + d[None, :], mask=ok, other=0.0)
    if HAS_RES:
        # Fused residual step: s = residual + x, rounded to x's dtype as torch's add is, stored, then normalised.
        res = tl.load(res_ptr + r[:, None] * stride_r + d[None, :], mask=ok, other=0.0)
        x = (res.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + r[:, None] * stride_s + d[None, :], x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
    xn = xf * rstd[:, None]
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    if MODE == 1:
        y = xn * (1.0 + w[None, :])
    else:
        # torch: weight * x̂.to(x.dtype), computed in promote(w, x) = MID_TY.
        y = (xn.to(x.dtype).to(tl.float32) * w[None, :]).to(MID_TY).to(tl.float32)
        if MODE == 2:
            gt = tl.load(gate_ptr + r[:, None] * stride_g + d[None, :], mask=ok, other=0.0).to(tl.float32)
            y = y * (gt / (1.0 + tl.exp(-gt)))
    tl.store(out_ptr + r[:, None] * stride_o + d[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a ``[N, D]`` view with unit stride along D (copies only if that is impossible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, eps: float, mode: int,
            out_dtype: torch.dtype, mid_dtype: torch.dtype, residual: torch.Tensor | None = None,
            summed: torch.Tensor | None = None) -> torch.Tensor:
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match last dim {D}")
    x2 = _rows(x)
    g2 = _rows(gate) if gate is not None else x2
    r2 = _rows(residual) if residual is not None else x2
    s2 = summed.view(-1, D) if summed is not None else x2
    N = x2.shape[0]
    out = torch.empty((N, D), dtype=out_dtype, device=x.device)
    if N == 0:
        return out.reshape(x.shape)
    block_d = triton.next_power_of_2(D)
    # ~4k elements per program: many rows for per-head norms, one row for hidden-size norms.
    block_r = max(1, min(64, 4096 // block_d, triton.next_power_of_2(N)))
    num_warps = 4 if block_d * block_r <= 4096 else 8
    pdl = pdl_launch(x.device)
    _rms_norm_kernel[(triton.cdiv(N, block_r),)](
        x2, weight.contiguous(), g2, out, r2, s2, N, D, float(eps),
        x2.stride(0), g2.stride(0), out.stride(0), r2.stride(0), s2.stride(0),
        MODE=mode, BLOCK_R=block_r, BLOCK_D=block_d, MID_TY=_TL_DTYPE[mid_dtype], HAS_RES=residual is not None,
        PDL=bool(pdl), num_warps=num_warps, **pdl,
    )
    return out.reshape(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """RMSNorm over the last dim; same values and dtype as :func:`edgespec.kernels.pointwise.norm.rms_norm_ref`."""
    if zero_centred:
        return _launch(x, weight, None, eps, _ZERO_CENTRED, x.dtype, torch.float32)
    mid = torch.promote_types(weight.dtype, x.dtype)
    return _launch(x, weight, None, eps, _STANDARD, mid, mid)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> torch.Tensor:
    """``w * x̂ * silu(gate)`` over the last dim; same as :func:`edgespec.kernels.pointwise.norm.gated_rms_norm_ref`."""
    if gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must match x {tuple(x.shape)}")
    return _launch(x, weight, gate, eps, _GATED, x.dtype, torch.promote_types(weight.dtype, x.dtype))


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual + x, rms_norm(residual + x))`` in one launch; same as
    :func:`edgespec.kernels.pointwise.norm.add_rms_norm_ref`."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if zero_centred:
        y = _launch(x, weight, None, eps, _ZERO_CENTRED, x.dtype, torch.float32, residual, summed)
    else:
        mid = torch.promote_types(weight.dtype, x.dtype)
        y = _launch(x, weight, None, eps, _STANDARD, mid, mid, residual, summed)
    return summed, y
