"""Per-row-scaled FP8 products on the GPU (:class:`~edgespec.weights.fp8_row.FP8RowWeight`: compressed-tensors
``strategy: channel`` / ``tensor`` and ModelOpt per-tensor FP8): the e4m3 bytes go to the tensor cores as they are
(widened to the activation dtype, exact) and each output row's scale multiplies the accumulated sums once, in the
epilogue. One byte a weight is read; nothing is dequantized to bf16 in memory.

Each program owns ``BLOCK_N`` output rows, one block of 16 activation rows (decode and verify: a row's result
does not depend on the other rows, so speculative verification equals plain decoding bit for bit; prefill takes
64-row blocks) and a range of 128-wide K tiles; narrow matrices split K (fp32 partials summed in a fixed order by
``edgespec.kernels.quant.triton_gemv``'s split-sum kernel). The torch reference is the format's
:meth:`~edgespec.weights.base.PackedWeight.matmul_ref`. With a one-hot activation row the product is the
reference's fp32 weight (``fp8 value * row scale``) exactly: the GPU tests check the layout that way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels import sm_count
from edgespec.kernels.launch.triton_pdl import pdl_launch, pdl_release, pdl_wait
from edgespec.kernels.quant.triton_quant_tiles import _finish
from edgespec.kernels.quant.triton_rowblock import RowBlockOutputs, choose_splits, row_block_program

BLOCK_K = 128
ROWS_16_MAX = 64        # up to this many rows the 16-row block runs (one launch shape for decode and verify)


@triton.jit
def _fp8_row_kernel(x_ptr, w_ptr, s_ptr, part_ptr, b_ptr, y_ptr, M, N, K, tiles_per_split, stride_xm, stride_wn,
                    stride_ps, stride_pm, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    PREC: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    m, m_ok, n, n_ok, pid_k = row_block_program(M, N, BLOCK_M, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(0, tiles_per_split):
        k = (pid_k * tiles_per_split + i) * BLOCK_K + kk
        if EVEN_K:
            w_mask = n_ok[:, None]
            x_mask = m_ok[:, None]
        else:
            w_mask = n_ok[:, None] & (k < K)[None, :]
            x_mask = m_ok[:, None] & (k < K)[None, :]
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=w_mask, other=0.0)
        xt = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        acc = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc, input_precision=PREC)
    pdl_release(PDL)
    acc = acc * tl.load(s_ptr + n, mask=n_ok, other=0.0)[None, :]     # the row scale, once per output
    _finish(acc, part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, stride_pm, stride_ym, True, DIRECT, HAS_BIAS)


def fp8_row_config(N: int, K: int, M: int, sms: int) -> dict[str, int]:
    """Launch of one product: decode/verify rows in 16-row blocks with 64 weight rows per program and K split on
    narrow matrices (about four programs per SM; the split depends on the matrix, never on M); prefill 64x64."""
    if M > ROWS_16_MAX:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
    block_n = 64
    splits = choose_splits(triton.cdiv(N, block_n), triton.cdiv(K, BLOCK_K), sms, min_tiles=2)
    return {"BLOCK_M": 16, "BLOCK_N": block_n, "SPLIT_K": splits, "num_warps": 4, "num_stages": 4}


def fp8_row_matmul(packed, x: torch.Tensor, bias: torch.Tensor | None = None,
                   config: dict[str, int] | None = None) -> torch.Tensor:
    """``x [..., in] @ (weight * weight_scale[:, None])^T (+ bias)`` on CUDA for an ``fp8_row`` weight; ``x`` bf16,
    fp16 or fp32, output in x's dtype."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_row product: x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.shape[-1] != packed.in_features:
        raise ValueError(f"fp8_row product: x {tuple(x.shape)} does not end in in_features={packed.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N, K = x2.shape[0], packed.out_features, packed.in_features
    cfg = {**fp8_row_config(N, K, M, sm_count(x.device)), **(config or {})}
    w, s = packed.weight, packed.weight_scale
    out = RowBlockOutputs.new(M, N, cfg["SPLIT_K"], x2)
    ps, pm = out.part_strides
    grid = (triton.cdiv(N, cfg["BLOCK_N"]) * triton.cdiv(M, cfg["BLOCK_M"]), out.splits)
    pdl = pdl_launch(x.device)
    _fp8_row_kernel[grid](x2, w, s, out.part, bias if bias is not None else out.y, out.y, M, N, K,
                          triton.cdiv(K, BLOCK_K) // out.splits, x2.stride(0), w.stride(0), ps, pm, out.y.stride(0),
                          BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=BLOCK_K, EVEN_K=K % BLOCK_K == 0,
                          DIRECT=out.direct, HAS_BIAS=bias is not None,
                          PREC="ieee" if x.dtype == torch.float32 else "tf32", PDL=bool(pdl),
                          num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl)
    return out.finish(bias, pdl).reshape(*lead, N)


def fp8_row_kernel(packed, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``PackedWeight.kernel`` signature: the Triton product for CUDA inputs without autograd, the torch
    reference otherwise."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and not torch.is_grad_enabled():
        return fp8_row_matmul(packed, x, bias)
    return packed.matmul_ref(x, bias)


def choose_fp8_row_kernel(packed):
    """:func:`fp8_row_kernel` for an ``fp8_row`` weight on a CUDA device of SM89 or newer (e4m3 conversions) with
    Triton, else None."""
    from edgespec.kernels import triton_available
    if getattr(packed, "format", None) != "fp8_row" or not triton_available():
        return None
    dev = packed.weight.device
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev) < (8, 9):
        return None
    if packed.weight.stride(-1) != 1 or packed.weight_scale.dtype != torch.float32:
        return None
    return fp8_row_kernel
