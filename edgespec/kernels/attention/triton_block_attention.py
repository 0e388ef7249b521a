"""DFlash block attention in Triton, split over the keys (contract: :mod:`edgespec.kernels.attention.block_attention`).

Grid ``(Hkv, rep, n_splits)``: a program owns the T block rows of one query head and one chunk of the ``W + T`` keys
of its KV head, keys ``[s * CHUNK, min((s + 1) * CHUNK, W + T))`` for split s, ``CHUNK`` a whole number of
``BLOCK_N`` tiles, which it streams with an online softmax. Key index ``n < W`` reads the window row n, ``n >= W``
the block's own row ``n - W``, so the scratch rows of the window are never written. With ``n_splits > 1`` each
program writes a normalised float32 partial output and its log2-sum-exp, and the combine kernel of the cached
attention (:func:`edgespec.kernels.attention.triton_attention._attn_combine_kernel`, same log2 units and the same
``_NEG_BIG`` for a row that sees no key of a chunk: l = 0, weight 0) merges them in a second launch. With
``n_splits == 1`` a single launch writes the output directly (the original form, kept for comparison).

Why the split: one program per query head is only Hq programs (24 on the Qwen3.5-27B drafter, Hq=24, Hkv=4,
hd=256, W=128, T=16) on a 132-SM GPU, each streaming 144 keys in five dependent 32-key tiles: pure latency with
most of the chip idle. Split, every program runs about one tile; the merge reads
``n_splits * T * Hq * hd`` floats, which stay in L2 (``tools/block_attn_bench.py`` times every split count and
tile choice).
Default split count (:func:`default_block_splits`): enough programs to cover the SMs once,
``cdiv(sm_count, Hq)`` splits, but never more than there are key tiles (no split is shorter than one tile).

Products on the tensor cores, exact where the reference is: the window holds K/V rounded to the drafter dtype and
widened to float32 (:class:`~edgespec.drafters.window.FeatureWindow`), so narrowing them back to q's dtype is
exact, and ``q . k`` is a bf16/fp16 product with float32 accumulation, the reference's float32 product up to the
summation order. The probabilities are float32: ``p V`` runs as two products, ``p_hi V + p_lo V`` with
``p_hi = bf16(p)`` and ``p_lo = bf16(p - p_hi)`` (16 significant bits, against float32's 24; the output is rounded
to 8). IEEE float32 products on the FMA units would run an order of magnitude slower than the seven launches of
the reference (tools/step_profile.py --drafter; figures: docs/benchmarks.md, "Design figures").

CUDA graphs: nothing is read back to the host; the scratch partials come from ``torch.empty`` per call and the
grid depends only on the shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels import sm_count
from edgespec.kernels.attention.triton_attention import _NEG_BIG, merge_splits

# Keys a caller may override through ``config=`` (benchmarking); the split count has its own argument.
LAUNCH_KEYS = ("BLOCK_N", "num_warps", "num_stages")


@triton.jit
def _block_attn_kernel(
    q_ptr, kb_ptr, vb_ptr, kw_ptr, vw_ptr, bias_ptr, o_ptr, lse_ptr, qk_scale,
    stride_qt, stride_qh, stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    stride_kwn, stride_kwh, stride_vwn, stride_vwh, stride_br,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    T: tl.constexpr, W: tl.constexpr, REP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr,
):
    kvh = tl.program_id(0)
    r = tl.program_id(1)
    head = kvh * REP + r
    if SPLIT:
        pid_s = tl.program_id(2)
        lo = pid_s * CHUNK
    else:
        lo = 0                      # compile-time start: the single-launch form is the original kernel
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + t[:, None] * stride_qt + head * stride_qh + d[None, :], mask=t_ok[:, None], other=0.0)
    dot_ty = q.dtype
    m_i = tl.full([BLOCK_T], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, HEAD_DIM], tl.float32)
    # Every split runs CHUNK / BLOCK_N tiles; tiles past W + T (the last split's tail) are fully masked: their
    # scores are -inf, so p = 0 and alpha = 1 leave the running state as it was.
    for n0 in tl.static_range(0, CHUNK, BLOCK_N):
        n = lo + n0 + tl.arange(0, BLOCK_N)
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
    # A row that sees no key here keeps l_i = 0: o = 0 and (split) lse = _NEG_BIG, which the merge weights by 0.
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), _NEG_BIG)
        tl.store(o_ptr + pid_s * stride_os + t[:, None] * stride_ot + head * stride_oh + d[None, :], o,
                 mask=t_ok[:, None])
        tl.store(lse_ptr + pid_s * stride_ls + t * stride_lt + head, lse, mask=t_ok)
    else:
        tl.store(o_ptr + t[:, None] * stride_ot + head * stride_oh + d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=t_ok[:, None])


def default_block_splits(n_tiles: int, n_q_heads: int, n_sms: int) -> int:
    """The default split count: enough ``(head, split)`` programs to cover the SMs once (``cdiv(n_sms, Hq)``),
    capped at one key tile per split. More would only add partials for the merge to read; fewer leaves SMs idle
    while each program runs its tiles one after another (the kernel is latency-bound, not bandwidth-bound)."""
    return max(1, min(n_tiles, triton.cdiv(n_sms, n_q_heads)))


def block_attention_launch(T: int, S: int, head_dim: int, n_q_heads: int, n_sms: int, n_splits: int | None = None,
                           config: dict[str, int] | None = None) -> dict[str, int]:
    """Validate the launch overrides and derive the launch: ``BLOCK_N``, ``num_warps``, ``num_stages``, ``n_splits``
    (the count launched) and ``CHUNK`` (keys per split). Pure Python, so it runs (and is tested) without CUDA.

    ``S = W + T`` keys. ``n_splits`` (None: :func:`default_block_splits`) must lie in ``1 .. cdiv(S, BLOCK_N)``; it is
    rounded to whole tiles per split, ``cdiv(n_tiles, n_splits)``, and the count launched is the fewest splits of that
    many tiles, so no split is empty (5 tiles asked in 4 splits run as 2 + 2 + 1). ``config`` may set any of
    ``LAUNCH_KEYS``; any other key raises ValueError naming it.
    """
    config = dict(config or {})
    for key in config:
        if key not in LAUNCH_KEYS:
            raise ValueError(f"block attention: unknown launch key {key!r} (known: {', '.join(LAUNCH_KEYS)})")
    block_n = config.get("BLOCK_N", 32 if head_dim >= 256 else 64)
    # tl.dot needs a reduction dim of at least 16 (p V reduces over BLOCK_N) and tl.arange a power of two.
    if not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block attention: BLOCK_N {block_n!r} must be a power of two >= 16")
    num_warps = config.get("num_warps", 4)
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"block attention: num_warps {num_warps!r} must be 1, 2, 4, 8 or 16")
    num_stages = config.get("num_stages", 2)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"block attention: num_stages {num_stages!r} must be a positive int")
    n_tiles = triton.cdiv(S, block_n)
    if n_splits is None:
        n_splits = default_block_splits(n_tiles, n_q_heads, n_sms)
    elif isinstance(n_splits, bool) or not isinstance(n_splits, int) or not 1 <= n_splits <= n_tiles:
        raise ValueError(f"block attention: n_splits {n_splits!r} must be an int in 1..{n_tiles} "
                         f"({S} keys in {block_n}-key tiles)")
    per_split = triton.cdiv(n_tiles, n_splits)
    return {"BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages,
            "n_splits": triton.cdiv(n_tiles, per_split), "CHUNK": per_split * block_n}


def block_attention_triton(q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor, keys: torch.Tensor,
                           values: torch.Tensor, bias: torch.Tensor, scale: float, n_splits: int | None = None,
                           config: dict[str, int] | None = None) -> torch.Tensor:
    """Shapes checked by :func:`edgespec.kernels.attention.block_attention.block_attention`. ``n_splits`` / ``config``:
    see :func:`block_attention_launch`; one split is a single launch, more add the merge launch."""
    T, Hq, hd = q.shape
    S, Hkv, _ = keys.shape
    cfg = block_attention_launch(T, S, hd, Hq, sm_count(q.device), n_splits, config)
    q, k_block, v_block, keys, values = (x if x.stride(-1) == 1 else x.contiguous()
                                         for x in (q, k_block, v_block, keys, values))
    bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    out = torch.empty((T, Hq, hd), dtype=q.dtype, device=q.device)
    splits = cfg["n_splits"]
    if splits > 1:
        o_part = torch.empty((splits, T, Hq, hd), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((splits, T, Hq), dtype=torch.float32, device=q.device)
        o_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1))
    else:
        o_part = lse_part = out                     # lse pointer unused by the single-launch form
        o_strides = (0, out.stride(0), out.stride(1), 0, 0)
    _block_attn_kernel[(Hkv, Hq // Hkv, splits)](
        q, k_block, v_block, keys, values, bias, o_part, lse_part, float(scale),
        q.stride(0), q.stride(1), k_block.stride(0), k_block.stride(1), v_block.stride(0), v_block.stride(1),
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), bias.stride(0), *o_strides,
        T=T, W=S - T, REP=Hq // Hkv, HEAD_DIM=hd, BLOCK_T=max(16, triton.next_power_of_2(T)),
        BLOCK_N=cfg["BLOCK_N"], CHUNK=cfg["CHUNK"], SPLIT=splits > 1,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if splits > 1:
        # Second launch: the cached attention's merge, without PDL (the split kernel above does not wait on a grid
        # dependency, so neither side may take part in a PDL chain).
        merge_splits(o_part, lse_part, out, {})
    return out.view(T, Hq * hd)
