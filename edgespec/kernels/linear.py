"""Linear layers ``y = x W^T + b``: Triton GEMV / skinny GEMM for few rows on CUDA, and a CPU path that streams the
weights at DRAM speed. (The GPU side is described in ``edgespec.kernels.triton_gemv``; this note is the CPU side.)

A batch-1 forward on CPU is a chain of matrix-vector products: it should cost the bytes of the weights over the
memory bandwidth. torch's fp32 CPU matmul goes through MKL, which on the AMD (AVX2) CPUs we run CI and the demo on
streams well below what the same cores read with a plain reduction; the OpenBLAS that numpy bundles runs the same
one-row product about twice as fast (``tools/cpu_matmul_bench.py`` prints the comparison; figures:
docs/benchmarks.md, "CPU launch choices"). So on CPU in fp32:

* up to :data:`ROWS_MAX` rows (decode and short verifies) run as one OpenBLAS GEMV per row over blocks of the
  weight small enough to stay in the last-level cache, so the weight comes from DRAM once per forward however many
  rows there are. Each row is then the very same GEMV whatever the row count, so a verify row rounds exactly like a
  plain decode step of the same token (speculative output equals plain output bit for bit on this path);
* more rows (prefill, long verifies) run as one OpenBLAS GEMM.

OpenBLAS runs its own threads. Two thread pools spinning on two cores fight (a forward many times slower), so the
BLAS path is taken only while torch's intra-op pool is single-threaded:
:func:`configure_cpu` sets that up, and anything that raises torch's thread count again falls back to torch's
matmul automatically. :func:`linear_ref` is the torch reference the tests compare against.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from edgespec.kernels import sm_count, triton_available
from edgespec.kernels.options import KernelOptions, active
from edgespec.weights.base import is_packed, known_format

# Up to this many rows, one GEMV per row beats a GEMM on small-M shapes (docs/benchmarks.md, "CPU launch choices").
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
        # that was descheduled, many times the product's own time (a DFlash cycle of the CPU demo: drafter layers
        # on BLAS, verify on the GGUF pool; docs/benchmarks.md, "CPU launch choices"). One BLAS thread per
        # process avoids it.
        from threadpoolctl import threadpool_limits
        if _blas_limit is None:
            _blas_limit = threadpool_limits(1, user_api="blas")


def cpu_blas_active() -> bool:
    """True when fp32 CPU linears currently take the OpenBLAS path."""
    return _enabled and torch.get_num_threads() == 1


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference."""
    return F.linear(x, weight, bias)


# The products linear() runs, by name: what linear_route returns and a RouteLog counts.
ROUTES = ("packed", "gemv", "skinny", "cublas", "blas", "native", "torch", "kquant_gemv")
# Rows of the skinny GEMM's one 16-row tile (edgespec.kernels.triton_gemv): more rows go to cuBLAS.
SKINNY_MAX_ROWS = 16
# GGUF K-quant weights: up to this many rows on CUDA take the CUDA-core GEMV that reads the file's super-blocks
# (edgespec.kernels.triton_kquant_gemv), more rows the tensor-core tiles (edgespec.kernels.triton_kquant). On
# the peer Q4_K_M file (H200, tools/kquant_gemv_bench.py; docs/benchmarks.md) the GEMV beats the tiles at one row on
# all but the smallest matrix; at four rows it loses on every Q4_K matrix (its per-row work) and wins on the Q6_K
# ones. Q5_K runs Q4_K's kernel, so it takes Q4_K's bound.
KQUANT_GEMV_ROWS = {"gguf_q4_k": 1, "gguf_q5_k": 1, "gguf_q6_k": 4}
KQUANT_FORMATS = tuple(KQUANT_GEMV_ROWS)


