"""GGUF K-quant super-blocks decoded in Triton: the layouts the kernels read the blocks as, the register decode of
Q4_K / Q5_K / Q6_K (ggml's operations, the reference's fp32 weights) shared by the tensor-core tiles
(:mod:`edgespec.kernels.quant.triton_kquant`) and the CUDA-core GEMV
(:mod:`edgespec.kernels.quant.triton_kquant_gemv`), and the decode launches of whole rows: a band for the
many-row products (``triton_quant_prefill``) and the rows of an embedding lookup."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ggml type -> (bytes per 256-weight super-block, element the kernel reads the blocks as).
LAYOUTS = {12: (144, torch.int32), 13: (176, torch.int32), 14: (210, torch.uint8)}


@triton.jit
def _fp16_bits(bits):
    """The low 16 bits of an int32 tensor read as fp16, widened to fp32 (exact)."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale_min(s0, s1, s2, j: tl.constexpr):
    """6-bit scale and min of sub-block ``j`` from the three scale words (ggml's ``get_scale_min_k4``)."""
    if j < 4:
        sc = (s0 >> (8 * j)) & 63
        mn = (s1 >> (8 * j)) & 63
    else:
        sh: tl.constexpr = 8 * (j - 4)
        sc = ((s2 >> sh) & 0xF) | (((s0 >> (sh + 6)) & 3) << 4)
        mn = ((s2 >> (sh + 4)) & 0xF) | (((s1 >> (sh + 6)) & 3) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _word_bytes(words, BLOCK_N: tl.constexpr):
    """``[BLOCK_N, 8]`` int32 words -> ``[BLOCK_N, 32]`` their bytes in memory order (little-endian)."""
    shifts = 8 * tl.arange(0, 4)
    return tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xFF, [BLOCK_N, 32])


@triton.jit
def _dmin_weights(q, d, dmin, sc, mn):
    """Sub-block weights ``(d * sc) * q - dmin * m`` in fp32, ggml's order of operations (``q [BLOCK_N, 32]``)."""
    return (d * sc)[:, None] * q.to(tl.float32) - (dmin * mn)[:, None]


@triton.jit
def _dmin_head(row, n_ok):
    """``d``, ``dmin`` (fp32) and the three scale words of a Q4_K / Q5_K super-block (``row``: its first word)."""
    head = tl.load(row, mask=n_ok, other=0)
    s0 = tl.load(row + 1, mask=n_ok, other=0)
    s1 = tl.load(row + 2, mask=n_ok, other=0)
    s2 = tl.load(row + 3, mask=n_ok, other=0)
    return _fp16_bits(head), _fp16_bits(head >> 16), s0, s1, s2


@triton.jit
def _dmin_chunk(row, n_ok, d, dmin, s0, s1, s2, qh, c: tl.constexpr, BLOCK_N: tl.constexpr, HAS_QH: tl.constexpr):
    """Weights of inputs ``64c .. 64c+63`` of a Q4_K / Q5_K super-block, fp32 ``[BLOCK_N, 64]``: sub-block ``2c``
    (low nibbles) then ``2c + 1`` (high nibbles); ``qh``: Q5_K's fifth bits as ``[BLOCK_N, 32]`` bytes."""
    QS: tl.constexpr = 12 if HAS_QH else 4          # first word of the nibbles
    w8 = tl.arange(0, 8)
    qb = _word_bytes(tl.load(row[:, None] + QS + 8 * c + w8[None, :], mask=n_ok[:, None], other=0), BLOCK_N)
    lo = qb & 15
    hi = qb >> 4
    if HAS_QH:
        lo += ((qh >> (2 * c)) & 1) << 4
        hi += ((qh >> (2 * c + 1)) & 1) << 4
    sc, mn = _scale_min(s0, s1, s2, 2 * c)
    w_lo = _dmin_weights(lo, d, dmin, sc, mn)
    sc, mn = _scale_min(s0, s1, s2, 2 * c + 1)
    w_hi = _dmin_weights(hi, d, dmin, sc, mn)
    return tl.reshape(tl.permute(tl.join(w_lo, w_hi), (0, 2, 1)), [BLOCK_N, 64])


@triton.jit
def _q5k_high_bits(row, n_ok, BLOCK_N: tl.constexpr, HAS_QH: tl.constexpr):
    """Q5_K's ``qh`` bytes ``[BLOCK_N, 32]`` (zeros for Q4_K, never read: the compiler drops them)."""
    if HAS_QH:
        w8 = tl.arange(0, 8)
        return _word_bytes(tl.load(row[:, None] + 4 + w8[None, :], mask=n_ok[:, None], other=0), BLOCK_N)
    return tl.zeros([BLOCK_N, 32], tl.int32)


