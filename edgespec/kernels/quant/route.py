"""Which product :func:`edgespec.kernels.quant.linear.linear` runs for a call: :func:`linear_route` over the rows,
the weight's format and shape, and the facts of the device (:class:`RouteFacts`), with the row bounds of each
kernel. Plain data and rules, no kernel: the Triton products read their bounds here without importing the
dispatcher that calls them."""

from __future__ import annotations

from typing import NamedTuple

import torch

from edgespec.kernels.options import KernelOptions, active
from edgespec.weights.base import known_format

# Up to this many rows, one GEMV per row beats a GEMM on small-M shapes (docs/benchmarks.md, "CPU launch choices").
ROWS_MAX = 8
# The products linear() runs, by name: what linear_route returns and a RouteLog counts.
ROUTES = ("packed", "gemv", "skinny", "cublas", "blas", "native", "torch", "kquant_gemv")
# Rows of the skinny GEMM's one 16-row tile (edgespec.kernels.quant.triton_gemv): more rows go to cuBLAS.
SKINNY_MAX_ROWS = 16
# GGUF K-quant weights: up to this many rows on CUDA take the CUDA-core GEMV that reads the file's super-blocks
# (edgespec.kernels.quant.triton_kquant_gemv), more rows the tensor-core tiles (edgespec.kernels.quant.triton_kquant).
# Measured on the peer Q4_K_M file (H200, tools/kquant_gemv_bench.py; docs/benchmarks.md): at one row the GEMV beats the
# tiles on all but the smallest matrix (300 -> 421 tok/s for the whole model); at four rows it loses on every Q4_K
# matrix (its per-row work) and wins on the Q6_K ones. Q5_K runs Q4_K's kernel, so it takes Q4_K's bound.
KQUANT_GEMV_ROWS = {"gguf_q4_k": 1, "gguf_q5_k": 1, "gguf_q6_k": 4}
KQUANT_FORMATS = tuple(KQUANT_GEMV_ROWS)


class RouteFacts(NamedTuple):
    """What :func:`linear_route` reads besides the rows, the format and the shape: where the call runs and what is
    in force there. :func:`linear` reads them off its tensors for every call (a tuple: cheap to build on the
    decode path); a test states them."""

    cuda: bool                   # the input lives on a CUDA device
    triton: bool = False         # the Triton kernels can run there (Triton imports, CUDA present)
    sms: int = 132               # multiprocessors of that device (the skinny GEMM's width rule)
    cpu_blas: bool = False       # fp32 CPU linears take OpenBLAS now (configure_cpu; torch single-threaded)
    grad: bool = False           # autograd records the call: only torch's products have a backward
    row_major: bool = True       # the weight's rows are contiguous, as the Triton kernels read them
    options: KernelOptions = KernelOptions()
    cpu_native: bool = False     # the compiled CPU product reads this weight (edgespec.kernels.cpu.gguf_native built,


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
