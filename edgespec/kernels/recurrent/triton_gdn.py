"""Gated DeltaNet in Triton: recurrent form (decode/verify, per-step checkpoints), chunked form (prefill).

Contract and shapes: :mod:`edgespec.kernels.recurrent.gdn`. The recurrent kernel (decode / verify) launches one program
per (value head, dv tile) and keeps that tile of the fp32 state ``S [dk, BLOCK_V]`` in registers for all T
rows: the state is read once and written once (plus one write per row into the checkpoint slots when asked),
which is the floor for this op. The l2-normalisation of q and k, the ``dk^-0.5`` query scale and the key-head
repeat (value head j reads key head ``j // (Hv / Hk)``) happen in the kernel, so the caller passes the raw
post-conv activations, which may be strided views of the fused conv output (last dim contiguous).

The chunked form (prefill) has two halves. The intra-chunk, state-independent half (l2-norm, cumulative
decays, the lower-triangular solve ``(I + A) [W | U0] = [beta exp(G) K | beta V]`` of the WY form, the masked
``Q K^T``) runs for all chunks at once in batched torch: a handful of large launches, no per-chunk Python
loop. The triangular solve is deliberately batched torch (block-doubling inverse): an in-register forward
substitution over 64 rows runs at half the speed of the whole torch reference on an H200 (64 dependent steps of
cross-warp reductions; probably register spills too), and inverting by repeated
squaring is numerically unsafe when neighbouring keys are nearly parallel. The inter-chunk half, the
sequential scan ``U = U0 - W S; O = Qg S + P U; S = e^{G_C} S + Kt^T U``, is one Triton launch with the state
tile in registers and IEEE-fp32 matrix products, so the result tracks the fp32 reference rather than a tf32
approximation of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels.launch.triton_pdl import pdl_launch, pdl_release, pdl_wait
from edgespec.kernels.options import KernelOptions, active
from edgespec.kernels.recurrent.gdn_common import prepare_qk, triton_chunk_ok


# T, write_state and save_slots are not specialised: decode (T=1), verify (T=K+1, with or without checkpoints),
# the deferred verify (no state write) and the commit then run one compiled kernel, so every step rounds the same
# way whichever of them runs it (a T=1 or no-store specialisation lets the compiler contract the last step's
# products differently: deferred and updating verifies would differ in the last bit).
@triton.jit(do_not_specialize=["T", "write_state", "save_slots"])
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, slots_ptr, o_ptr,
    T, q_scale, write_state, save_slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_ot, stride_oh, stride_slot,
    stride_ql, stride_kl, stride_vl, stride_gl, stride_bl, stride_sl, stride_ol,
    RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # Grid: (value head, dv tile, layer). One launch can advance the states of every layer of a model at once
    # (``gdn_advance_triton``: stacked inputs, layer strides); a forward passes one layer and zero strides. The
    # commit runs this very code, outputs included (into scratch), so its state rounds exactly like decode's.
    j = tl.program_id(0)
    vb = tl.program_id(1)
    layer = tl.program_id(2)
    q_ptr += layer * stride_ql
    o_ptr += layer * stride_ol
    k_ptr += layer * stride_kl
    v_ptr += layer * stride_vl
    g_ptr += layer * stride_gl
    b_ptr += layer * stride_bl
    s_ptr += layer * stride_sl
    hk = j // RATIO
    ik = tl.arange(0, DK)
    iv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    s_off = j * DK * DV + ik[:, None] * DV + iv[None, :]
    S = tl.load(s_ptr + s_off)
    # Row t+1's inputs are loaded while row t computes: the loop is a chain of dependent steps, and without
    # the prefetch every step would wait a full memory latency before any arithmetic.
    q_n = tl.load(q_ptr + hk * stride_qh + ik)
    k_n = tl.load(k_ptr + hk * stride_kh + ik)
    v_n = tl.load(v_ptr + j * stride_vh + iv)
    g_n = tl.load(g_ptr + j)
    b_n = tl.load(b_ptr + j)
    for t in range(T):
        q = q_n.to(tl.float32)
        k = k_n.to(tl.float32)
        v = v_n.to(tl.float32)
        g = g_n.to(tl.float32)
        beta = b_n.to(tl.float32)
        more = t + 1 < T
        q_n = tl.load(q_ptr + (t + 1) * stride_qt + hk * stride_qh + ik, mask=more & (ik < DK))
        k_n = tl.load(k_ptr + (t + 1) * stride_kt + hk * stride_kh + ik, mask=more & (ik < DK))
        v_n = tl.load(v_ptr + (t + 1) * stride_vt + j * stride_vh + iv, mask=more & (iv < DV))
        g_n = tl.load(g_ptr + (t + 1) * stride_gt + j, mask=more)
        b_n = tl.load(b_ptr + (t + 1) * stride_bt + j, mask=more)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        S = S * tl.exp(g)
        kv_mem = tl.sum(S * k[:, None], axis=0)           # S^T k  -> [BLOCK_V]
        delta = (v - kv_mem) * beta
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)                # S^T q
        tl.store(o_ptr + t * stride_ot + j * stride_oh + iv, o)
        if save_slots != 0:
            tl.store(slots_ptr + (t + 1) * stride_slot + s_off, S)
    pdl_release(PDL)
    if write_state != 0:
        tl.store(s_ptr + s_off, S)


@triton.jit
def _gdn_chunk_scan_kernel(
    wu_ptr, qg_ptr, kt_ptr, p_ptr, gc_ptr, s_ptr, o_ptr,
    T, N, stride_ot, stride_oh,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
):
    """Carry the state through the chunks of one (value head, dv tile): the chunked form's inter-chunk half.

    Per chunk n (all inputs precomputed, state-independent, head-major ``[Hv, N, C, .]`` fp32):
      U = U0 - W S;   O = Qg S + P U;   S = exp(G_C) S + Kt^T U
    with ``wu = [W | U0]`` (last dim dk + dv), ``Qg = exp(G) Q``, ``Kt = exp(G_C - G) K``,
    ``P = tril(exp(G_t - G_s)) * Q K^T`` and ``gc = G_C``.
    """
    j = tl.program_id(0)
    vb = tl.program_id(1)
    ik = tl.arange(0, DK)
    iv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    ic = tl.arange(0, CHUNK)
    s_off = j * DK * DV + ik[:, None] * DV + iv[None, :]
    S = tl.load(s_ptr + s_off)
    for n in range(N):
        row0 = (j * N + n) * CHUNK                               # first row of this chunk, head-major
        w = tl.load(wu_ptr + (row0 + ic[:, None]) * (DK + DV) + ik[None, :])
        u0 = tl.load(wu_ptr + (row0 + ic[:, None]) * (DK + DV) + DK + iv[None, :])
        qg = tl.load(qg_ptr + (row0 + ic[:, None]) * DK + ik[None, :])
        kt = tl.load(kt_ptr + (row0 + ic[:, None]) * DK + ik[None, :])
        p = tl.load(p_ptr + (row0 + ic[:, None]) * CHUNK + ic[None, :])
        g_last = tl.load(gc_ptr + j * N + n)
        u = u0 - tl.dot(w, S, input_precision="ieee")
        o = tl.dot(qg, S, input_precision="ieee") + tl.dot(p, u, input_precision="ieee")
        t = n * CHUNK + ic
        tl.store(o_ptr + t[:, None] * stride_ot + j * stride_oh + iv[None, :], o, mask=t[:, None] < T)
        S = S * tl.exp(g_last) + tl.dot(tl.trans(kt), u, input_precision="ieee")
    tl.store(s_ptr + s_off, S)


def _diag_blocks(M: torch.Tensor, size: int) -> torch.Tensor:
    """View ``[..., C/size, size, size]`` of the diagonal ``size x size`` blocks of ``M [..., C, C]``."""
    n = M.shape[-1] // size
    blocks = M.unflatten(-1, (n, size)).unflatten(-3, (n, size))      # [..., n, size, n, size]
    return blocks.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """Inverse of a batch of unit lower-triangular ``[..., C, C]`` matrices (C a power of two).

    Recursive block doubling: once the diagonal blocks of size b are inverted, each block of size 2b is
    ``[[X11, 0], [-X22 L21 X11, X22]]``. log2(C) levels of batched matmuls, so a handful of large launches
    (a batched ``solve_triangular`` may run per matrix), with the accuracy of forward substitution (no powers
    of L are formed, unlike Neumann-series or squaring inverses).
    """
    C = L.shape[-1]
    X = torch.eye(C, dtype=L.dtype, device=L.device).expand_as(L).clone()
    b = 1
    while b < C:
        Ld, Xd = _diag_blocks(L, 2 * b), _diag_blocks(X, 2 * b)
        Xd[..., b:, :b] = -(Xd[..., b:, b:] @ (Ld[..., b:, :b] @ Xd[..., :b, :b]))   # writes into X
        b *= 2
    return X


def _chunk_prep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                chunk: int) -> tuple[torch.Tensor, ...]:
    """State-independent work of every chunk at once, in batched torch (a handful of launches, no loop).

    This is the intra-chunk half of :func:`edgespec.kernels.recurrent.gdn.gdn_chunked_ref` rearranged into the WY form:
    the triangular system ``(I + A) [W | U0] = [beta exp(G) K | beta V]`` is solved for all (head, chunk)
    pairs at once through :func:`_unit_lower_inverse`. Rows past T are zero-padded with g = beta = 0, which
    makes them write nothing and decay nothing.
    """
    T, n_v, dv = v.shape
    qn, kn = prepare_qk(q, k, n_v)                                  # [T, Hv, dk] fp32, normalised, repeated
    dk = qn.shape[-1]
    pad = (-T) % chunk
    vf, gf, bf = v.float(), g.float(), beta.float()
    if pad:
        qn, kn, vf = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (qn, kn, vf))
        gf, bf = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (gf, bf))
    n = (T + pad) // chunk

    def heads_chunks(x: torch.Tensor) -> torch.Tensor:           # [T', Hv, d] -> [Hv, N, C, d]
        return x.transpose(0, 1).reshape(n_v, n, chunk, x.shape[-1])

    Q, K, V = heads_chunks(qn), heads_chunks(kn), heads_chunks(vf)
    G = gf.t().reshape(n_v, n, chunk).cumsum(-1)                  # inclusive cumulative log decay
    B = bf.t().reshape(n_v, n, chunk)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    strict = decay.masked_fill(torch.eye(chunk, dtype=torch.bool, device=v.device), 0.0)
    A = B[..., :, None] * strict * (K @ K.transpose(-1, -2))
    A.diagonal(dim1=-2, dim2=-1).fill_(1.0)                        # I + A
    eg = G.exp()[..., None]
    rhs = torch.cat([B[..., None] * eg * K, B[..., None] * V], dim=-1)
    wu = _unit_lower_inverse(A) @ rhs
    P = decay * (Q @ K.transpose(-1, -2))
    qg = eg * Q
    kt = (G[..., -1:] - G).exp()[..., None] * K
    return wu.contiguous(), qg.contiguous(), kt.contiguous(), P.contiguous(), G[..., -1].contiguous(), n, dk


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Validate shapes and make the last dims unit-stride (a copy only if a caller passed something odd)."""
    T, n_k, dk = q.shape
    n_v, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != T or g.shape != (T, n_v) or beta.shape != (T, n_v):
        raise ValueError(f"GDN shape mismatch: q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} "
                         f"g{tuple(g.shape)} beta{tuple(beta.shape)}")
    if n_v % n_k:
        raise ValueError(f"{n_v} value heads do not group over {n_k} key heads")
    if state.shape != (n_v, dk, dv) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("GDN state must be a contiguous fp32 [Hv, dk, dv] tensor")
    if dk & (dk - 1) or dv & (dv - 1) or dk < 16 or dv < 16:
        raise ValueError(f"Triton GDN needs power-of-two head dims >= 16 (got dk={dk}, dv={dv})")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return q, k, v