class RouteFacts(NamedTuple):
    """What :func:`linear_route` reads besides the rows, the format and the shape: where the call runs and what is
    in force there. :func:`linear` reads them off its tensors for every call (a tuple: cheap to build on the
    decode path); a test states them."""

    cuda: bool                   # the input lives on a CUDA device
    triton: bool = False         # the Triton kernels can run there (Triton imports, CUDA present)
    sms: int = 132               # multiprocessors of that device (the skinny GEMM's width rule)
    cpu_blas: bool = False       # fp32 CPU linears take OpenBLAS (configure_cpu; torch single-threaded)
    grad: bool = False           # autograd records the call: only torch's products have a backward
    row_major: bool = True       # the weight's rows are contiguous, as the Triton kernels read them
    options: KernelOptions = KernelOptions()
    cpu_native: bool = False     # the compiled CPU product reads this weight (edgespec.kernels.gguf_native built,
                                 # contiguous rows, in_features a multiple of 32)


def skinny_pays(N: int, sm_count: int, options: KernelOptions | None = None) -> bool:
    """Whether :func:`linear` sends 2-16 rows on a matrix of output width ``N`` to the skinny GEMM rather than
    cuBLAS: always, unless the ``skinny`` kernel option is ``wide`` (``EDGESPEC_SKINNY=wide``, a tuning override for
    A/B runs; ``options``: those in force unless given) keeps the narrow matrices (fewer 64-row blocks than SMs) on
    cuBLAS.

    Why always: taken one at a time, cuBLAS and the skinny GEMM are about level on narrow matrices, but the cuBLAS
    kernels do not take part in programmatic dependent launch: each one stops the overlap of a kernel's start
    with its predecessor's tail that every Triton kernel of a step has (figures: docs/benchmarks.md, "Kernel
    launch choices")."""
    return (options or active()).skinny == "all" or -(-N // 64) >= sm_count


def linear_route(rows: int, fmt: str, shape: tuple[int, int], facts: RouteFacts) -> str:
    """The product :func:`linear` runs (one of :data:`ROUTES`) for ``rows`` input rows against a weight of
    ``shape`` ``[out, in]`` and format ``fmt``: a packed format's name (the weight computes its own product:
    ``packed``), or for a dense weight the dtype name input and weight share (``bfloat16``, ``float16``,
    ``float32``, ...; ``mixed`` when they differ).

    On CUDA one bf16/fp16 row takes the Triton GEMV (``gemv``), 2-16 rows the skinny GEMM where
    :func:`skinny_pays` (``skinny``), anything else ``cublas`` (torch's CUDA product); on the CPU fp32 up to
    :data:`ROWS_MAX` rows takes the compiled product (``native``: the kernels of the packed GGUF weights and the
    layer stack, so a per-layer forward rounds as the stack does), more rows OpenBLAS while it is active
    (``blas``), anything else ``torch``. Gradients, a strided weight or no Triton always
    leave the Triton kernels out. A GGUF K-quant weight on its Triton products (``triton``: the arch hooks chose
    them) takes the CUDA-core GEMV for 1..:data:`KQUANT_GEMV_ROWS` rows of its format (``kquant_gemv``), its own
    tiles beyond (``packed``)."""
    if rows < 0 or len(shape) != 2 or min(shape) < 0:
        raise ValueError(f"linear route of {rows} rows against a weight of shape {tuple(shape)}: give rows >= 0 "
                         "and an [out, in] shape")
    if known_format(fmt):                   # before the dtypes: torch has an int4 dtype too
        kquant_ok = fmt in KQUANT_FORMATS and facts.cuda and facts.triton and not facts.options.no_triton
        if kquant_ok and not facts.grad and 1 <= rows <= KQUANT_GEMV_ROWS[fmt]:
            return "kquant_gemv"
        return "packed"
    if not (fmt == "mixed" or isinstance(getattr(torch, fmt, None), torch.dtype)):
        raise ValueError(f"linear route of format {fmt!r}: neither a packed weight format nor a torch dtype")
    if facts.cuda:
        triton_ok = facts.triton and not facts.options.no_triton and facts.row_major and not facts.grad
        if triton_ok and fmt in ("bfloat16", "float16") and 1 <= rows <= SKINNY_MAX_ROWS:
            if rows == 1:
                return "gemv"
            if skinny_pays(shape[0], facts.sms, facts.options):
                return "skinny"
        return "cublas"
    if fmt == "float32" and facts.cpu_native and not facts.grad and 1 <= rows <= ROWS_MAX:
        return "native"
    return "blas" if fmt == "float32" and facts.cpu_blas and not facts.grad else "torch"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., in] @ weight[out, in]^T (+ bias)`` by the product :func:`linear_route` names: on CUDA one
    bf16/fp16 row goes to the Triton GEMV and 2-16 rows to the skinny GEMM (``edgespec.kernels.triton_gemv``;
    :func:`skinny_pays` says why not cuBLAS), on CPU fp32 to OpenBLAS when active; everything else to torch. A
    packed weight (:class:`edgespec.weights.PackedWeight`) computes its own product."""
    route = _route_of(x, weight)
    if _route_log is not None:
        _route_log[route] += 1
    if route == "packed":
        return weight.matmul(x, bias)
    if route == "kquant_gemv":
        from edgespec.kernels.triton_kquant_gemv import kquant_gemv
        x2 = x.reshape(-1, x.shape[-1])
        return kquant_gemv(weight, x2 if x2.stride(-1) == 1 else x2.contiguous(), bias).reshape(
            *x.shape[:-1], weight.out_features)
    if route in ("gemv", "skinny"):
        from edgespec.kernels.triton_gemv import gemv_triton, skinny_gemm_triton
        product = gemv_triton if route == "gemv" else skinny_gemm_triton
        return product(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    if route == "native":
        return _native_linear(x, weight, bias)
    if route != "blas":
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.from_numpy(blas_matmul_t(x2.contiguous().numpy(), weight.detach().numpy()))
    if bias is not None:
        out += bias
    return out.reshape(*lead, weight.shape[0])


def _route_of(x: torch.Tensor, weight: torch.Tensor) -> str:
    """:func:`linear_route` with the rows, format, shape and facts of this call's tensors."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if is_packed(weight):
        # a packed weight's own kernel (chosen by the arch hooks) says whether its Triton products run here
        triton = x.is_cuda and weight.kernel is not None
        return linear_route(rows, weight.format, (weight.out_features, weight.in_features),
                            RouteFacts(x.is_cuda, triton, grad=torch.is_grad_enabled(), options=active()))
    fmt = _DTYPE_NAMES.get(weight.dtype) or str(weight.dtype).removeprefix("torch.")
    if weight.dtype != x.dtype:
        fmt = "mixed"
    cuda = x.is_cuda
    native = (not cuda and weight.dtype == torch.float32 and weight.shape[-1] % 32 == 0 and weight.is_contiguous()
              and _native_built())
    facts = RouteFacts(cuda, cuda and triton_available(), sm_count(x.device) if cuda else 0,
                       not cuda and cpu_blas_active(), torch.is_grad_enabled(), weight.stride(-1) == 1, active(),
                       native)
    return linear_route(rows, fmt, weight.shape, facts)


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


