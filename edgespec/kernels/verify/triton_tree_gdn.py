"""Gated DeltaNet over a draft tree in Triton: every tree row's output from the committed state along its own branch.

Contract: :func:`edgespec.kernels.verify.tree.gdn_tree_ref` (the chunked delta rule of one chunk with the causal mask
replaced by the ancestor mask ``M``). One program per value head (optionally per part of its dv columns) does it
all in registers, in one launch per layer:

* ``G = M g`` (each row's log decay summed along its own path), ``D = M * exp(G_t - G_s)`` (exp of differences,
  each <= 1, as the reference forms it), ``A = strict(D) * beta_t (k_t . k_s)``;
* ``X = (I + A)^-1`` by block doubling (:func:`edgespec.kernels.recurrent.triton_gdn._unit_lower_inverse`'s recursion
  written on whole register tiles: at block size b, ``X <- X - X (A * lower_b) X`` where ``lower_b`` keeps the
  lower-left b x b block of every 2b x 2b diagonal block; X is block-diagonal at every level, so the product is exactly
  the ``-X22 A21 X11`` fill). Depth-first (pre-)order puts every ancestor before its row, so ``A`` is strictly lower
  triangular whatever the tree's shape; log2(rows) levels of two products each, no row-by-row substitution;
* with ``P = D * (Q K^T)``, the output is linear in the committed state ``S0``:
  ``O = (exp(G) Q - P X diag(beta exp(G)) K) S0 + (P X diag(beta)) V``, so the state is read once, tile by tile,
  and never written (the commit advances it along the accepted path only).

Products run in IEEE fp32 (``input_precision="ieee"``) by default, so the result tracks the fp32 reference rather
than a tf32 approximation of it; ``precision="tf32x3"`` is the faster near-fp32 alternative ``tools/kernel_bench.py
--only tree`` times. The ancestor mask is read from :class:`~edgespec.kernels.verify.tree.TreeMask`'s 64-bit rows
(``bits``), so a launch needs no host-built table and nothing that depends on the tree's values: it can be captured
in a CUDA graph.

Not the default (``draft_tree_kernels: triton`` chooses it): on an H200 it is slower than the torch reference on a
27B layer at 33 rows in every precision (docs/benchmarks.md). What bounds it: each head's
work (~7 M fp32 FMAs at 64 rows) runs on the CUDA cores of one SM, the FMA products of 64 x 128 fp32 tiles spill
(ptxas: 255 registers and ~10 kB of spill stores a thread at 8 warps), 33 rows pad to 64, and the doubling inverse
multiplies whole 64 x 64 tiles (3.1 M FMAs) where only the diagonal blocks carry work (0.09 M).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels.recurrent.triton_gdn import _check

PRECISIONS = ("ieee", "tf32x3")


@triton.jit
def _gdn_tree_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, bits_ptr, s_ptr, o_ptr,
    T, q_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_ot, stride_oh,
    RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, T_PAD: tl.constexpr, LOG_T: tl.constexpr,
    BLOCK_V: tl.constexpr, PART_V: tl.constexpr, PRECISION: tl.constexpr,
):
    j = tl.program_id(0)                       # value head
    part = tl.program_id(1)                    # which PART_V columns of it
    hk = j // RATIO
    r = tl.arange(0, T_PAD)
    ok = r < T
    ik = tl.arange(0, DK)
    # l2-normalised k (and q below, scaled by dk^-0.5), as prepare_qk does; padding rows are zero and write nothing.
    k = tl.load(k_ptr + r[:, None] * stride_kt + hk * stride_kh + ik[None, :], mask=ok[:, None], other=0.0)
    k = k.to(tl.float32)
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    g = tl.load(g_ptr + r * stride_gt + j, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(b_ptr + r * stride_bt + j, mask=ok, other=0.0).to(tl.float32)
    bits = tl.load(bits_ptr + r, mask=ok, other=0)
    anc = ((bits[:, None] >> r[None, :].to(tl.int64)) & 1) != 0           # [t, s]: s on t's path (t included)
    G = tl.sum(tl.where(anc, g[None, :], 0.0), axis=1)
    # exp only where the mask holds: off the path G_t - G_s may be positive and overflow.
    decay = tl.where(anc, tl.exp(tl.where(anc, G[:, None] - G[None, :], 0.0)), 0.0)
    diag = r[:, None] == r[None, :]
    kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    A = tl.where(diag, 0.0, beta[:, None] * decay * kk)
    X = tl.where(diag, 1.0, 0.0)
    for lvl in tl.static_range(LOG_T):
        # blocks of b = 2^lvl: row and column in one 2b block, the row in its lower half, the column in its upper
        lower = ((r[:, None] >> (lvl + 1)) == (r[None, :] >> (lvl + 1))) & (((r[:, None] >> lvl) & 1) == 1) \
            & (((r[None, :] >> lvl) & 1) == 0)
        fill = tl.dot(tl.where(lower, A, 0.0), X, input_precision=PRECISION)
        X = X - tl.dot(X, fill, input_precision=PRECISION)
    eg = tl.exp(G)
    W = tl.dot(X, (beta * eg)[:, None] * k, input_precision=PRECISION)   # [T, DK]: X diag(beta e^G) K
    # q only now: [T, DK] tiles are what fills the registers, so fewer of them live through the inverse.
    q = tl.load(q_ptr + r[:, None] * stride_qt + hk * stride_qh + ik[None, :], mask=ok[:, None], other=0.0)
    q = q.to(tl.float32)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6) * q_scale)[:, None]
    P = decay * tl.dot(q, tl.trans(k), input_precision=PRECISION)
    Qs = eg[:, None] * q - tl.dot(P, W, input_precision=PRECISION)     # multiplies S0
    Pv = tl.dot(P, X * beta[None, :], input_precision=PRECISION)       # multiplies V
    for i in range(PART_V // BLOCK_V):
        iv = part * PART_V + i * BLOCK_V + tl.arange(0, BLOCK_V)
        v = tl.load(v_ptr + r[:, None] * stride_vt + j * stride_vh + iv[None, :], mask=ok[:, None], other=0.0)
        S = tl.load(s_ptr + j * DK * DV + ik[:, None] * DV + iv[None, :])
        o = tl.dot(Pv, v.to(tl.float32), input_precision=PRECISION) + tl.dot(Qs, S, input_precision=PRECISION)
        tl.store(o_ptr + r[:, None] * stride_ot + j * stride_oh + iv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=ok[:, None])


def gdn_tree_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, bits: torch.Tensor, out_dtype: torch.dtype = torch.float32, *,
                    precision: str = "ieee", parts: int = 1, block_v: int = 32,
                    num_warps: int | None = None) -> torch.Tensor:
    """Tree GDN of ``T <= 64`` rows; same contract as :func:`edgespec.kernels.verify.tree.gdn_tree_ref`, with the
    ancestor mask given as :class:`~edgespec.kernels.verify.tree.TreeMask`'s ``bits`` (``[T]`` int64, bit s of row t
    set when s is on t's path). ``state`` is read, never written. Returns ``o [T, Hv, dv]`` in ``out_dtype``.
    ``precision``, ``parts`` (programs per value head, each redoing the head's T x T work for its share of dv),
    ``block_v`` and ``num_warps``: the launch (benchmarks try others; the defaults are what a forward uses: one part
    per head, faster than two on a 27B layer at 33 rows on an H200)."""
    q, k, v = _check(q, k, v, g, beta, state)
    T, n_k, dk = q.shape
    n_v, dv = v.shape[1], v.shape[2]
    if not 1 <= T <= 64:
        raise ValueError(f"a tree GDN takes 1 to 64 rows, got {T}")
    if bits.shape != (T,) or bits.dtype != torch.int64 or bits.device != v.device:
        raise ValueError(f"tree GDN ancestor bits must be an int64 [{T}] tensor on {v.device}")
    if precision not in PRECISIONS:
        raise ValueError(f"tree GDN precision {precision!r}: give one of {', '.join(PRECISIONS)}")
    if g.stride(-1) != 1 or beta.stride(-1) != 1:
        raise ValueError("tree GDN gates need a unit-stride last dim")
    block_v = min(block_v, dv)
    if parts < 1 or dv % (parts * block_v):
        raise ValueError(f"tree GDN: {parts} parts of {block_v}-wide tiles do not divide dv={dv}")
    t_pad = max(16, triton.next_power_of_2(T))   # tl.dot needs 16 rows at least
    out = torch.empty((T, n_v, dv), dtype=out_dtype, device=v.device)
    bits = bits.contiguous()
    _gdn_tree_kernel[(n_v, parts)](
        q, k, v, g, beta, bits, state, out,
        T, dk ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1),
        RATIO=n_v // n_k, DK=dk, DV=dv, T_PAD=t_pad, LOG_T=t_pad.bit_length() - 1, BLOCK_V=block_v,
        PART_V=dv // parts, PRECISION=precision, num_warps=num_warps or (8 if t_pad * dk >= 4096 else 4),
    )
    return out