# Launch of the recurrent kernel: (BLOCK_V, num_warps). See gdn_tile.
GDNTile = tuple[int, int]


def gdn_tile(dv: int, options: KernelOptions | None = None) -> GDNTile:
    """dv tile and warps of the recurrent kernel. Every call for one model must use the same launch -- the
    reductions' order depends on it, and decode, verify and the deferred commit have to round alike -- so it
    depends on the value-head width only.

    One warp per program: every reduction over dk stays inside the warp (shuffles, no shared-memory round trip
    and barrier), which is what the chain of dependent steps waits on. 16-wide dv tiles give Qwen3.5-4B / -27B
    heads 256 / 384 programs; wider tiles, narrower ones and more warps are slower (docs/benchmarks.md,
    "Kernel launch choices").
    The ``gdn_block_v`` / ``gdn_warps`` kernel options (``EDGESPEC_GDN_BLOCK_V`` / ``EDGESPEC_GDN_WARPS``;
    checked by :class:`~edgespec.kernels.options.KernelOptions`) override it for tuning runs (``--gdn-sweep``
    passes its tiles directly); ``options``: those in force unless given."""
    opts = options or active()
    block_v = min(16, dv) if opts.gdn_block_v is None else min(opts.gdn_block_v, dv)
    warps = 1 if opts.gdn_warps is None else opts.gdn_warps
    return block_v, warps


