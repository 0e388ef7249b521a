"""Gated DeltaNet: the recurrent form (decode and verify, with per-step checkpoints or a deferred state update), the
multi-layer advance (the deferred commit) and the chunked form (prefill).

Shapes (batch 1, one layer):
  q, k  [T, Hk, dk]  raw post-conv activations (l2-normalised here, q also scaled by dk^-0.5)
  v     [T, Hv, dv]
  g     [T, Hv]      log decay (<= 0), fp32
  beta  [T, Hv]      write strength in (0, 1), fp32
  state [Hv, dk, dv] fp32, updated in place
Value head j reads key head j // (Hv / Hk). Per head and step:
  S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q.
Both forms return ``o [T, Hv, dv]`` in fp32 and leave the same final state (to rounding).
"""

from __future__ import annotations

import torch

from edgespec.kernels import use_triton
from edgespec.kernels.recurrent.gdn_common import prepare_qk, triton_chunk_ok


def gdn_recurrent_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, slots: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Step the recurrence over T rows. With ``slots [>=T+1, Hv, dk, dv]`` the state after row i goes to slot i+1.
    Returns ``o [T, Hv, dv]`` computed in fp32, in ``out_dtype``."""
    q, k = prepare_qk(q, k, v.shape[1])
    v = v.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    s = state
    for t in range(v.shape[0]):
        s.mul_(g[t].float().exp()[:, None, None])
        kv_mem = torch.einsum("hkv,hk->hv", s, k[t])
        delta = (v[t] - kv_mem) * beta[t].float()[:, None]
        s.add_(k[t][:, :, None] * delta[:, None, :])
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
        if slots is not None:
            slots[t + 1].copy_(s)
    return out.to(out_dtype)


def gdn_chunked_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Chunked form for prefill: per chunk of C rows, solve the intra-chunk delta rule as one triangular system.

    Within a chunk with cumulative log decay G (inclusive) and initial state S0, the writes U = [delta_t] satisfy
      (I + A) U = beta * (V - exp(G) * (K S0)),   A[t, s] = beta_t exp(G_t - G_s) (k_t . k_s)  for s < t,
    then  O = exp(G) * (Q S0) + (tril(exp(G_t - G_s)) * (Q K^T)) U  and
          S_C = exp(G_C) S0 + sum_s exp(G_C - G_s) k_s u_s^T.
    Decay factors are formed as exp of differences (each <= 1), never as exp(G_t) / exp(G_s), so nothing overflows.
    """
    q, k = prepare_qk(q, k, v.shape[1])
    v = v.float()
    g = g.float()
    beta = beta.float()
    T = v.shape[0]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    # Work head-major: [H, C, d].
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    gh, bh = g.transpose(0, 1), beta.transpose(0, 1)
    s = state
    for c0 in range(0, T, chunk):
        c1 = min(c0 + chunk, T)
        qc, kc, vc, bc = qh[:, c0:c1], kh[:, c0:c1], vh[:, c0:c1], bh[:, c0:c1]
        G = gh[:, c0:c1].cumsum(-1)                                   # [H, C]
        C = c1 - c0
        lower = torch.tril(torch.ones(C, C, dtype=torch.bool, device=v.device))
        diff = (G[:, :, None] - G[:, None, :]).masked_fill(~lower, float("-inf"))
        decay = diff.exp()                                             # [H, C, C], exp(G_t - G_s) for s <= t
        strict = decay.masked_fill(torch.eye(C, dtype=torch.bool, device=v.device), 0.0)
        A = bc[:, :, None] * strict * (kc @ kc.transpose(-1, -2))
        eye = torch.eye(C, dtype=torch.float32, device=v.device).expand_as(A)
        rhs = bc[:, :, None] * (vc - G.exp()[:, :, None] * (kc @ s))
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        o = G.exp()[:, :, None] * (qc @ s) + (decay * (qc @ kc.transpose(-1, -2))) @ u
        out[c0:c1] = o.transpose(0, 1)
        tail = (G[:, -1:] - G).exp()                                   # [H, C]
        s.mul_(G[:, -1].exp()[:, None, None])
        s.add_((kc * tail[:, :, None]).transpose(-1, -2) @ u)
    return out


def gdn_advance_ref(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    states: torch.Tensor) -> None:
    """Advance L layers' states by n rows: ``k [L, n, Hk, dk]``, ``v [L, n, Hv, dv]``, ``g, beta [L, n, Hv]``,
    ``states [L, Hv, dk, dv]`` (in place). Each layer steps exactly as :func:`gdn_recurrent_ref` does."""
    for layer in range(states.shape[0]):
        gdn_recurrent_ref(k[layer], k[layer], v[layer], g[layer], beta[layer], states[layer])


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, slots: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.float32, update_state: bool = True) -> torch.Tensor:
    """Dispatch: Triton on CUDA, else the torch reference. Same contract as :func:`gdn_recurrent_ref`;
    ``update_state=False`` leaves ``state`` as it was (a deferred verify: :func:`gdn_advance` commits later)."""
    if use_triton(v):
        from edgespec.kernels.recurrent.triton_gdn import gdn_recurrent_triton
        return gdn_recurrent_triton(q, k, v, g, beta, state, slots, out_dtype, update_state)
    return gdn_recurrent_ref(q, k, v, g, beta, state if update_state else state.clone(), slots, out_dtype)


def gdn_advance(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor) -> None:
    """Dispatch: one Triton launch for all layers on CUDA, else :func:`gdn_advance_ref`."""
    if use_triton(v):
        from edgespec.kernels.recurrent.triton_gdn import gdn_advance_triton
        gdn_advance_triton(k, v, g, beta, states)
    else:
        gdn_advance_ref(k, v, g, beta, states)


def gdn_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Dispatch: Triton on CUDA for the chunk sizes it takes, else the torch reference. Same contract as
    :func:`gdn_chunked_ref`."""
    if use_triton(v) and triton_chunk_ok(chunk):
        from edgespec.kernels.recurrent.triton_gdn import gdn_chunked_triton
        return gdn_chunked_triton(q, k, v, g, beta, state, chunk)
    return gdn_chunked_ref(q, k, v, g, beta, state, chunk)
