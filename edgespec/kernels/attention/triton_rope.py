"""The attention prologue in one Triton launch: q/k RMSNorm, partial NeoX RoPE and the KV-cache write.

Contract: :func:`edgespec.kernels.attention.rope.qk_norm_rope_write_ref`. The merged projection output
``qkv [T, q_out + 2 * Hkv * hd]`` is read in place (the q part per head ``[q_h | gate_h]`` when gated); the kernel
writes q normed and rotated to a fresh ``[T, Hq, hd]`` tensor and the normed, rotated K row and the V row of each
KV head straight into the cache (FP8: quantised with their per-(token, head) scales).

Grid ``(T, Hq + Hkv)``: a program owns one head of one row. Program ``h < Hq`` produces query head h; the others
KV head ``h - Hq``, K and V together since both land in the same cache row. Rotate-half needs each channel's
partner (``d ± rotary_dim / 2``), so the row is loaded a second time in partner order and normed with the same
rstd: the partner's normed value is then bit-identical to the one computed at its own index.

Rounding follows the torch path, not just its maths, so the results agree bitwise in almost every element:

* norm: ``x̂ = x * rsqrt(mean(x²) + eps)`` in fp32; zero-centred ``(x̂ (1 + w))`` rounded once, standard
  ``w * x̂.to(dtype)`` rounded again (:func:`edgespec.kernels.pointwise.norm.rms_norm_ref`). The sum's order differs from
  torch's reduction, so rstd (and rarely one rounded element) may differ in the last bit;
* rope: ``rot * cos`` and ``rotated * sin`` each rounded to the activation dtype, then their sum rounded, as
  two bf16 products and a bf16 add do in torch (``cos``/``sin`` come in already cast, from
  :meth:`~edgespec.models.layers.RotaryEmbedding.angles`);
* FP8 (:func:`edgespec.cache.kv.quantize_fp8` as CUDA torch runs it): ``scale = max(amax * fl(1/448), 1e-12)``
  (torch's CUDA division by a host scalar multiplies by its fp32 reciprocal), ``x / scale`` correctly rounded
  (``div_rn``; Triton's ``/`` is approximate on fp32), clamped to ±448, cast to e4m3 round-to-nearest-even.

The start position is a runtime argument (never specialised) or is read from a device tensor, so one CUDA graph
per T serves every position. Rows at or past ``max_len`` are not written (``index_copy_`` would fault on them).

:func:`head_norm_rope_triton` (contract: :func:`edgespec.kernels.attention.rope.head_norm_rope_ref`) runs the same
per-row helper for the DFlash drafter: the first n heads of a strided ``[B, T, H_all, hd]`` view, each normed by its own
weight (standard form) and rotated, to a fresh ``[B, T, n, hd]``. Grid ``(T, n, B)``, one program per head row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.cache.kv import FP8_DTYPE, FP8_MAX, KVCache
from edgespec.kernels.attention.rope_checks import check_head_norm_rope
from edgespec.kernels.launch.triton_pdl import pdl_enter, pdl_launch

# The fp32 reciprocal CUDA torch multiplies by for ``amax / 448.0`` (``opmath(1) / opmath(448)``, on the host).
_INV_FP8_MAX = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(FP8_MAX, dtype=torch.float32))
_MIN_SCALE = 1e-12  # edgespec.cache.kv._MIN_SCALE


@triton.jit
def _rope_lanes(cos_ptr, sin_ptr, t, stride_cos, stride_sin, HD: tl.constexpr, ROT: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Channel lanes of one head row and row t's rotary angles: ``d``, its masks (in the head, rotated, first
    half), each channel's rotate-half partner, and ``cos``/``sin`` in float32 (0 past the rotary dims)."""
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    in_rot = d < ROT
    first_half = d < ROT // 2
    partner = tl.where(first_half, d + ROT // 2, tl.where(in_rot, d - ROT // 2, d))
    cos = tl.load(cos_ptr + t * stride_cos + d, mask=in_rot, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_sin + d, mask=in_rot, other=0.0).to(tl.float32)
    return d, dm, in_rot, first_half, partner, cos, sin


@triton.jit
def _norm_rope_row(base, w_ptr, d, partner, dm, in_rot, first_half, cos, sin, eps,
                   HD: tl.constexpr, HAS_NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    """One head's row ``base[0 .. HD)`` normed and rotated, in the activation dtype (masked lanes give 0)."""
    x = tl.load(base + d, mask=dm, other=0.0)
    xf = x.to(tl.float32)
    xp = tl.load(base + partner, mask=in_rot, other=0.0).to(tl.float32)
    if HAS_NORM:
        # mean as sum * (1 / HD): how torch's CUDA mean scales its sum (the same value for power-of-two HD).
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) * (1.0 / HD) + eps)
        w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)
        if ZERO_CENTRED:
            y = (xf * rstd * (1.0 + w)).to(x.dtype)
            yp = (xp * rstd * (1.0 + wp)).to(x.dtype)
        else:
            y = ((xf * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype)
            yp = ((xp * rstd).to(x.dtype).to(tl.float32) * wp).to(x.dtype)
    else:
        y = x
        yp = xp.to(x.dtype)
    yf = y.to(tl.float32)
    # rotate-half: [-x2, x1]; negation is exact, so (-a) * s rounds like torch's cat-then-multiply.
    rotated = tl.where(first_half, -yp.to(tl.float32), yp.to(tl.float32))
    a = (yf * cos).to(x.dtype).to(tl.float32)
    b = (rotated * sin).to(x.dtype).to(tl.float32)
    return tl.where(in_rot, (a + b).to(x.dtype), y)


@triton.jit
def _store_cache_row(row_ptr, scale_ptr, val, d, dm, ok, inv_fp8_max, min_scale, IS_FP8: tl.constexpr,
                     D_STRIDE: tl.constexpr = 1):
    """Write one (token, head) vector, element d at ``row_ptr + d * D_STRIDE``; FP8: quantise it with its own
    scale, stored next to it."""
    if IS_FP8:
        vf = val.to(tl.float32)
        amax = tl.max(tl.abs(vf), axis=0)
        scale = tl.maximum(amax * inv_fp8_max, min_scale)
        q = tl.minimum(tl.maximum(tl.math.div_rn(vf, scale), -448.0), 448.0)
        tl.store(row_ptr + d * D_STRIDE, q.to(row_ptr.dtype.element_ty), mask=dm & ok)
        tl.store(scale_ptr, scale, mask=ok)
    else:
        tl.store(row_ptr + d * D_STRIDE, val.to(row_ptr.dtype.element_ty), mask=dm & ok)


@triton.jit(do_not_specialize=["start"])
def _qk_norm_rope_write_kernel(
    qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr,
    k_ptr, v_ptr, ks_ptr, vs_ptr, start_ptr,
    start, max_len, eps, inv_fp8_max, min_scale,
    stride_x, stride_cos, stride_sin, stride_qo,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_vb, stride_ksn, stride_ksh, stride_vsn, stride_vsh,
    N_Q: tl.constexpr, Q_HEAD_STRIDE: tl.constexpr, K_COL: tl.constexpr, V_COL: tl.constexpr,
    HD: tl.constexpr, ROT: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_QNORM: tl.constexpr, HAS_KNORM: tl.constexpr, ZERO_CENTRED: tl.constexpr,
    IS_FP8: tl.constexpr, START_FROM_PTR: tl.constexpr, PDL: tl.constexpr, V_BLOCK: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    d, dm, in_rot, first_half, partner, cos, sin = _rope_lanes(cos_ptr, sin_ptr, t, stride_cos, stride_sin,
                                                               HD, ROT, BLOCK_D)
    row = qkv_ptr + t * stride_x
    if h < N_Q:
        y = _norm_rope_row(row + h * Q_HEAD_STRIDE, qw_ptr, d, partner, dm, in_rot, first_half, cos, sin, eps,
                           HD, HAS_QNORM, ZERO_CENTRED)
        tl.store(q_out_ptr + t * stride_qo + h * HD + d, y, mask=dm)
    else:
        j = h - N_Q
        if START_FROM_PTR:
            start = tl.load(start_ptr).to(tl.int32)
        pos = start + t
        ok = pos < max_len
        k = _norm_rope_row(row + K_COL + j * HD, kw_ptr, d, partner, dm, in_rot, first_half, cos, sin, eps,
                           HD, HAS_KNORM, ZERO_CENTRED)
        v = tl.load(row + V_COL + j * HD + d, mask=dm, other=0.0)
        _store_cache_row(k_ptr + pos * stride_kn + j * stride_kh, ks_ptr + pos * stride_ksn + j * stride_ksh,
                         k, d, dm, ok, inv_fp8_max, min_scale, IS_FP8)
        vs_row = vs_ptr + pos * stride_vsn + j * stride_vsh
        if V_BLOCK:                                       # key-blocked, transposed V (FP8; see KVCache)
            _store_cache_row(v_ptr + (pos // V_BLOCK) * stride_vb + j * stride_vh + pos % V_BLOCK, vs_row,
                             v, d, dm, ok, inv_fp8_max, min_scale, IS_FP8, V_BLOCK)
        else:
            _store_cache_row(v_ptr + pos * stride_vn + j * stride_vh, vs_row, v, d, dm, ok, inv_fp8_max,
                             min_scale, IS_FP8)


_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _angles_2d(x: torch.Tensor, name: str, T: int, dtype: torch.dtype) -> torch.Tensor:
    """cos or sin (``[T, 1, rd]`` from ``angles``, or ``[T, rd]``) as a ``[T, rd]`` view with unit inner stride."""
    if x.dim() not in (2, 3) or x.shape[0] != T or (x.dim() == 3 and x.shape[1] != 1):
        raise ValueError(f"{name} {tuple(x.shape)} must be [T={T}, 1, rotary_dim] or [T, rotary_dim]")
    if x.dtype != dtype:
        raise ValueError(f"{name} is {x.dtype}; it must be in the activation dtype {dtype} (angles(..., dtype))")
    x2 = x.reshape(T, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check_norm_weight(w: torch.Tensor | None, name: str, hd: int, dtype: torch.dtype, zero_centred: bool) -> None:
    if w is None:
        return
    if w.shape != (hd,):
        raise ValueError(f"{name} weight {tuple(w.shape)} does not match head_dim {hd}")
    if not zero_centred and torch.promote_types(w.dtype, dtype) != dtype:
        # torch's ``w * x̂`` would promote q/k to w's dtype; the kernel keeps the activation dtype.
        raise ValueError(f"{name} weight is {w.dtype}: a standard norm needs it in the activation dtype {dtype}")


def qk_norm_rope_write_triton(qkv: torch.Tensor, cache: KVCache, start: int,
                              cs: tuple[torch.Tensor, torch.Tensor], n_heads: int, n_kv: int, head_dim: int,
                              gated: bool, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                              eps: float = 1e-6, zero_centred: bool = False, pos_t: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See :func:`edgespec.kernels.attention.rope.qk_norm_rope_write`; one launch. Raises ValueError on inputs that do
    not fit (shapes, dtypes, devices, an int ``start`` outside the cache)."""
    hd = head_dim
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [T, q_out + 2 * n_kv * head_dim], got {tuple(qkv.shape)}")
    if qkv.dtype not in _ACT_DTYPES:
        raise ValueError(f"qkv dtype {qkv.dtype} not supported (bf16, fp16, fp32)")
    if n_heads <= 0 or n_kv <= 0 or hd <= 0:
        raise ValueError(f"bad head counts: n_heads={n_heads}, n_kv={n_kv}, head_dim={hd}")
    T = qkv.shape[0]
    q_out = n_heads * hd * (2 if gated else 1)
    if qkv.shape[1] != q_out + 2 * n_kv * hd:
        raise ValueError(f"qkv last dim {qkv.shape[1]} != {q_out} (q{' + gate' if gated else ''}) + "
                         f"2 * {n_kv} * {hd} (k, v)")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos = _angles_2d(cs[0], "cos", T, qkv.dtype)
    sin = _angles_2d(cs[1], "sin", T, qkv.dtype)
    rot = cos.shape[-1]
    if sin.shape[-1] != rot or rot % 2 or not 0 < rot <= hd:
        raise ValueError(f"rotary_dim {rot} (sin {sin.shape[-1]}) must be even, equal for cos/sin and in "
                         f"(0, head_dim={hd}]")
    _check_norm_weight(q_norm, "q_norm", hd, qkv.dtype, zero_centred)
    _check_norm_weight(k_norm, "k_norm", hd, qkv.dtype, zero_centred)
    if cache.k.shape[1:] != (n_kv, hd) or cache.v_row_shape != (n_kv, hd):
        raise ValueError(f"cache rows {tuple(cache.k.shape[1:])} do not fit [n_kv={n_kv}, head_dim={hd}]")
    if cache.fp8 and (cache.k.dtype != FP8_DTYPE or cache.v.dtype != FP8_DTYPE):
        raise ValueError(f"FP8 cache must store {FP8_DTYPE}, has {cache.k.dtype} / {cache.v.dtype}")
    tensors = [qkv, cos, sin, cache.k, cache.v] + [w for w in (q_norm, k_norm) if w is not None]
    if pos_t is not None:
        tensors.append(pos_t)
        if pos_t.numel() != 1 or pos_t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"pos_t must be a one-element int32/int64 tensor, got {tuple(pos_t.shape)} "
                             f"{pos_t.dtype}")
    elif not 0 <= start <= cache.max_len - T:
        raise ValueError(f"rows {start}..{start + T - 1} fall outside the cache of {cache.max_len}")
    if any(t.device != qkv.device for t in tensors):
        devices = sorted({str(t.device) for t in tensors})
        raise ValueError(f"qkv, angles, norm weights, pos_t and the cache must be on one device, got {devices}")

    q = torch.empty((T, n_heads, hd), dtype=qkv.dtype, device=qkv.device)
    gate = qkv[:, :q_out].view(T, n_heads, 2 * hd)[..., hd:] if gated else None
    if T == 0:
        return q, gate
    ks = cache.k_scale if cache.fp8 else cache.k
    vs = cache.v_scale if cache.fp8 else cache.v
    ks_strides = (ks.stride(0), ks.stride(1)) if cache.fp8 else (0, 0)
    vs_strides = (vs.stride(0), vs.stride(1)) if cache.fp8 else (0, 0)
    block_d = triton.next_power_of_2(hd)
    pdl = pdl_launch(qkv.device)
    _qk_norm_rope_write_kernel[(T, n_heads + n_kv)](
        qkv, q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv, cos, sin, q,
        cache.k, cache.v, ks, vs, pos_t if pos_t is not None else qkv,
        int(start), cache.max_len, float(eps), _INV_FP8_MAX, _MIN_SCALE,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0),
        cache.k.stride(0), cache.k.stride(1), *cache.v_strides(), *ks_strides, *vs_strides,
        N_Q=n_heads, Q_HEAD_STRIDE=(2 if gated else 1) * hd, K_COL=q_out, V_COL=q_out + n_kv * hd,
        HD=hd, ROT=rot, BLOCK_D=block_d,
        HAS_QNORM=q_norm is not None, HAS_KNORM=k_norm is not None, ZERO_CENTRED=zero_centred,
        IS_FP8=cache.fp8, START_FROM_PTR=pos_t is not None, PDL=bool(pdl), V_BLOCK=cache.v_block,
        num_warps=max(1, min(4, block_d // 128)), **pdl,
    )
    return q, gate


@triton.jit
def _head_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, eps,
    stride_xb, stride_xt, stride_xh, stride_wb, stride_wh, stride_cos, stride_sin, stride_ob, stride_ot,
    HD: tl.constexpr, ROT: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)       # a leading index (drafter layer) times its stride may pass 2**31
    d, dm, in_rot, first_half, partner, cos, sin = _rope_lanes(cos_ptr, sin_ptr, t, stride_cos, stride_sin,
                                                               HD, ROT, BLOCK_D)
    row = x_ptr + b * stride_xb + t * stride_xt + h * stride_xh
    # Broadcast weight dims come with stride 0, so every (b, h) finds its own weight row.
    y = _norm_rope_row(row, w_ptr + b * stride_wb + h * stride_wh, d, partner, dm, in_rot, first_half, cos, sin,
                       eps, HD, True, False)
    tl.store(out_ptr + b * stride_ob + t * stride_ot + h * HD + d, y, mask=dm)


def head_norm_rope_triton(x: torch.Tensor, n: int, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          eps: float) -> torch.Tensor:
    """See :func:`edgespec.kernels.attention.rope.head_norm_rope`; one launch, no host sync (CUDA-graph safe). Raises
    ValueError on inputs that do not fit (shapes, dtypes, devices)."""

    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"x dtype {x.dtype} not supported (bf16, fp16, fp32)")
    w3 = check_head_norm_rope(x, n, weight, cos, sin)
    x4 = x if x.dim() == 4 else x[None]
    B, T, _, hd = x4.shape
    if x4.stride(-1) != 1:
        x4 = x4.contiguous()            # the kernel reads each head row as one unit-stride vector
    if w3.stride(-1) != 1:
        w3 = w3.contiguous()
    cos2 = _angles_2d(cos, "cos", T, x.dtype)
    sin2 = _angles_2d(sin, "sin", T, x.dtype)
    out = torch.empty((B, T, n, hd), dtype=x.dtype, device=x.device)
    if B and T:
        block_d = triton.next_power_of_2(hd)
        pdl = pdl_launch(x.device)
        _head_norm_rope_kernel[(T, n, B)](
            x4, w3, cos2, sin2, out, float(eps),
            x4.stride(0), x4.stride(1), x4.stride(2),
            w3.stride(0) if w3.shape[0] > 1 else 0, w3.stride(1) if w3.shape[1] > 1 else 0,
            cos2.stride(0), sin2.stride(0), out.stride(0), out.stride(1),
            HD=hd, ROT=cos2.shape[-1], BLOCK_D=block_d, PDL=bool(pdl),
            num_warps=max(1, min(4, block_d // 128)), **pdl,
        )
    return out if x.dim() == 4 else out[0]