def gdn_recurrent_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor,
                         slots: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                         update_state: bool = True, tile: GDNTile | None = None) -> torch.Tensor:
    """Recurrent GDN over T rows; same contract as :func:`edgespec.kernels.recurrent.gdn.gdn_recurrent_ref`.

    Updates ``state`` in place (unless ``update_state`` is False) and, with ``slots [>=T+1, Hv, dk, dv]``, writes
    the state after row i to slot i+1. Returns ``o [T, Hv, dv]`` in ``out_dtype`` (rounded from fp32 by the store).
    ``tile``: the launch (:func:`gdn_tile`'s by default; benchmarks try others).
    """
    q, k, v = _check(q, k, v, g, beta, state)
    T, n_k, dk = q.shape
    n_v, dv = v.shape[1], v.shape[2]
    out = torch.empty((T, n_v, dv), dtype=out_dtype, device=v.device)
    if slots is not None:
        if slots.shape[0] < T + 1 or slots.shape[1:] != state.shape or not slots.is_contiguous():
            raise ValueError("slots must be a contiguous [>=T+1, Hv, dk, dv] fp32 tensor")
    if T == 0:
        return out
    block_v, warps = tile or gdn_tile(dv)
    pdl = pdl_launch(v.device)
    _gdn_recurrent_kernel[(n_v, dv // block_v, 1)](
        q, k, v, g, beta, state, slots if slots is not None else state, out,
        T, dk ** -0.5, int(update_state), int(slots is not None),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), slots.stride(0) if slots is not None else 0,
        0, 0, 0, 0, 0, 0, 0,
        RATIO=n_v // n_k, DK=dk, DV=dv, BLOCK_V=block_v, PDL=bool(pdl), **pdl,
        num_warps=warps,
    )
    return out


