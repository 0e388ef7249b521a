"""Block-scaled products for Blackwell (compute capability 10.x B200, 11.0 Thor, 12.x RTX 50): NVFP4 (e2m1, E4M3
scale per 16, global fp32 scale) and MXFP4 (e2m1, E8M0 per 32) weights fed straight into the block-scaled
tensor-core MMA through ``tl.dot_scaled``, for decode (1 row), verify (2..64 rows) and prefill (row blocks of 64).

Why ``tl.dot_scaled`` and not Gluon: with Triton 3.9 and a CUDA 13 ptxas (``TRITON_PTXAS_PATH``) it lowers both
formats natively where the weights are the LEFT operand (a 128-row tile of output features) and the activations
the right one (``y^T = W x^T``): e2m1 x e2m1 with E4M3 scales per 16 to ``tcgen05.mma kind::mxf4nvf4.block16``
(sm_100a / sm_110a; ``mma.sync kind::mxf4nvf4 scale_vec::4X`` on sm_120a), e2m1 x e4m3 with E8M0 per 32 to
``kind::mxf8f6f4.block32`` (sm_100a / sm_110a; upcast on sm_120a). Gluon's ``tcgen05_mma_scaled`` would reach the
same instructions with the TMEM and barriers written by hand; it is not needed for these shapes
(``tools/compile_targets.py`` prints which instruction each target's SASS holds). The NVFP4 scales of a checkpoint
are the MMA's scales as stored (no conversion to E8M0, which would not be exact).

The activation side: the block-scaled MMA has no bf16 x e2m1 kind, so the rows are quantized into the operand
format as a residual series (``edgespec.kernels.quant.block_scaled_ref``: 2 MXFP8 terms, exact for bf16 inputs; 4
NVFP4 terms, ~7e-5 relative error) by :func:`quantize_activations_triton`, once per product, and every term is
extra MMA columns of the same weight tile: the weights are read once and never decoded on the CUDA cores.

On a GPU without the native instruction (Hopper, Ampere) Triton emulates ``dot_scaled`` (upcast to bf16, then an
ordinary MMA): the same results, which is how these kernels are checked on an H100/H200; not a speed path there
(``choose_block_scaled_kernel`` picks them only from compute capability 10).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from edgespec.kernels.quant.block_scaled_ref import (
    BLOCK_SCALED_FORMATS,
    SCALE_BLOCK,
    TERMS,
    ActQuant,
    block_rows,
)
from edgespec.kernels.quant.triton_gemv import _split_sum_kernel
from edgespec.kernels.quant.triton_quant_tiles import _finish, wave_splits

# Weight rows per program: the block-scaled tcgen05 MMA's M (the weights are its left operand).
BLOCK_N = 128
# K per tile (one nvfp4 tile: 8 scales per row; mxfp4: 4)
BLOCK_K = 128
# The columns one MMA may take: 256 with tensor memory (sm_100 / sm_110); sm_120's mma.sync keeps the accumulator
# in registers, so its row blocks are narrower.
MAX_COLUMNS = {10: 256, 11: 256, 12: 64}
# Most columns a row block may take at 4 warps: the epilogue reads the [128, columns] fp32 accumulator into
# registers, 128 of them per thread at 128 columns (sm_110a, 17-32 NVFP4 rows: 162 registers, no spill); 256 columns
# (33-64 rows) spill at 4 warps and take 8. Fewer warps issue fewer copy instructions per weight (each warp's share
# of a tile's loads is larger, its loop overhead the same).
FOUR_WARP_COLUMNS = 128


@triton.jit
def _pow2_exponent(v, LIM_EXP: tl.constexpr, LIM_MANT: tl.constexpr):
    """Smallest e with v / 2^e <= limit (limit's exponent and mantissa bits given), from v's bits (as
    ``block_scaled_ref.pow2_ceil_exponent``)."""
    bits = v.to(tl.int32, bitcast=True)
    exp = (bits >> 23) - 127
    e = exp - LIM_EXP + ((bits & 0x7FFFFF) > LIM_MANT).to(tl.int32)
    e = tl.where(exp < -126, -126, e)
    return tl.minimum(tl.maximum(e, -126), 127)


@triton.jit
def _exp2_int(e):
    """2^e as fp32 for integer e in -126..127."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(v):
    """fp32 ``v`` (|v| <= 448) rounded to the nearest e4m3 (ties to even) in fp32 arithmetic, then stored as
    float8e4nv. The rounding is done here, not by the conversion, so that every Triton backend, the interpreter
    included (whose fp8 conversion drops a rounding carry into the exponent), gives torch's codes."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)   # 3 mantissa bits
    sub = (a + 16384.0) - 16384.0                                     # multiples of 2^-9 (e4m3's subnormal step)
    r = tl.where(a < 0.015625, sub, normal)
    return tl.where(v < 0, -r, r).to(tl.float8e4nv)


@triton.jit
def _e2m1_codes(v):
    """Nearest e2m1 codes of fp32 ``v`` (midpoints round down, saturating at 6, -0 as +0)."""
    a = tl.abs(v)
    idx = ((a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a > 1.75).to(tl.int32)
           + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return idx + tl.where((v < 0) & (idx > 0), 8, 0)


@triton.jit
def _e2m1_value(c):
    """fp32 value of e2m1 codes ``c`` (int32)."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, _exp2_int(e - 1) * (1.0 + m * 0.5))
    return tl.where(c >= 8, -mag, mag)


@triton.jit
def _row_amax(x_ptr, row_ok, K, BLOCK_K: tl.constexpr):
    """Largest |x| of one row (0 for a padding row: ``row_ok`` a ``[BLOCK_K]`` mask)."""
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + k0 + offs, mask=row_ok & (k0 + offs < K), other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    return tl.max(amax, axis=0)


@triton.jit
def _quant_act_kernel(x_ptr, q_ptr, s_ptr, g_ptr, M, K, stride_xm, stride_qm, stride_sm,
                      NVFP4: tl.constexpr, TERMS: tl.constexpr, MP: tl.constexpr, BLOCK_K: tl.constexpr):
    """One activation row (padding rows of the last row block included, as zeros) -> its ``TERMS`` residual
    terms, stored as the columns ``block x C + t x MP + r`` of the operand (``block_scaled_ref``'s layout)."""
    row = tl.program_id(0)
    blk = row // MP
    r = row % MP
    C: tl.constexpr = TERMS * MP
    B: tl.constexpr = 16 if NVFP4 else 32
    NB: tl.constexpr = BLOCK_K // B
    offs = tl.arange(0, BLOCK_K)
    ok = (offs * 0 + row) < M              # a padding row loads zeros
    x_row = x_ptr + row * stride_xm
    if NVFP4:
        e0 = _pow2_exponent(_row_amax(x_row, ok, K, BLOCK_K), 11, 0x280000)        # 6 x 448 = 1.3125 x 2^11
        for t in tl.static_range(TERMS):
            tl.store(g_ptr + blk * C + t * MP + r, _exp2_int(tl.maximum(e0 - 2 * t, -126)))
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_row + k0 + offs, mask=ok & (k0 + offs < K), other=0.0).to(tl.float32)
        res = tl.reshape(x, [NB, B])
        for t in tl.static_range(TERMS):
            out = blk * C + t * MP + r
            amax = tl.max(tl.abs(res), axis=1)                                        # [NB]
            if NVFP4:
                g = _exp2_int(tl.maximum(e0 - 2 * t, -126))
                s = _to_e4m3(tl.math.div_rn(tl.math.div_rn(amax, 6.0), g))
                sf = s.to(tl.float32) * g
                v = tl.where(sf[:, None] > 0, tl.math.div_rn(res, tl.maximum(sf, 1e-38)[:, None]), 0.0)
                codes = _e2m1_codes(v)
                res = res - _e2m1_value(codes) * sf[:, None]
                lo, hi = tl.split(tl.reshape(codes, [BLOCK_K // 2, 2]))
                tl.store(q_ptr + out * stride_qm + k0 // 2 + tl.arange(0, BLOCK_K // 2), (lo | (hi << 4)).to(tl.uint8))
                tl.store(s_ptr + out * stride_sm + k0 // B + tl.arange(0, NB), s)
            else:
                e = _pow2_exponent(amax, 8, 0x600000)                                # 448 = 1.75 x 2^8
                sc = _exp2_int(e)
                q = _to_e4m3(tl.math.div_rn(res, sc[:, None]))
                res = res - q.to(tl.float32) * sc[:, None]
                tl.store(q_ptr + out * stride_qm + k0 + offs, tl.reshape(q, [BLOCK_K]))
                tl.store(s_ptr + out * stride_sm + k0 // B + tl.arange(0, NB), (e + 127).to(tl.uint8))


@triton.jit
def _block_scaled_kernel(w_ptr, ws_ptr, ws2_ptr, xq_ptr, xs_ptr, g_ptr, part_ptr, b_ptr, y_ptr, M, N,
                         tiles_per_split, stride_wn, stride_wsn, stride_xq, stride_xs, stride_ps, stride_pm, stride_ym,
                         NVFP4: tl.constexpr, TERMS: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``acc[n, c] = sum_k W[n, k] X_c[k]`` over this program's K tiles with the weights (e2m1 codes and their
    block scales, as stored) the left operand of ``tl.dot_scaled`` and the ``C`` activation columns of row block
    ``program_id(2)`` the right one; the columns' terms are then scaled and summed into ``MP`` output rows."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    B: tl.constexpr = 16 if NVFP4 else 32
    C: tl.constexpr = TERMS * MP
    XK: tl.constexpr = BLOCK_K // 2 if NVFP4 else BLOCK_K
    ACT: tl.constexpr = "e2m1" if NVFP4 else "e4m3"
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    col = pid_m * C + tl.arange(0, C)
    kw = tl.arange(0, BLOCK_K // 2)
    ks = tl.arange(0, BLOCK_K // B)
    kx = tl.arange(0, XK)
    t0 = pid_k * tiles_per_split
    acc = tl.zeros([BLOCK_N, C], tl.float32)
    for i in range(0, tiles_per_split):
        t = t0 + i
        w = tl.load(w_ptr + n[:, None] * stride_wn + (t * (BLOCK_K // 2) + kw)[None, :], mask=n_ok[:, None], other=0)
        # (rows past N: codes 0 and whatever scale; those rows are never stored)
        ws = tl.load(ws_ptr + n[:, None] * stride_wsn + (t * (BLOCK_K // B) + ks)[None, :], mask=n_ok[:, None])
        x = tl.load(xq_ptr + col[None, :] * stride_xq + (t * XK + kx)[:, None])
        xs = tl.load(xs_ptr + col[:, None] * stride_xs + (t * (BLOCK_K // B) + ks)[None, :])
        acc = tl.dot_scaled(w, ws, "e2m1", x, xs, ACT, acc)
    if NVFP4:
        acc = acc * tl.load(g_ptr + col)[None, :]
    out = tl.sum(tl.reshape(acc, [BLOCK_N, TERMS, MP]), axis=1)                      # [BLOCK_N, MP]
    if NVFP4:
        out = out * tl.load(ws2_ptr)
    m = pid_m * MP + tl.arange(0, MP)
    _finish(tl.trans(out), part_ptr, b_ptr, y_ptr, m, n, M, N, pid_k, stride_ps, stride_pm, stride_ym, True, DIRECT,
            HAS_BIAS)


# ---- launch ---------------------------------------------------------------------------------------------------

def max_columns(capability: tuple[int, int] | None) -> int:
    """The MMA columns a row block may take on ``capability`` (None: the tensor-memory targets)."""
    return MAX_COLUMNS.get(capability[0], 256) if capability else 256


def emulated(fmt: str, capability: tuple[int, int] | None) -> bool:
    """Whether ``tl.dot_scaled`` upcasts this format on ``capability`` (no native block-scaled kind): before
    compute capability 10, and MXFP4's e4m3 activations on sm_120."""
    if capability is None:
        return False
    return capability < (10, 0) or (capability[0] == 12 and fmt == "mxfp4")


def quantize_activations_triton(x2: torch.Tensor, fmt: str, columns: int = 256) -> ActQuant:
    """``x2 [M, K]`` (K a multiple of :data:`BLOCK_K`) -> the residual series of ``block_scaled_ref`` in one launch
    (the same codes bit for bit)."""
    M, K = x2.shape
    terms, blk = TERMS[fmt], SCALE_BLOCK[fmt]
    mp = block_rows(fmt, M, columns)
    n_blocks = triton.cdiv(M, mp)
    cols = n_blocks * terms * mp
    nvfp4 = fmt == "nvfp4"
    q = torch.empty((cols, K // 2 if nvfp4 else K), dtype=torch.uint8 if nvfp4 else torch.float8_e4m3fn,
                    device=x2.device)
    s = torch.empty((cols, K // blk), dtype=torch.float8_e4m3fn if nvfp4 else torch.uint8, device=x2.device)
    g = torch.ones(cols, dtype=torch.float32, device=x2.device)
    _quant_act_kernel[(n_blocks * mp,)](x2, q, s, g, M, K, x2.stride(0), q.stride(0), s.stride(0), NVFP4=nvfp4,
                                         TERMS=terms, MP=mp, BLOCK_K=BLOCK_K, num_warps=4)
    return ActQuant(q, s, g, M, mp, terms, fmt)


def block_scaled_config(N: int, K: int, M: int, sms: int, columns: int, emulate: bool = False
                        ) -> dict[str, int]:
    """Launch of a product of ``M`` rows whose row blocks take ``columns`` MMA columns: one program per 128 weight
    rows and row block, K split over programs until about two waves fill the SMs (decode and verify; a prefill's
    row blocks fill them); :data:`FOUR_WARP_COLUMNS` decides the warps (``emulate``: upcast on a GPU without the
    instruction, 8 warps)."""
    n_blocks, n_tiles = triton.cdiv(N, BLOCK_N), K // BLOCK_K
    splits = wave_splits(n_blocks, n_tiles, 2 * sms) if M <= 64 else 1
    return {"SPLIT_K": splits, "num_warps": 8 if columns > FOUR_WARP_COLUMNS or emulate else 4, "num_stages": 3}


def block_scaled_matmul(packed, x: torch.Tensor, bias: torch.Tensor | None = None,
                        config: dict[str, int] | None = None, capability: tuple[int, int] | None = None
                        ) -> torch.Tensor:
    """``x [..., in] @ W^T (+ bias)`` for an ``nvfp4`` or ``mxfp4`` weight (contract buffers) through the
    block-scaled MMA, output in x's dtype. ``capability`` sizes the row blocks (:data:`MAX_COLUMNS`; default the
    device's)."""
    fmt = packed.format
    if fmt not in BLOCK_SCALED_FORMATS:
        raise ValueError(f"block-scaled product: format {fmt!r} is not one of {', '.join(BLOCK_SCALED_FORMATS)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    N = packed.out_features
    if K != packed.in_features or K % BLOCK_K:
        raise ValueError(f"{fmt} block-scaled product: x {tuple(x.shape)} must end in in_features="
                         f"{packed.in_features}, a multiple of {BLOCK_K}")
    if capability is None and x.is_cuda:
        capability = torch.cuda.get_device_capability(x.device)
    aq = quantize_activations_triton(x2, fmt, max_columns(capability))
    from edgespec.kernels import sm_count
    cfg = {**block_scaled_config(N, K, M, sm_count(x.device), aq.columns, emulated(fmt, capability)),
           **(config or {})}
    n_tiles = K // BLOCK_K
    splits = max(d for d in range(1, min(cfg["SPLIT_K"], n_tiles) + 1) if n_tiles % d == 0)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    direct = splits == 1
    part = y if direct else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    ps, pm = (part.stride(0), part.stride(1)) if not direct else (0, 0)
    nvfp4 = fmt == "nvfp4"
    ws2 = packed.weight_scale_2 if nvfp4 else aq.col_scale
    grid = (triton.cdiv(N, BLOCK_N), splits, aq.blocks)
    _block_scaled_kernel[grid](packed.weight, packed.weight_scale, ws2, aq.codes, aq.scales, aq.col_scale, part,
                               bias if bias is not None else y, y, M, N, n_tiles // splits, packed.weight.stride(0),
                               packed.weight_scale.stride(0), aq.codes.stride(0), aq.scales.stride(0), ps, pm,
                               y.stride(0), NVFP4=nvfp4, TERMS=aq.terms, MP=aq.block_rows, BLOCK_N=BLOCK_N,
                               BLOCK_K=BLOCK_K, DIRECT=direct, HAS_BIAS=bias is not None,
                               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if not direct:
        _split_sum_kernel[(M, triton.cdiv(N, 1024))](
            part, bias if bias is not None else part, y, M, N, splits, part.stride(0), part.stride(1), y.stride(0),
            HAS_BIAS=bias is not None, SPLITS_P2=max(2, triton.next_power_of_2(splits)), BLOCK=1024, num_warps=4,
            PDL=False)
    return y.reshape(*lead, N)


def block_scaled_kernel(packed, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``PackedWeight.kernel`` signature: the block-scaled product for bf16/fp16/fp32 CUDA inputs without
    autograd (the activations are quantized from fp32 either way), the format's torch reference otherwise."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and not torch.is_grad_enabled():
        return block_scaled_matmul(packed, x, bias)
    return packed.matmul_ref(x, bias)


# Lowest compute capability with the block-scaled tensor-core MMA (B200 10.0, Thor 11.0, RTX 50 12.0).
NATIVE_CAPABILITY = (10, 0)


@functools.cache
def dot_scaled_available() -> bool:
    """Whether the installed Triton has ``tl.dot_scaled`` with E4M3 scales per 16 (NVFP4): Triton 3.9 deduces the
    scale block from the scale tensor's shape (``ir.deduce_scale_factor``); older versions take E8M0 per 32 only."""
    from triton._C.libtriton import ir
    return hasattr(tl, "dot_scaled") and hasattr(ir, "deduce_scale_factor")


def choose_block_scaled_kernel(packed, native_only: bool = True, capability: tuple[int, int] | None = None):
    """The block-scaled product for ``packed`` on its device, or None: an nvfp4/mxfp4 weight with ``in_features``
    a multiple of 128, on a GPU with the block-scaled MMA (``native_only``; else any CUDA GPU, emulated), with a
    Triton that lowers its scale format (:func:`dot_scaled_available`). ``capability``: choose for that compute
    capability wherever the weight lives (``compile_targets``)."""
    from edgespec.kernels import triton_available
    fmt = getattr(packed, "format", None)
    if fmt not in BLOCK_SCALED_FORMATS or not triton_available() or packed.in_features % BLOCK_K:
        return None
    dev = packed.weight.device
    if capability is None:
        if dev.type != "cuda":
            return None
        capability = torch.cuda.get_device_capability(dev)
    if native_only and capability < NATIVE_CAPABILITY:
        return None
    if fmt == "nvfp4" and not dot_scaled_available():
        return None
    return block_scaled_kernel