_native_on = True     # the compiled fp32 CPU product may take small row counts (use_native_cpu)


def use_native_cpu(enabled: bool) -> bool:
    """Let fp32 CPU linears of up to :data:`ROWS_MAX` rows take the compiled product (``enabled``) or keep them on
    torch's / OpenBLAS's matmul (a comparison with transformers wants torch's summation order); returns the
    previous value."""
    global _native_on
    was, _native_on = _native_on, enabled
    return was


def _native_built() -> bool:
    from edgespec.kernels import gguf_native
    return _native_on and gguf_native.library() is not None


def _native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` for fp32 ``weight`` rows by the compiled product (every row as in a one-row call)."""
    from edgespec.kernels import gguf_native
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape[0], weight.shape[0])
    gguf_native.matmul(0, weight, weight.shape[0], weight.shape[1], x2, out, gguf_native.threads())
    if bias is not None:
        out += bias
    return out.reshape(*lead, weight.shape[0])


_route_log: Counter[str] | None = None     # counts of the routes taken while a route_log() block runs


@contextmanager
def route_log() -> Iterator[Counter[str]]:
    """Count the products :func:`linear` runs inside the block by route name (a test or a probe checks which
    product really ran, with no mock); nothing is counted outside such a block."""
    global _route_log
    outer, _route_log = _route_log, Counter()
    try:
        yield _route_log
    finally:
        _route_log = outer


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