def gdn_advance_triton(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor) -> None:
    """Advance the states of L layers by n rows in ONE launch (the deferred commit of a verify).

    ``k [L, n, Hk, dk]``, ``v [L, n, Hv, dv]`` (strided views are fine, last dim contiguous), ``g, beta [L, n, Hv]``
    fp32, ``states [L, Hv, dk, dv]`` fp32 contiguous, updated in place. The kernel is the decode/verify kernel,
    run whole (its outputs go to a scratch tensor): a variant without them would be compiled differently and
    need not round alike, while this one leaves each state exactly as n single-row steps would.
    """
    L, n, n_k, dk = k.shape
    n_v, dv = v.shape[2], v.shape[3]
    if (v.shape[:2] != (L, n) or g.shape != (L, n, n_v) or beta.shape != g.shape
            or states.shape != (L, n_v, dk, dv)):
        raise ValueError(f"GDN advance shapes: k{tuple(k.shape)} v{tuple(v.shape)} g{tuple(g.shape)} "
                         f"beta{tuple(beta.shape)} states{tuple(states.shape)}")
    if states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError("GDN states must be a contiguous fp32 [L, Hv, dk, dv] tensor")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or g.stride(-1) != 1 or beta.stride(-1) != 1:
        raise ValueError("GDN advance inputs need a unit-stride last dim")
    if n == 0 or L == 0:
        return
    block_v, warps = gdn_tile(dv)
    scratch = torch.empty((L, n, n_v, dv), dtype=torch.float32, device=v.device)
    pdl = pdl_launch(v.device)
    _gdn_recurrent_kernel[(n_v, dv // block_v, L)](
        k, k, v, g, beta, states, states, scratch,
        n, dk ** -0.5, 1, 0,
        k.stride(1), k.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        g.stride(1), beta.stride(1),
        scratch.stride(1), scratch.stride(2), 0,
        k.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), states.stride(0), scratch.stride(0),
        RATIO=n_v // n_k, DK=dk, DV=dv, BLOCK_V=block_v, PDL=bool(pdl), **pdl,
        num_warps=warps,
    )


def gdn_chunked_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, chunk: int = 64,
                       block_v: int = 32) -> torch.Tensor:
    """Chunked GDN for prefill; same contract as :func:`edgespec.kernels.recurrent.gdn.gdn_chunked_ref`.

    Two stages: the state-independent intra-chunk work (normalisation, decays, the triangular solve) for
    all chunks at once in batched torch (:func:`_chunk_prep`), then one Triton launch that carries the state
    through the chunks in order, one program per (value head, dv tile), with the state tile in registers.
    ``chunk`` must be a power of two in [16, 128] (ValueError otherwise; ``gdn_chunked`` gives other chunk sizes
    to the torch reference).
    """
    q, k, v = _check(q, k, v, g, beta, state)
    T, n_v, dv = v.shape
    if not triton_chunk_ok(chunk):
        raise ValueError(f"Triton chunked GDN takes a power-of-two chunk in [16, 128], got {chunk}")
    out = torch.empty((T, n_v, dv), dtype=torch.float32, device=v.device)
    if T == 0:
        return out
    wu, qg, kt, P, g_last, n, dk = _chunk_prep(q, k, v, g, beta, chunk)
    block_v = min(block_v, dv)
    _gdn_chunk_scan_kernel[(n_v, dv // block_v)](
        wu, qg, kt, P, g_last, state, out,
        T, n, out.stride(0), out.stride(1),
        DK=dk, DV=dv, BLOCK_V=block_v, CHUNK=chunk,
        num_warps=8, num_stages=2,
    )
    return out
