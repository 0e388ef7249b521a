"""Linear layers ``y = x W^T + b``: Triton GEMV / skinny GEMM for few rows on CUDA, and a CPU path that streams the
weights at DRAM speed. (The GPU side is described in ``edgespec.kernels.triton_gemv``; this note is the CPU side.)

A batch-1 forward on CPU is a chain of matrix-vector products: it should cost the bytes of the weights over the
memory bandwidth. torch's fp32 CPU matmul goes through MKL, which on the AMD (AVX2) CPUs we run CI and the demo on
streams only 8-14 GB/s for one row and 4-8 GB/s for 2-11 rows, against ~30 GB/s the same cores read with a plain
reduction. The OpenBLAS that numpy bundles runs the same one-row product at roughly twice that, 17-30 GB/s
depending on the shape and the machine's load (``tools/cpu_matmul_bench.py`` prints the comparison). So on CPU
in fp32:

* up to :data:`ROWS_MAX` rows (decode and short verifies) run as one OpenBLAS GEMV per row over blocks of the
  weight small enough to stay in the last-level cache, so the weight comes from DRAM once per forward however many
  rows there are. Each row is then the very same GEMV whatever the row count, so a verify row rounds exactly like a
  plain decode step of the same token (speculative output equals plain output bit for bit on this path);
* more rows (prefill, long verifies) run as one OpenBLAS GEMM.

OpenBLAS runs its own threads. Two thread pools spinning on two cores fight (a forward got 8x slower in our
measurements), so the BLAS path is taken only while torch's intra-op pool is single-threaded:
:func:`configure_cpu` sets that up, and anything that raises torch's thread count again falls back to torch's
matmul automatically. :func:`linear_ref` is the torch reference the tests compare against.

:func:`linear_silu_mul`, :func:`linear_gated_rms_norm` and :func:`linear_sigmoid_gate` are a linear whose input is
the pointwise step before it (SwiGLU, the GDN output norm, the attention output gate). Where :func:`linear` runs a
Triton product they fold that step into its prologue (one launch fewer on a decode step); everywhere else, CPU
included, they are exactly ``linear(step(...), weight, bias)`` with the step dispatched as usual (its torch
reference on CPU, its Triton kernel on CUDA).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from edgespec.kernels import sm_count, triton_available
from edgespec.kernels.activation import silu_mul
from edgespec.kernels.norm import gated_rms_norm

# Up to this many rows, one GEMV per row beats a GEMM on small-M shapes (measured on a 2-core EPYC, AVX2).
ROWS_MAX = 8
# Weight block of a multi-row GEMV pass: stays in cache while every row reads it.
BLOCK_BYTES = 4 << 20

_enabled = False


def configure_cpu(enabled: bool = True) -> None:
    """Route fp32 CPU linears through OpenBLAS (``enabled``) and make torch's intra-op pool single-threaded so the
    two pools never compete for the cores. ``enabled=False`` restores torch's matmul (thread count untouched)."""
    global _enabled
    _enabled = enabled
    if enabled:
        torch.set_num_threads(1)


def cpu_blas_active() -> bool:
    """True when fp32 CPU linears currently take the OpenBLAS path."""
    return _enabled and torch.get_num_threads() == 1


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference."""
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., in] @ weight[out, in]^T (+ bias)``: on CUDA one bf16/fp16 row goes to the Triton GEMV and 2-16
    rows on wide matrices to the skinny GEMM (``edgespec.kernels.triton_gemv``: both faster than cuBLAS there),
    on CPU fp32 to OpenBLAS when active; everything else to torch."""
    if x.is_cuda:
        route = _triton_route(x, weight, x.shape[-1])
        if route is not None:
            from edgespec.kernels.triton_gemv import gemv_triton, skinny_gemm_triton
            product = gemv_triton if route == "gemv" else skinny_gemm_triton
            return product(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)
    if (weight.dtype != torch.float32 or x.dtype != torch.float32
            or torch.is_grad_enabled() or not cpu_blas_active()):
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.from_numpy(blas_matmul_t(x2.contiguous().numpy(), weight.detach().numpy()))
    if bias is not None:
        out += bias
    return out.reshape(*lead, weight.shape[0])


def _triton_route(x: torch.Tensor, weight: torch.Tensor, row_len: int) -> str | None:
    """The Triton product :func:`linear` runs for a CUDA input ``x`` of rows of ``row_len`` elements: ``"gemv"``
    (one bf16/fp16 row), ``"skinny"`` (2-16 rows on a matrix wide enough for it to pay) or None (torch)."""
    rows = x.numel() // row_len if row_len else 0
    if not (1 <= rows <= 16 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.stride(-1) == 1 and not torch.is_grad_enabled() and triton_available()):
        return None
    if rows == 1:
        return "gemv"
    from edgespec.kernels.triton_gemv import skinny_pays
    return "skinny" if skinny_pays(weight.shape[0], sm_count(x.device)) else None


def _fused_product(route: str, prologue: str, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, **norm: object) -> torch.Tensor:
    """The ``route`` product whose input rows are the ``prologue`` (a :class:`~edgespec.kernels.triton_gemv.Prologue`
    name) of ``x`` and ``gate [M, K]``."""
    from edgespec.kernels.triton_gemv import Prologue, gemv_triton, skinny_gemm_triton
    product = gemv_triton if route == "gemv" else skinny_gemm_triton
    return product(x, weight, bias, prologue=Prologue[prologue], gate=gate, **norm)


