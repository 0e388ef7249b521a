"""Many-row (prefill) products of the packed formats: a Triton kernel dequantizes a band of weight rows to the
activation dtype, and a tensor-core GEMM (cuBLAS, through ``torch.nn.functional.linear``) multiplies it.

Why not one fused kernel: at prefill sizes the product is bound by tensor-core arithmetic, not by weight bytes.
The fused decode kernels of ``edgespec.kernels.quant.triton_quant_gemv`` redo the dequantization for every 64-row block
of activations and split each 128-input tile into even/odd halves (strided activation loads), so at 512 rows they
ran well behind llama.cpp's quantized prefill. Dequantizing once per call costs ~2.5 extra bytes per weight (read
the packed band, write it in bf16), which a long GEMM hides: the band is then multiplied by cuBLAS at the dense
rate (figures: docs/benchmarks.md, "Design figures (H100)"). The band is bounded (:data:`BAND_ELEMENTS`), so the extra
memory is at most 128 MiB, never a second copy of the weights.

Each dequantization computes exactly what the format's ``dequantize_rows`` does (fp32 arithmetic, then one rounding
to the output dtype), so the band equals the torch reference's tile bit for bit; the tests compare them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Rows of activations from which the dequantize-then-GEMM path beats the fused kernels, per format. Up to 64 rows
# the fused kernels run one row block that decodes each weight once (``triton_quant_gemv.WIDE_MAX_ROWS``); past it
# 4-bit takes this path; block-FP8 streams its 1-byte weights fast enough in the fused tile up to 128 rows and
# loses from 512 (figures and command: docs/benchmarks.md, docs/quant_kernels.md).
DEQUANT_GEMM_MIN_ROWS = {"int4": 65, "nvfp4": 65, "fp8_block": 256}
# Weight elements dequantized per band: 64M x 2 bytes = 128 MiB of scratch at most (every matrix of a 3B llama is
# one band; a taller one is filled band by band, each band's output columns copied into place).
BAND_ELEMENTS = 1 << 26
# Band heights are multiples of this (the fp8 scale block and every kernel's BLOCK_N divide it).
BAND_ALIGN = 128


@triton.jit
def _int4_dequant_kernel(q_ptr, s_ptr, z_ptr, w_ptr, rows, row0, stride_qn, stride_sn, stride_zn, stride_wn,
                         GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """One group (``GROUP`` inputs) of ``BLOCK_N`` rows: value = (q - z) x s in fp32 (``Int4Weight``)."""
    HALF: tl.constexpr = GROUP // 2
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.program_id(1)
    ok = r < rows
    n = row0 + r
    j = tl.arange(0, HALF)
    b = tl.load(q_ptr + n[:, None] * stride_qn + (t * HALF + j)[None, :], mask=ok[:, None], other=0).to(tl.int32)
    z = tl.load(z_ptr + n * stride_zn + t, mask=ok, other=0).to(tl.float32)[:, None]
    s = tl.load(s_ptr + n * stride_sn + t, mask=ok, other=0.0).to(tl.float32)[:, None]
    lo = ((b & 15).to(tl.float32) - z) * s           # even inputs (low nibble)
    hi = ((b >> 4).to(tl.float32) - z) * s           # odd inputs
    k = t * GROUP + tl.arange(0, GROUP)
    tl.store(w_ptr + r[:, None] * stride_wn + k[None, :], tl.interleave(lo, hi).to(w_ptr.dtype.element_ty),
             mask=ok[:, None])


@triton.jit
def _nvfp4_dequant_kernel(q_ptr, s_ptr, scale2_ptr, w_ptr, rows, row0, stride_qn, stride_sn, stride_wn,
                          BLOCK_N: tl.constexpr):
    """128 inputs of ``BLOCK_N`` rows: value = e2m1 x (e4m3 scale x global scale) in fp32 (``NVFP4Weight``)."""
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.program_id(1)
    ok = r < rows
    n = row0 + r
    j = tl.arange(0, 64)
    b = tl.load(q_ptr + n[:, None] * stride_qn + (t * 64 + j)[None, :], mask=ok[:, None], other=0).to(tl.int32)
    sc = tl.load(s_ptr + n[:, None] * stride_sn + (t * 8 + tl.arange(0, 8))[None, :], mask=ok[:, None],
                 other=0.0).to(tl.float32) * tl.load(scale2_ptr)
    # e2m1 placed into fp16 bits (magnitude into exponent/mantissa, sign into bit 15) is the value x 2^-14 exactly
    lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0
    hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0
    # byte j holds inputs 2j and 2j + 1, both in scale block j // 8
    lo = tl.reshape(tl.reshape(lo, [BLOCK_N, 8, 8]) * sc[:, :, None], [BLOCK_N, 64])
    hi = tl.reshape(tl.reshape(hi, [BLOCK_N, 8, 8]) * sc[:, :, None], [BLOCK_N, 64])
    k = t * 128 + tl.arange(0, 128)
    tl.store(w_ptr + r[:, None] * stride_wn + k[None, :], tl.interleave(lo, hi).to(w_ptr.dtype.element_ty),
             mask=ok[:, None])


@triton.jit
def _fp8_block_dequant_kernel(q_ptr, s_ptr, w_ptr, rows, row0, K, stride_qn, stride_sn, stride_wn,
                              BO: tl.constexpr, BI: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``BLOCK_K`` inputs of ``BLOCK_N`` rows: value = e4m3 x its block's fp32 scale (``FP8BlockWeight``)."""
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (r < rows)[:, None] & (k < K)[None, :]
    n = row0 + r
    q = tl.load(q_ptr + n[:, None] * stride_qn + k[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (n // BO)[:, None] * stride_sn + (k // BI)[None, :], mask=ok, other=0.0)
    tl.store(w_ptr + r[:, None] * stride_wn + k[None, :], (q * s).to(w_ptr.dtype.element_ty), mask=ok)


def dequantize_band(packed, start: int, stop: int, dtype: torch.dtype, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Rows ``start:stop`` of a packed weight (contract buffer names) as a dense ``[stop - start, in]`` tensor of
    ``dtype`` on its device: the Triton twin of ``packed.dequantize_rows``."""
    if getattr(packed, "ggml_type", None) in (12, 13, 14):      # GGUF K-quants: edgespec.kernels.quant.triton_kquant
        from edgespec.kernels.quant.triton_kquant_decode import kquant_dequantize_band
        return kquant_dequantize_band(packed, start, stop, dtype, out)
    fmt = packed.format
    rows, K = stop - start, packed.in_features
    device = (packed.qweight if fmt == "int4" else packed.weight).device
    w = out if out is not None else torch.empty((rows, K), dtype=dtype, device=device)
    if fmt == "int4":
        g = packed.group_size
        block_n = max(8, min(64, 4096 // g))
        grid = (triton.cdiv(rows, block_n), K // g)
        _int4_dequant_kernel[grid](packed.qweight, packed.scales, packed.zeros, w, rows, start,
                                   packed.qweight.stride(0), packed.scales.stride(0), packed.zeros.stride(0),
                                   w.stride(0), GROUP=g, BLOCK_N=block_n, num_warps=4)
    elif fmt == "nvfp4":
        grid = (triton.cdiv(rows, 32), K // 128)
        _nvfp4_dequant_kernel[grid](packed.weight, packed.weight_scale, packed.weight_scale_2, w, rows, start,
                                    packed.weight.stride(0), packed.weight_scale.stride(0), w.stride(0),
                                    BLOCK_N=32, num_warps=4)
    elif fmt == "fp8_block":
        bo, bi = getattr(packed, "block", (128, 128))
        grid = (triton.cdiv(rows, 32), triton.cdiv(K, 128))
        _fp8_block_dequant_kernel[grid](packed.weight, packed.weight_scale_inv, w, rows, start, K,
                                        packed.weight.stride(0), packed.weight_scale_inv.stride(0), w.stride(0),
                                        BO=bo, BI=bi, BLOCK_N=32, BLOCK_K=128, num_warps=4)
    else:
        raise ValueError(f"no Triton dequantization for weight format {fmt!r}")
    return w


def band_rows(out_features: int, in_features: int) -> int:
    """Weight rows per band: the whole matrix when it fits :data:`BAND_ELEMENTS`, else the largest multiple of
    :data:`BAND_ALIGN` rows that does (a band never splits an fp8 scale block)."""
    if out_features * in_features <= BAND_ELEMENTS:
        return out_features
    return max(BAND_ALIGN, BAND_ELEMENTS // in_features // BAND_ALIGN * BAND_ALIGN)


def dequant_gemm(packed, x2: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x2 [M, in] @ W^T (+ bias)`` for many rows: each band of weight rows dequantized to ``x2.dtype`` and
    multiplied on the tensor cores. One band (most matrices) writes the output directly; taller matrices (an
    lm_head, a merged gate/up of a large model) fill the output's columns band by band."""
    N, K = packed.out_features, packed.in_features
    band = band_rows(N, K)
    if band >= N:
        return F.linear(x2, dequantize_band(packed, 0, N, x2.dtype), bias)
    y = torch.empty((x2.shape[0], N), dtype=x2.dtype, device=x2.device)
    scratch = torch.empty((band, K), dtype=x2.dtype, device=x2.device)
    for s in range(0, N, band):
        e = min(N, s + band)
        w = dequantize_band(packed, s, e, x2.dtype, out=scratch[:e - s])
        y[:, s:e] = F.linear(x2, w, None if bias is None else bias[s:e])
    return y
