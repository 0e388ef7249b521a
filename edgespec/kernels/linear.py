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
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from edgespec.kernels import sm_count, triton_available
from edgespec.weights.base import is_packed

# Up to this many rows, one GEMV per row beats a GEMM on small-M shapes (measured on a 2-core EPYC, AVX2).
ROWS_MAX = 8
# Weight block of a multi-row GEMV pass: stays in cache while every row reads it.
BLOCK_BYTES = 4 << 20

_enabled = False
_blas_limit = None     # threadpoolctl's limiter while the BLAS path is on (restored when it is turned off)


def configure_cpu(enabled: bool = True, own_pool: bool = False) -> None:
    """Route fp32 CPU linears through OpenBLAS (``enabled``) and make torch's intra-op pool single-threaded so the
    two pools never compete for the cores. ``own_pool``: the model's products run on edgespec's own thread pool
    (packed GGUF weights, ``edgespec.kernels.gguf_native``), so OpenBLAS keeps to one thread; otherwise OpenBLAS
    has its own thread count back. ``enabled=False`` restores torch's matmul (thread count untouched)."""
    global _enabled, _blas_limit
    _enabled = enabled
    if _blas_limit is not None and not (enabled and own_pool):
        _blas_limit.restore_original_limits()
        _blas_limit = None
    if enabled:
        torch.set_num_threads(1)
    if enabled and own_pool:
        # OpenBLAS's own workers spin after each call. Beside the GGUF product's pool (which already uses the
        # other cores) they oversubscribe the CPU: a BLAS call then waits a scheduler time slice for a worker
        # that was descheduled, 13-27 ms for a 16-row product that takes 0.5-1 ms alone (a DFlash cycle of the
        # CPU demo: drafter layers on BLAS, verify on the GGUF pool). One BLAS thread per process avoids it.
        from threadpoolctl import threadpool_limits
        if _blas_limit is None:
            _blas_limit = threadpool_limits(1, user_api="blas")


def cpu_blas_active() -> bool:
    """True when fp32 CPU linears currently take the OpenBLAS path."""
    return _enabled and torch.get_num_threads() == 1


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference."""
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., in] @ weight[out, in]^T (+ bias)``: on CUDA one bf16/fp16 row goes to the Triton GEMV and 2-16
    rows to the skinny GEMM (``edgespec.kernels.triton_gemv``; :func:`~edgespec.kernels.triton_gemv.skinny_pays`
    says why not cuBLAS), on CPU fp32 to OpenBLAS when active; everything else to torch. A packed weight
    (:class:`edgespec.weights.PackedWeight`) computes its own product."""
    if is_packed(weight):
        return weight.matmul(x, bias)
    if x.is_cuda:
        route = _triton_route(x, weight)
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


def _triton_route(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """The Triton product :func:`linear` runs for a CUDA input ``x [..., in]``: ``"gemv"`` (one bf16/fp16 row),
    ``"skinny"`` (2-16 rows, where :func:`~edgespec.kernels.triton_gemv.skinny_pays`) or None (torch)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (1 <= rows <= 16 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.stride(-1) == 1 and not torch.is_grad_enabled() and triton_available()):
        return None
    if rows == 1:
        return "gemv"
    from edgespec.kernels.triton_gemv import skinny_pays
    return "skinny" if skinny_pays(weight.shape[0], sm_count(x.device)) else None


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
