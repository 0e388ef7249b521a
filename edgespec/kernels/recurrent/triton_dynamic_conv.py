"""DFlash2's grouped dynamic causal convolution in one Triton launch (contract:
:mod:`edgespec.kernels.recurrent.dynamic_conv`).

Grid ``(T, cdiv(H, BLOCK))``: program ``(t, j)`` reads row ``t`` and the ``taps - 1`` rows before it over one
channel block, the learnt kernel's columns and the row's dynamic coefficients of the block's groups, sums in
float32 and stores one rounding of the result. A draft block is 8-16 rows of 2-5k channels: the launch reads a
few hundred kilobytes, so it is latency-bound and one launch per call is what matters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dynamic_conv_kernel(x_ptr, dyn_ptr, base_ptr, out_ptr, H,
                         stride_x, stride_dt, stride_do, stride_base, stride_out,
                         TAPS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for o in tl.static_range(TAPS):
        inside = ok & (t >= o)             # rows before the block are zero
        x = tl.load(x_ptr + (t - o) * stride_x + c, mask=inside, other=0.0).to(tl.float32)
        b = tl.load(base_ptr + o * stride_base + c, mask=ok, other=0.0).to(tl.float32)
        d = tl.load(dyn_ptr + t * stride_dt + o * stride_do + c // GROUP, mask=ok, other=0.0).to(tl.float32)
        acc += (b + d) * x
    tl.store(out_ptr + t * stride_out + c, acc.to(out_ptr.dtype.element_ty), mask=ok)


def dynamic_conv_triton(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """One launch; shapes checked by :func:`edgespec.kernels.recurrent.dynamic_conv.dynamic_conv`."""
    T, H = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if dynamic.stride(-1) != 1:
        dynamic = dynamic.contiguous()
    if base.stride(-1) != 1:
        base = base.contiguous()
    out = torch.empty_like(x)
    block = min(1024, triton.next_power_of_2(H))
    _dynamic_conv_kernel[(T, triton.cdiv(H, block))](
        x, dynamic, base, out, H, x.stride(0), dynamic.stride(0), dynamic.stride(1), base.stride(0), out.stride(0),
        TAPS=base.shape[0], GROUP=group_size, BLOCK=block)
    return out


__all__ = ["dynamic_conv_triton"]
