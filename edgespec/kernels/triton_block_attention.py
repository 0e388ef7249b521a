"""DFlash block attention in one Triton launch (contract: :mod:`edgespec.kernels.block_attention`).

Grid ``(Hkv, rep)``: a program owns the T block rows of one query head and streams the ``W + T`` keys of its KV
head in ``BLOCK_N`` tiles with an online softmax. Key index ``n < W`` reads the window row n, ``n >= W`` the block's
own row ``n - W``, so the scratch rows of the window are never written.

Products on the tensor cores, exact where the reference is: the window holds K/V rounded to the drafter dtype and
widened to float32 (:class:`~edgespec.drafters.window.FeatureWindow`), so narrowing them back to q's dtype is
exact, and ``q . k`` is a bf16/fp16 product with float32 accumulation, the reference's float32 product up to the
summation order. The probabilities are float32: ``p V`` runs as two products, ``p_hi V + p_lo V`` with
``p_hi = bf16(p)`` and ``p_lo = bf16(p - p_hi)`` (16 significant bits, against float32's 24; the output is rounded
to 8). A first version ran IEEE float32 products on the FMA units: 381 us per layer on an H200, against ~32 us for
the seven launches of the reference (tools/step_profile.py --drafter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Finite stand-in for -inf in the running max: a row whose every key is masked gives exp2(-inf - m) = 0, not NaN.
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _block_attn_kernel(
    q_ptr, kb_ptr, vb_ptr, kw_ptr, vw_ptr, bias_ptr, o_ptr, qk_scale,
    stride_qt, stride_qh, stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    stride_kwn, stride_kwh, stride_vwn, stride_vwh, stride_br, stride_ot, stride_oh,
    T: tl.constexpr, W: tl.constexpr, REP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):
    kvh = tl.program_id(0)
    r = tl.program_id(1)
    head = kvh * REP + r
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + t[:, None] * stride_qt + head * stride_qh + d[None, :], mask=t_ok[:, None], other=0.0)
    dot_ty = q.dtype
    m_i = tl.full([BLOCK_T], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, HEAD_DIM], tl.float32)
    for n0 in tl.static_range(0, W + T, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        in_w = n < W
        in_b = (n >= W) & (n < W + T)
        nb = tl.where(in_b, n - W, 0)
        k = tl.load(kw_ptr + n[:, None] * stride_kwn + kvh * stride_kwh + d[None, :], mask=in_w[:, None],
                    other=0.0).to(dot_ty)
        k += tl.load(kb_ptr + nb[:, None] * stride_kbt + kvh * stride_kbh + d[None, :], mask=in_b[:, None], other=0.0)
        v = tl.load(vw_ptr + n[:, None] * stride_vwn + kvh * stride_vwh + d[None, :], mask=in_w[:, None],
                    other=0.0).to(dot_ty)
        v += tl.load(vb_ptr + nb[:, None] * stride_vbt + kvh * stride_vbh + d[None, :], mask=in_b[:, None], other=0.0)
        bias = tl.load(bias_ptr + (r * T + t)[:, None] * stride_br + n[None, :],
                       mask=t_ok[:, None] & (n < W + T)[None, :], other=float("-inf"))
        # log2 units: scale * q.k + bias, times log2(e), so exp2 gives the reference's exp.
        s = (tl.dot(q, tl.trans(k)) * qk_scale + bias) * 1.4426950408889634
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_hi = p.to(dot_ty)
        p_lo = (p - p_hi.to(tl.float32)).to(dot_ty)
        acc = tl.dot(p_lo, v, tl.dot(p_hi, v, acc * alpha[:, None]))
        m_i = m_new
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(o_ptr + t[:, None] * stride_ot + head * stride_oh + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=t_ok[:, None])


def block_attention_triton(q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor, keys: torch.Tensor,
                           values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """One launch; shapes checked by :func:`edgespec.kernels.block_attention.block_attention`."""
    T, Hq, hd = q.shape
    S, Hkv, _ = keys.shape
    q, k_block, v_block, keys, values = (x if x.stride(-1) == 1 else x.contiguous()
                                         for x in (q, k_block, v_block, keys, values))
    bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    out = torch.empty((T, Hq, hd), dtype=q.dtype, device=q.device)
    block_t = max(16, triton.next_power_of_2(T))
    _block_attn_kernel[(Hkv, Hq // Hkv)](
        q, k_block, v_block, keys, values, bias, out, float(scale),
        q.stride(0), q.stride(1), k_block.stride(0), k_block.stride(1), v_block.stride(0), v_block.stride(1),
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), bias.stride(0),
        out.stride(0), out.stride(1),
        T=T, W=S - T, REP=Hq // Hkv, HEAD_DIM=hd, BLOCK_T=block_t, BLOCK_N=32 if hd >= 256 else 64,
        num_warps=4, num_stages=2,
    )
    return out.view(T, Hq * hd)
