"""Triton versions of :mod:`edgespec.kernels.pointwise.activation` (same values and rounding points as the
references)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels.launch.triton_pdl import pdl_enter, pdl_launch


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N, I, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < I
    gate = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + c, mask=ok, other=0.0)
    gf = gate.to(tl.float32)
    # torch: silu in fp32 rounded to the dtype, then the product in fp32 rounded again.
    act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (act * up.to(tl.float32)).to(gate.dtype), mask=ok)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"gate_up last dim {two_i} is not even")
    x2 = gate_up.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    N, I = x2.shape[0], two_i // 2
    out = torch.empty((N, I), dtype=gate_up.dtype, device=gate_up.device)
    block = min(2048, triton.next_power_of_2(I))
    if N:
        pdl = pdl_launch(gate_up.device)
        _silu_mul_kernel[(N, triton.cdiv(I, block))](x2, out, N, I, x2.stride(0), out.stride(0), BLOCK=block,
                                                     PDL=bool(pdl), num_warps=4, **pdl)
    return out.reshape(*gate_up.shape[:-1], I)


@triton.jit
def gdn_gates_block(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, i, N, H, stride_a, stride_b):
    """Gates of the flat indices ``i`` (row-major over ``[N, H]``): one block of work, shared by the gate kernel and
    the conv kernel that fuses it (``edgespec.kernels.recurrent.triton_conv``), so both round alike."""
    ok = i < N * H
    t = i // H
    h = i % H
    a = tl.load(a_ptr + t * stride_a + h, mask=ok, other=0.0)
    b = tl.load(b_ptr + t * stride_b + h, mask=ok, other=0.0)
    a_log = tl.load(alog_ptr + h, mask=ok, other=0.0).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + h, mask=ok, other=0.0).to(tl.float32)
    bf = b.to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-bf))).to(b.dtype).to(tl.float32)
    x = a.to(tl.float32) + dt_bias
    # torch's softplus (beta 1, threshold 20): x above the threshold, else log1p(exp(x)); far below zero
    # log1p(e) = e to fp32 precision, where log(1 + e) would round to 0.
    e = tl.exp(tl.minimum(x, 20.0))
    softplus = tl.where(x > 20.0, x, tl.where(x < -10.0, e, tl.log(1.0 + e)))
    tl.store(g_ptr + i, -tl.exp(a_log) * softplus, mask=ok)
    tl.store(beta_ptr + i, beta, mask=ok)


@triton.jit
def _gdn_gates_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, N, H, stride_a, stride_b,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    gdn_gates_block(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, i, N, H, stride_a, stride_b)


def check_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                out: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the gate inputs; returns ``(a, b, g, beta)`` with unit-stride rows and the outputs (allocated
    when ``out`` is None)."""
    if a.shape != b.shape or a.dim() != 2 or A_log.shape != (a.shape[1],) or dt_bias.shape != A_log.shape:
        raise ValueError(f"gdn gates: a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(A_log.shape)}, "
                         f"dt_bias {tuple(dt_bias.shape)} do not fit [T, Hv] / [Hv]")
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(-1) != 1:
        b = b.contiguous()
    N, H = a.shape
    if out is None:
        g = torch.empty((N, H), dtype=torch.float32, device=a.device)
        beta = torch.empty((N, H), dtype=torch.float32, device=a.device)
    else:
        g, beta = out
        for t in (g, beta):
            if t.shape != (N, H) or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"gdn gates out must be contiguous fp32 [{N}, {H}] tensors")
    return a, b, g, beta


def gdn_gates_triton(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    a, b, g, beta = check_gates(a, b, A_log, dt_bias, out)
    N, H = a.shape
    block = min(1024, triton.next_power_of_2(max(N * H, 1)))
    if N:
        pdl = pdl_launch(a.device)
        _gdn_gates_kernel[(triton.cdiv(N * H, block),)](a, b, A_log, dt_bias, g, beta, N, H, a.stride(0),
                                                         b.stride(0), BLOCK=block, PDL=bool(pdl), num_warps=4, **pdl)
    return g, beta
