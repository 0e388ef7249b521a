"""GGUF K-quant products on the GPU: Q4_K, Q5_K and Q6_K read in the file's own super-blocks (no repacking).

Layouts: :mod:`edgespec.weights.gguf_kquants` (whose ``_decode`` is the torch reference these kernels are tested
against, through :meth:`~edgespec.weights.base.PackedWeight.matmul_ref`). Why natively and not repacked into the
int4 tile: Q4_K's weight is ``d * sc * q - dmin * m`` per sub-block of 32, a float minimum, not an integer zero
point, so the int4 tile (``(q - z) * s``) cannot hold it exactly; a repack with a float scale and a float offset
per 32 weights would take 6 bits a weight against the file's 4.5. Reading the 144-byte super-blocks directly
keeps the file's bytes as the only copy and streams 4.5 bits a weight.
Each program owns ``BLOCK_N`` output rows and a range of super-blocks, and one 16-row block of activations (decode and
verify: a row's result never depends on how many rows ride with it, so speculative verification equals plain decoding
bit for bit). Prefill (more than 64 rows) decodes bands of rows once with the same operations
(:func:`~edgespec.kernels.quant.triton_kquant_decode.kquant_dequantize_band`) and multiplies them with cuBLAS, as the
other packed formats do (``edgespec.kernels.quant.triton_quant_prefill``):

* Q4_K / Q5_K (read as int32 words): each 64-input chunk (two sub-blocks) is decoded in registers to fp32 weights
  ``(d * sc) * q - dmin * m`` with ggml's operations and multiplied on the tensor cores in the activation dtype
  (bf16 rounds each weight once, as the int4 and NVFP4 tiles do; fp32 activations keep them exact);
* Q6_K (read as bytes: 210-byte super-blocks are not word aligned) has no minimum: its integer codes ``q - 32``
  (exact in bf16) meet the activations per group of 16, and ``d * sc`` scales the accumulated products.

Why: for Q4_K, applying the scales to per-sub-block sums instead (``dot(x, q) * d*sc - sum(x) * dmin*m``) compiled
(Triton 3.6, SM90, 32 rows per program) to 2898 PTX lines per super-block with 160 shuffles (a reduction of x per
sub-block) and 35 barriers, the decoded tile to 2172 lines, no shuffle and 11 barriers; for Q6_K, decoding to a
scaled tile compiled to more (3015 against 2473 lines: a second conversion per weight). Floating-point contraction
is off for these launches, so with a one-hot fp32 activation row the product is exactly the reference's fp32
weight: the GPU tests check the decode bit for bit that way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels import sm_count
from edgespec.kernels.launch.triton_pdl import pdl_launch, pdl_release, pdl_wait
from edgespec.kernels.options import active
from edgespec.kernels.quant.route import RouteFacts, linear_route
from edgespec.kernels.quant.triton_kquant_decode import LAYOUTS, _dmin_chunk, _dmin_head, _fp16_bits, _q5k_high_bits
from edgespec.kernels.quant.triton_quant_tiles import _finish
from edgespec.kernels.quant.triton_rowblock import RowBlockOutputs, choose_splits, row_block_program

# Up to this many activation rows the 16-row tile runs (one launch shape for decode and every verify).
ROWS_16_MAX = 64


@triton.jit
def _dmin_superblock(acc, x_ptr, w_ptr, m, m_ok, n, n_ok, sb, stride_xm, stride_wn, BLOCK_N: tl.constexpr,
                     WORDS: tl.constexpr, HAS_QH: tl.constexpr, PREC: tl.constexpr):
    """One Q4_K (``HAS_QH`` False, 36 words) or Q5_K (44 words) super-block of ``BLOCK_N`` rows into ``acc``:
    each 64-input chunk (two sub-blocks) decoded to a weight tile and multiplied on the tensor cores."""
    row = w_ptr + n * stride_wn + sb * WORDS
    d, dmin, s0, s1, s2 = _dmin_head(row, n_ok)
    qh = _q5k_high_bits(row, n_ok, BLOCK_N, HAS_QH)
    for c in tl.static_range(4):
        w = _dmin_chunk(row, n_ok, d, dmin, s0, s1, s2, qh, c, BLOCK_N, HAS_QH)
        k = sb * 256 + 64 * c + tl.arange(0, 64)
        xt = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
        acc = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc, input_precision=PREC)
    return acc


@triton.jit
def _q6k_superblock(acc, x_ptr, w_ptr, m, m_ok, n, n_ok, sb, stride_xm, stride_wn, PREC: tl.constexpr):
    """One Q6_K super-block (210 bytes) of ``BLOCK_N`` rows into ``acc``: 16 groups of 16 with an int8 scale."""
    row = w_ptr + n * stride_wn + sb * 210
    d_bits = tl.load(row + 208, mask=n_ok, other=0).to(tl.int32) | (tl.load(row + 209, mask=n_ok, other=0)
                                                                     .to(tl.int32) << 8)
    d = _fp16_bits(d_bits)
    l16 = tl.arange(0, 16)
    for h in tl.static_range(2):
        for r in tl.static_range(4):
            for s in tl.static_range(2):
                lane = 16 * s + l16                 # position in the 32-weight quarter
                ql = tl.load(row[:, None] + 64 * h + 32 * (r % 2) + lane[None, :], mask=n_ok[:, None], other=0)
                qh = tl.load(row[:, None] + 128 + 32 * h + lane[None, :], mask=n_ok[:, None], other=0)
                q = (((ql.to(tl.int32) >> (4 * (r // 2))) & 15) | (((qh.to(tl.int32) >> (2 * r)) & 3) << 4)) - 32
                g = 8 * h + 2 * r + s          # constexpr (unrolled loops)
                sc = tl.load(row + 192 + g, mask=n_ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
                k0 = sb * 256 + 128 * h + 32 * r + 16 * s
                xt = tl.load(x_ptr + m[:, None] * stride_xm + (k0 + l16)[None, :], mask=m_ok[:, None], other=0.0)
                part = tl.dot(xt, tl.trans(q.to(xt.dtype)), input_precision=PREC)
                acc += part * (d * sc)[None, :]
    return acc


@triton.jit
def _kquant_kernel(x_ptr, w_ptr, part_ptr, b_ptr, y_ptr, M, N, sb_per_split, stride_xm, stride_wn, stride_ps,
                   stride_pm, stride_ym, KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    m, m_ok, n, n_ok, pid_k = row_block_program(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(0, sb_per_split):
        sb = pid_k * sb_per_split + i
        if KIND == 14:
            acc = _q6k_superblock(acc, x_ptr, w_ptr, m, m_ok, n, n_ok, sb, stride_xm, stride_wn, PREC)
        else:
            acc = _dmin_superblock(acc, x_ptr, w_ptr, m, m_ok, n, n_ok, sb, stride_xm, stride_wn, BLOCK_N,
                                   36 if KIND == 12 else 44, KIND == 13, PREC)
    pdl_release(PDL)
    _finish(acc, part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, stride_pm, stride_ym, True, DIRECT, HAS_BIAS)


def kquant_config(N: int, K: int, M: int, sms: int) -> dict[str, int]:
    """Launch of one product. Decode/verify (up to :data:`ROWS_16_MAX` rows): 16-row blocks, 32 weight rows per
    program, K split so about four programs run per SM on narrow matrices; the split depends on the matrix only,
    never on M (a row's sums then run in the same order at every row count). More rows take dequantize-then-GEMM;
    ``DEQUANT=0`` forces the fused tile there (64x64, no split)."""
    if M > ROWS_16_MAX:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}
    block_n = 32
    splits = choose_splits(triton.cdiv(N, block_n), K // 256, sms)
    return {"BLOCK_M": 16, "BLOCK_N": block_n, "SPLIT_K": splits, "num_warps": 4, "num_stages": 3}


def kquant_matmul(packed, x: torch.Tensor, bias: torch.Tensor | None = None,
                  config: dict[str, int] | None = None) -> torch.Tensor:
    """``x [..., in] @ W^T (+ bias)`` for a Q4_K / Q5_K / Q6_K weight (``packed.blocks``, ``packed.ggml_type``)
    on CUDA; ``x`` bf16, fp16 or fp32 (fp32: exact products on the tensor cores' fp32 path, for the tests). The
    rows ``linear_route`` sends to the CUDA-core GEMV (1..4) go there (``edgespec.kernels.quant.triton_kquant_gemv``)
    unless ``config`` has ``TILES=1`` (the tensor-core tiles at any row count: tests and sweeps)."""
    kind = int(packed.ggml_type)
    if kind not in LAYOUTS:
        raise ValueError(f"{packed.format}: no K-quant GPU product for ggml type {kind}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{packed.format} product: x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.shape[-1] != packed.in_features:
        raise ValueError(f"{packed.format} product: x {tuple(x.shape)} does not end in in_features="
                         f"{packed.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N, K = x2.shape[0], packed.out_features, packed.in_features
    facts = RouteFacts(cuda=True, triton=True, options=active())
    if not (config or {}).get("TILES", 0) and linear_route(M, packed.format, (N, K), facts) == "kquant_gemv":
        from edgespec.kernels.quant.triton_kquant_gemv import kquant_gemv
        return kquant_gemv(packed, x2, bias).reshape(*lead, N)
    cfg = {**kquant_config(N, K, M, sm_count(x.device)), **(config or {})}
    if cfg.get("DEQUANT", int(M > ROWS_16_MAX)):
        # prefill: bands of rows decoded once, multiplied by cuBLAS (edgespec.kernels.quant.triton_quant_prefill)
        from edgespec.kernels.quant.triton_quant_prefill import dequant_gemm
        return dequant_gemm(packed, x2, bias).reshape(*lead, N)
    w = packed.blocks.view(LAYOUTS[kind][1])
    out = RowBlockOutputs.new(M, N, cfg["SPLIT_K"], x2)
    ps, pm = out.part_strides
    grid = (triton.cdiv(N, cfg["BLOCK_N"]) * triton.cdiv(M, cfg["BLOCK_M"]), out.splits)
    pdl = pdl_launch(x.device)
    _kquant_kernel[grid](x2, w, out.part, bias if bias is not None else out.y, out.y, M, N, K // 256 // out.splits,
                         x2.stride(0), w.stride(0), ps, pm, out.y.stride(0), KIND=kind, BLOCK_M=cfg["BLOCK_M"],
                         BLOCK_N=cfg["BLOCK_N"], DIRECT=out.direct, HAS_BIAS=bias is not None,
                         PREC="ieee" if x.dtype == torch.float32 else "tf32", PDL=bool(pdl),
                         num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=False, **pdl)
    return out.finish(bias, pdl).reshape(*lead, N)


def kquant_kernel(packed, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``PackedWeight.kernel`` signature: the Triton product for CUDA inputs without autograd, the torch
    reference (``packed.matmul_ref``) otherwise."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and not torch.is_grad_enabled():
        return kquant_matmul(packed, x, bias)
    return packed.matmul_ref(x, bias)


def choose_kquant_kernel(packed):
    """:func:`kquant_kernel` for a K-quant GGUF weight on a CUDA device of SM80 or newer with Triton, else None."""
    from edgespec.kernels import triton_available
    if int(getattr(packed, "ggml_type", -1)) not in LAYOUTS or not triton_available():
        return None
    dev = packed.blocks.device
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev) < (8, 0) or packed.in_features % 256:
        return None
    return kquant_kernel
