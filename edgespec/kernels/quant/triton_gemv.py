"""Few-row products ``y = x W^T`` in Triton for batch-1 decoding on a GPU: a GEMV for one row (decode) and a
skinny GEMM for 2-16 rows (verify, DFlash blocks).

A decode step is a chain of GEMVs whose cost should be the weight bytes over the memory bandwidth. cuBLAS picks
GEMM tiles for them (M padded to 8) and splits K with a separate reduction kernel on the narrow matrices, well
short of copy bandwidth (tools/step_profile.py; docs/benchmarks.md, "Design figures").

Here each program owns ``BLOCK_N`` output rows and walks the whole K extent in ``BLOCK_K`` slices: every weight
element is read once, coalesced along K, multiplied by the broadcast input slice and accumulated in fp32 per
row; no split-K, so no second kernel and no partial sums in memory. The input vector is tiny and stays in cache.
Verify rows go through :func:`skinny_gemm_triton`: the same weight streaming with the rows as one 16-row
tensor-core tile (cuBLAS's 16-row kernels run slower than its own one-row ones).
Contract: :func:`edgespec.kernels.quant.linear.linear_ref` (fp32 accumulation, output in x's dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels import sm_count
from edgespec.kernels.launch.triton_pdl import pdl_enter, pdl_launch, pdl_release, pdl_wait
from edgespec.kernels.quant.route import SKINNY_MAX_ROWS


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_wait(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for i in range(0, tl.cdiv(K, BLOCK_K)):
        k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + k)
            w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = k < K
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
            w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    pdl_release(PDL)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv_config(N: int, K: int, sm_count: int) -> dict[str, int]:
    """Launch shape from the H200 sweep (``tools/gemv_bench.py --sweep``):
    long rows (K >= 4096) go best as 2 rows per program over 1024-wide K slices; shorter rows as 8-16 rows per
    program over 256-wide slices, with deeper pipelining for the wide matrices."""
    if K >= 4096:
        return {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 4 if K >= 8192 else 2}
    block_k = min(256, triton.next_power_of_2(K))
    if N >= 12000:
        return {"BLOCK_N": 16, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 4}
    block_n = 8
    while block_n > 1 and triton.cdiv(N, block_n) < 2 * sm_count:    # small N: keep the chip covered
        block_n //= 2
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 2}


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: dict[str, int] | None = None) -> torch.Tensor:
    """``x [1, K] @ weight[N, K]^T (+ bias)`` -> ``[1, N]`` in x's dtype. ``config`` overrides the launch."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [1, K] and [N, K]")
    if weight.stride(1) != 1:
        raise ValueError("gemv: weight rows must be contiguous")
    N, K = weight.shape
    x = x.contiguous()
    cfg = _launch_config(gemv_config(N, K, sm_count(x.device)), config)
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    pdl = pdl_launch(x.device)
    _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else x, y, N, K, weight.stride(0),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], HAS_BIAS=bias is not None,
        EVEN_K=K % cfg["BLOCK_K"] == 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        PDL=bool(pdl), **pdl,
    )
    return y


def _launch_config(default: dict[str, int], config: dict[str, int] | None) -> dict[str, int]:
    """The launch of a GEMV or skinny product: the shape's default with the caller's overrides."""
    return {**default, **(config or {})}


# ---- a few rows (verify, DFlash blocks): tensor-core tiles over a 16-row block -----------------------------------
# (which matrices take it rather than cuBLAS: edgespec.kernels.quant.route.linear_route / skinny_pays)

@triton.jit
def _skinny_kernel(x_ptr, w_ptr, part_ptr, b_ptr, y_ptr, M, N, K, k_per_split, stride_xm,
                   stride_wn, stride_ps, stride_pm, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DIRECT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    lo = pid_k * k_per_split
    hi = tl.minimum(lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hi
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    pdl_release(PDL)
    out_ok = (m[:, None] < M) & (n[None, :] < N)
    if DIRECT:          # no K split: finish here (bias, rounding to the output dtype)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_ok)
    else:
        tl.store(part_ptr + pid_k * stride_ps + m[:, None] * stride_pm + n[None, :], acc, mask=out_ok)


@triton.jit
def _split_sum_kernel(part_ptr, b_ptr, y_ptr, M, N, n_splits, stride_ps, stride_pm, stride_ym,
                      HAS_BIAS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    s = tl.arange(0, SPLITS_P2)
    ok = (s[:, None] < n_splits) & (n[None, :] < N)
    parts = tl.load(part_ptr + s[:, None] * stride_ps + row * stride_pm + n[None, :], mask=ok, other=0.0)
    y = tl.sum(parts, axis=0)              # fixed order: the same bits on every run (no atomics)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n < N)


def skinny_config(N: int, K: int, sm_count: int) -> dict[str, int]:
    """64 weight rows per program, 32 on tiny matrices (under 4 M elements: a handful of programs would each wait
    out the whole latency chain alone); narrow matrices (fewer row blocks than SMs) split K about until there is
    one program per SM, keeping at least 384 K elements per split. Chosen from tools/gemv_bench.py --sweep-rows
    (16 rows; figures: docs/benchmarks.md, "Design figures")."""
    block_n, block_k = (32 if N * K < (4 << 20) else 64), 128
    n_blocks = triton.cdiv(N, block_n)
    splits = 1 if n_blocks >= sm_count else max(1, min(round(sm_count / n_blocks), K // 384))
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": splits, "num_warps": 4, "num_stages": 4}


def skinny_gemm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       config: dict[str, int] | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias)`` for ``2 <= M <= 16`` rows -> ``[M, N]`` in x's dtype.

    The rows are one 16-row tensor-core tile, so each weight element is read once whatever M is; narrow matrices
    split K over more programs and sum the fp32 partials in a fixed order in a second small kernel (no atomics:
    the same bits on every run). The launch depends on N and K only and each output element on its own row only,
    so a row's result is the same whatever M is."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"skinny gemm: x {tuple(x.shape)}, weight {tuple(weight.shape)} (rows 1..16, contiguous)")
    M, K = x.shape
    N = weight.shape[0]
    if not 1 <= M <= SKINNY_MAX_ROWS or weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"skinny gemm: x {tuple(x.shape)}, weight {tuple(weight.shape)} (rows 1..16, contiguous)")
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = _launch_config(skinny_config(N, K, sm_count(x.device)), config)
    splits = cfg["SPLIT_K"]
    k_per_split = triton.cdiv(triton.cdiv(K, splits), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    splits = triton.cdiv(K, k_per_split)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    direct = splits == 1
    part = y if direct else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    b = bias if bias is not None else y
    pdl = pdl_launch(x.device)
    _skinny_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), splits)](
        x, weight, part, b, y, M, N, K, k_per_split, x.stride(0), weight.stride(0),
        part.stride(0) if not direct else 0, part.stride(1) if not direct else 0, y.stride(0),
        BLOCK_M=16, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], DIRECT=direct,
        HAS_BIAS=bias is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        PDL=bool(pdl), **pdl,
    )
    if direct:
        return y
    block = 1024
    _split_sum_kernel[(M, triton.cdiv(N, block))](
        part, bias if bias is not None else part, y, M, N, splits, part.stride(0), part.stride(1), y.stride(0),
        HAS_BIAS=bias is not None, SPLITS_P2=max(2, triton.next_power_of_2(splits)), BLOCK=block, num_warps=4,
        PDL=bool(pdl), **pdl,
    )
    return y
