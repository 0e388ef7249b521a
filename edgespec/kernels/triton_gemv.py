"""One-row matrix-vector product ``y = x W^T`` in Triton, for batch-1 decode on a GPU.

A decode step is a chain of GEMVs whose cost should be the weight bytes over the memory bandwidth. cuBLAS picks
GEMM tiles for them (M padded to 8) and splits K with a separate reduction kernel on the narrow matrices; on an
H200 the Qwen3.5-4B decode's matrices stream at ~80% of copy bandwidth that way (tools/step_profile.py).

Here each program owns ``BLOCK_N`` output rows and walks the whole K extent in ``BLOCK_K`` slices: every weight
element is read once, coalesced along K, multiplied by the broadcast input slice and accumulated in fp32 per
row; no split-K, so no second kernel and no partial sums in memory. The input vector is tiny and stays in cache.
Contract: :func:`edgespec.kernels.linear.linear_ref` for one row (fp32 accumulation, output in x's dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr):
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
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv_config(N: int, K: int, sm_count: int) -> dict[str, int]:
    """Launch shape from the H200 sweep (``tools/gemv_bench.py --sweep``, docs/measurements/gemv_bench_h200.txt):
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
    from edgespec.kernels.triton_attention import _sm_count
    cfg = gemv_config(N, K, _sm_count(x.device))
    if config:
        cfg.update(config)
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else x, y, N, K, weight.stride(0),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], HAS_BIAS=bias is not None,
        EVEN_K=K % cfg["BLOCK_K"] == 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y