# The fused prologue products below are kept, tested and benchmarked (tools/prologue_bench.py), but the models do
# not call them: in a Qwen3.5-4B decode step on an H200 (tools/step_profile.py --sequence) the fused down GEMV took
# 20.7 us against 12.6 us + 1.5 us for the GEMV and the separate SwiGLU kernel, the fused out_proj 12.4 us against
# 6.8 + 3.0 us. Every GEMV program recomputes the whole input vector, and at BLOCK_N = 2 that costs more than the
# launch it saves (with programmatic dependent launch the separate kernel's launch is mostly hidden anyway).
def linear_silu_mul(gate_up: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The SwiGLU down projection ``linear(silu_mul(gate_up), weight, bias)``: ``gate_up [..., 2I]`` (``[gate | up]``)
    and ``weight [N, I]`` -> ``[..., N]``.

    Where :func:`linear` would run a Triton GEMV / skinny GEMM on the ``[..., I]`` product, that kernel forms
    ``silu(gate) * up`` while loading its input (rounded as :func:`~edgespec.kernels.activation.silu_mul_ref`
    rounds) and the separate SiLU launch goes; the result then equals ``linear(silu_mul_ref(gate_up), weight,
    bias)`` on the same kernel. Everywhere else (CPU, prefill, 2-16 rows on narrow matrices) this is exactly the
    unfused composition."""
    two_i = gate_up.shape[-1] if gate_up.dim() else 1
    if two_i % 2 or weight.dim() != 2 or weight.shape[1] != two_i // 2:
        raise ValueError(f"linear_silu_mul: gate_up {tuple(gate_up.shape)} is not [..., 2 * {weight.shape[-1]}] "
                         f"for weight {tuple(weight.shape)}")
    route = _triton_route(gate_up, weight, two_i) if gate_up.is_cuda else None
    if route is None:
        return linear(silu_mul(gate_up), weight, bias)
    rows = gate_up.reshape(-1, two_i)
    half = two_i // 2
    y = _fused_product(route, "SILU_MUL", rows[:, half:], rows[:, :half], weight, bias)
    return y.reshape(*gate_up.shape[:-1], weight.shape[0])


def linear_gated_rms_norm(o: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Gated DeltaNet output ``linear(gated_rms_norm(o, z, norm_weight, eps).flatten(-2), weight, bias)``:
    ``o, z [..., H, D]`` (per-head RMSNorm over D, gated by ``silu(z)``), ``norm_weight [D]``, ``weight [N, H*D]``
    -> ``[..., N]``.

    Where :func:`linear` would run a Triton product and D is a power of two (at most
    :data:`~edgespec.kernels.triton_gemv.NORM_HEAD_MAX`), that kernel normalises whole heads of its input slices
    while loading them (rounded as :func:`~edgespec.kernels.norm.gated_rms_norm_ref` rounds; only the order of
    the per-head sum of squares is its own) and the norm's launch goes. Everywhere else this is exactly the
    unfused composition."""
    if (o.dim() < 2 or z.shape != o.shape or norm_weight.shape != o.shape[-1:] or weight.dim() != 2
            or weight.shape[1] != o.shape[-2] * o.shape[-1]):
        raise ValueError(f"linear_gated_rms_norm: o {tuple(o.shape)}, z {tuple(z.shape)}, norm weight "
                         f"{tuple(norm_weight.shape)} and weight {tuple(weight.shape)} do not fit [..., H, D], "
                         f"[..., H, D], [D], [N, H*D]")
    D = o.shape[-1]
    K = o.shape[-2] * D
    route = _triton_route(o, weight, K) if o.is_cuda and z.dtype == o.dtype else None
    if route is not None:
        from edgespec.kernels.triton_gemv import NORM_HEAD_MAX
        if D & (D - 1) or D > NORM_HEAD_MAX:
            route = None
    if route is None:
        return linear(gated_rms_norm(o, z, norm_weight, eps).reshape(*o.shape[:-2], K), weight, bias)
    y = _fused_product(route, "GATED_RMS_NORM", o.reshape(-1, K), z.reshape(-1, K), weight, bias,
                       norm_weight=norm_weight, eps=eps)
    return y.reshape(*o.shape[:-2], weight.shape[0])


def linear_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """The gated attention output ``linear(x * torch.sigmoid(gate), weight, bias)``: ``x, gate [..., K]``,
    ``weight [N, K]`` -> ``[..., N]``.

    Where :func:`linear` would run a Triton product, that kernel applies the gate while loading its input (the
    sigmoid rounded to x's dtype before the product, as torch rounds it) and the gating launches go; the result
    then equals the unfused ``linear`` on the same kernel. Everywhere else this is exactly the unfused
    composition."""
    if gate.shape != x.shape or x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear_sigmoid_gate: x {tuple(x.shape)}, gate {tuple(gate.shape)} and weight "
                         f"{tuple(weight.shape)} do not fit [..., K], [..., K], [N, K]")
    route = _triton_route(x, weight, x.shape[-1]) if x.is_cuda and gate.dtype == x.dtype else None
    if route is None:
        return linear(x * torch.sigmoid(gate), weight, bias)
    K = x.shape[-1]
    y = _fused_product(route, "SIGMOID_GATE", x.reshape(-1, K), gate.reshape(-1, K), weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def blas_matmul_t(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x [M, K] @ w[N, K]^T`` in fp32 with numpy's BLAS: per-row GEMVs over cache-sized blocks up to
    :data:`ROWS_MAX` rows, one GEMM beyond."""
    M = x.shape[0]
    if M > ROWS_MAX:
        return x @ w.T
    N, K = w.shape
    out = np.empty((M, N), dtype=np.float32)
    if M == 1:
        np.dot(w, x[0], out=out[0])
        return out
    block = max(1, BLOCK_BYTES // (K * w.itemsize))
    for s in range(0, N, block):
        wb = w[s:s + block]
        for m in range(M):
            np.dot(wb, x[m], out=out[m, s:s + block])
    return out