@triton.jit
def _q6k_quarter(row, n_ok, d, h: tl.constexpr, r: tl.constexpr):
    """fp32 weights ``(d * sc) * (q - 32)`` of quarter ``r`` of half ``h`` of a Q6_K super-block: ``[BLOCK_N, 32]``."""
    lane = tl.arange(0, 32)
    ql = tl.load(row[:, None] + 64 * h + 32 * (r % 2) + lane[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
    qh = tl.load(row[:, None] + 128 + 32 * h + lane[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
    q = (((ql >> (4 * (r // 2))) & 15) | (((qh >> (2 * r)) & 3) << 4)) - 32
    g = 8 * h + 2 * r                          # the quarter's two scale groups: g, g + 1 (constexpr)
    sc0 = tl.load(row + 192 + g, mask=n_ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    sc1 = tl.load(row + 193 + g, mask=n_ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return tl.where(lane[None, :] < 16, (d * sc0)[:, None], (d * sc1)[:, None]) * q.to(tl.float32)


@triton.jit
def _kquant_dequant_kernel(w_ptr, out_ptr, idx_ptr, rows, row0, stride_wn, stride_on, KIND: tl.constexpr,
                           BLOCK_N: tl.constexpr, GATHER: tl.constexpr):
    """One super-block (program axis 1) of ``BLOCK_N`` rows decoded to ``out`` (the reference's fp32 weights,
    then one rounding to ``out``'s dtype): weight rows ``row0 + r``, or ``idx[r]`` (``GATHER``: an embedding
    lookup)."""
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = r < rows
    if GATHER:
        n = tl.load(idx_ptr + r, mask=ok, other=0)
    else:
        n = row0 + r
    sb = tl.program_id(1)
    dst = out_ptr + r[:, None] * stride_on + sb * 256
    if KIND == 14:
        row = w_ptr + n * stride_wn + sb * 210
        d = _fp16_bits(tl.load(row + 208, mask=ok, other=0).to(tl.int32)
                       | (tl.load(row + 209, mask=ok, other=0).to(tl.int32) << 8))
        for h in tl.static_range(2):
            for q4 in tl.static_range(4):
                w = _q6k_quarter(row, ok, d, h, q4)
                k = 128 * h + 32 * q4 + tl.arange(0, 32)
                tl.store(dst + k[None, :], w.to(out_ptr.dtype.element_ty), mask=ok[:, None])
    else:
        row = w_ptr + n * stride_wn + sb * (36 if KIND == 12 else 44)
        d, dmin, s0, s1, s2 = _dmin_head(row, ok)
        qh = _q5k_high_bits(row, ok, BLOCK_N, KIND == 13)
        for c in tl.static_range(4):
            w = _dmin_chunk(row, ok, d, dmin, s0, s1, s2, qh, c, BLOCK_N, KIND == 13)
            k = 64 * c + tl.arange(0, 64)
            tl.store(dst + k[None, :], w.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def kquant_dequantize_band(packed, start: int, stop: int, dtype: torch.dtype, out: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """Rows ``start:stop`` of a K-quant weight as a dense ``[stop - start, in]`` tensor of ``dtype`` on its device:
    the Triton twin of ``packed.dequantize_rows`` (bit for bit in fp32), for the many-row products of
    ``edgespec.kernels.quant.triton_quant_prefill``."""
    kind = int(packed.ggml_type)
    rows, K = stop - start, packed.in_features
    w = out if out is not None else torch.empty((rows, K), dtype=dtype, device=packed.blocks.device)
    blocks = packed.blocks.view(LAYOUTS[kind][1])
    grid = (triton.cdiv(rows, 32), K // 256)
    _kquant_dequant_kernel[grid](blocks, w, w, rows, start, blocks.stride(0), w.stride(0), KIND=kind, BLOCK_N=32,
                                 GATHER=False, num_warps=4, enable_fp_fusion=False)
    return w


def kquant_rows(packed, index: torch.Tensor) -> torch.Tensor:
    """Embedding lookup from a K-quant table on CUDA: rows ``index [...]`` decoded in one launch (no host sync, so
    it can sit in a captured graph) -> ``[..., in]`` in ``packed.compute_dtype``; the decode is the reference's
    fp32 weight rounded once (the GPU tests check it bit for bit)."""
    kind = int(packed.ggml_type)
    flat = index.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{packed.format} embedding: token indices must be int32 or int64, got {flat.dtype}")
    K = packed.in_features
    out = torch.empty((flat.numel(), K), dtype=packed.compute_dtype, device=packed.blocks.device)
    if flat.numel():
        blocks = packed.blocks.view(LAYOUTS[kind][1])
        grid = (triton.cdiv(flat.numel(), 16), K // 256)
        _kquant_dequant_kernel[grid](blocks, out, flat.contiguous(), flat.numel(), 0, blocks.stride(0),
                                     out.stride(0), KIND=kind, BLOCK_N=16, GATHER=True, num_warps=4,
                                     enable_fp_fusion=False)
    return out.reshape(*index.shape, K)
