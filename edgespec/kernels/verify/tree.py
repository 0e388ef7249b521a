"""Tree verification kernels: attention, short convolution and Gated DeltaNet over a draft tree in one forward.

The verify rows of a tree (row 0 = the root, the token the verify starts from; then the draft nodes in depth-first
pre-order, see :mod:`edgespec.drafters.tree`) are written to cache rows ``start .. start+T-1`` in row order, but
each row sits at position ``start + depth`` and must see only the committed prefix and its own ancestors:

* attention: key ``n`` is visible to row ``t`` when ``n < start`` (the prefix) or ``n - start`` is an ancestor of
  ``t`` (itself included) -- the causal mask with the tree's ancestor mask in its diagonal block;
* short convolution: row ``t``'s window is its own ``K-1`` nearest ancestors, continued into the committed conv
  state where the branch is shallower than the window;
* Gated DeltaNet: the chunked delta rule of :func:`edgespec.kernels.recurrent.gdn.gdn_chunked_ref` with ``tril``
  replaced by the ancestor mask and the cumulative decay summed along each row's own path. Parents precede children, so
  the system stays unit lower triangular. The committed state is read, never written: the commit advances it along the
  accepted path only (:meth:`edgespec.cache.model_cache.ModelCache.commit_path`).

Every op equals running each root-to-leaf branch as its own chain (tests/kernels/test_tree_kernels.py). The conv and
the GDN have Triton kernels too (:func:`tree_conv_gates`, :mod:`edgespec.kernels.verify.triton_tree_gdn`), checked
against these references and the chains (tests/kernels/test_tree_triton.py) and chosen on CUDA by the
``draft_tree_kernels`` kernel option: ``reference`` (the default), ``conv`` or ``triton``. The Triton GDN is
slower than the reference on a 27B layer on an H200 (docs/benchmarks.md), so neither is the default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from edgespec.cache.kv import KVCache
from edgespec.kernels import use_triton
from edgespec.kernels.options import active
from edgespec.kernels.pointwise.activation import gdn_gates
from edgespec.kernels.recurrent.gdn_common import prepare_qk

# Rows a tree forward may have: the Triton attention reads each row's ancestors as one 64-bit mask.
MAX_TREE_ROWS = 64
# Tree forwards up to this many rows take the Triton attention on CUDA (the reference reads the whole cache when the
# start is a device tensor, as a captured tree verify's is). 64: every tree (the GPU test covers 64-row trees).
TRITON_TREE_ROWS = 64


@dataclass
class TreeMask:
    """The per-row structure of one tree forward, on the model's device. Built once per verify by
    :meth:`from_parents`; every layer reads it."""

    parents: torch.Tensor            # [T] int64 parent row (-1: the root)
    depths: torch.Tensor             # [T] int64 depth (root 0): row t is at position start + depth
    ancestors: torch.Tensor          # [T, T] bool, [t, s] = s is an ancestor of t or t itself
    bits: torch.Tensor               # [T] int64, bit s set when ancestors[t, s] (Triton attention)
    _conv_index: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_parents(cls, parents: torch.Tensor, device: torch.device | str) -> TreeMask:
        """From the parent row of every row (row 0 has -1; every parent row precedes its child)."""
        par = [int(p) for p in parents.tolist()]
        T = len(par)
        if T > MAX_TREE_ROWS:
            raise ValueError(f"a tree forward takes at most {MAX_TREE_ROWS} rows, got {T}")
        if not par or par[0] != -1 or any(not 0 <= p < t for t, p in enumerate(par) if t > 0):
            raise ValueError(f"tree rows need row 0 as the only root and every parent before its child: {par}")
        depth = [0] * T
        bits = [0] * T
        for t, p in enumerate(par):
            if p >= 0:
                depth[t] = depth[p] + 1
                bits[t] = bits[p]
            bits[t] |= 1 << t
        # bit 63 is the sign bit of an int64: store the same 64 bits as a signed value.
        bits_t = torch.tensor([b - (1 << 64) if b >= 1 << 63 else b for b in bits], dtype=torch.int64)
        # The mask from the bits in one op (a captured tree verify builds one per cycle on the host; row by row
        # it would take two tensor ops per row). An arithmetic shift keeps every bit below the sign, so bit 63
        # reads right too.
        anc = ((bits_t[:, None] >> torch.arange(T)[None, :]) & 1).bool()
        return cls(torch.tensor(par, device=device), torch.tensor(depth, device=device), anc.to(device),
                   bits_t.to(device))

    @property
    def rows(self) -> int:
        return self.parents.shape[0]

    @classmethod
    def static(cls, rows: int, kernels: tuple[int, ...], device: torch.device | str) -> TreeMask:
        """Device buffers for trees of ``rows`` rows (a captured tree forward reads these addresses at every
        replay), with a conv index per kernel size in ``kernels``; :meth:`load` fills them. Starts as the root with
        ``rows - 1`` leaves, so a capture's warm-up runs a well-formed tree."""
        mask = cls.from_parents(torch.tensor([-1] + [0] * (rows - 1)), device)
        for kernel in kernels:
            mask.conv_index(kernel)
        return mask

    def load(self, other: TreeMask) -> None:
        """Copy ``other`` (a tree of as many rows, e.g. built on the CPU) into these buffers in place."""
        if other.rows != self.rows:
            raise ValueError(f"a tree of {other.rows} rows does not fit buffers of {self.rows}")
        for name in ("parents", "depths", "ancestors", "bits"):
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)
        for kernel, idx in self._conv_index.items():
            idx.copy_(other.conv_index(kernel), non_blocking=True)

    def conv_index(self, kernel: int) -> torch.Tensor:
        """``[T, kernel]`` column of ``cat(state [C, K-1], x^T [C, T])`` that each tap of each row's window reads:
        tap ``j`` (``K-1`` = the row itself) is the ancestor ``K-1-j`` steps up, or the committed state's column
        ``K-1-(steps - depth)`` once the branch ends at the root."""
        idx = self._conv_index.get(kernel)
        if idx is None:
            par = self.parents.tolist()
            depth = self.depths.tolist()
            table = []
            for t in range(len(par)):
                chain = [t]
                while len(chain) < kernel and par[chain[-1]] >= 0:
                    chain.append(par[chain[-1]])
                row = []
                for j in range(kernel):
                    up = kernel - 1 - j
                    row.append(kernel - 1 + chain[up] if up <= depth[t] else kernel - 1 - (up - depth[t]))
                table.append(row)
            idx = self._conv_index[kernel] = torch.tensor(table, device=self.parents.device)
        return idx


# -- attention --------------------------------------------------------------------------------------------------
def tree_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                       ancestors: torch.Tensor) -> torch.Tensor:
    """Reference: ``q [T, Hq, hd]``, ``k, v [>= start+T, Hkv, hd]`` dequantised. Returns ``[T, Hq, hd]``."""
    T = q.shape[0]
    visible = torch.cat([torch.ones(T, start, dtype=torch.bool, device=q.device), ancestors], dim=1)
    return _masked_attention(q, k[:start + T], v[:start + T], scale, visible)


def tree_attention_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_t: torch.Tensor, scale: float,
                      ancestors: torch.Tensor) -> torch.Tensor:
    """Reference with the start as a device tensor ``pos_t [1]`` (a captured tree forward): ``k, v`` are the whole
    preallocated cache, key ``n`` is visible to row ``t`` when ``n < start`` or ``n - start`` is an ancestor of ``t``.
    Shape-static (no host value), so capturable, at the cost of reading every cache row."""
    T, L = q.shape[0], k.shape[0]
    rel = torch.arange(L, device=q.device) - pos_t                               # [L]
    inside = (rel >= 0) & (rel < T)
    in_tree = ancestors[:, rel.clamp(0, T - 1)] & inside[None, :]                 # [T, L]
    return _masked_attention(q, k, v, scale, (rel < 0)[None, :] | in_tree)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      visible: torch.Tensor) -> torch.Tensor:
    """GQA attention of ``q [T, Hq, hd]`` over ``k, v [L, Hkv, hd]`` where ``visible [T, L]``."""
    T, Hq, hd = q.shape
    Hkv = k.shape[1]
    rep = Hq // Hkv
    qg = q.reshape(T, Hkv, rep, hd).permute(1, 2, 0, 3).reshape(Hkv, rep * T, hd)
    scores = torch.bmm(qg, k.permute(1, 2, 0).to(q.dtype)) * scale                  # [Hkv, rep*T, L]
    scores = scores.view(Hkv, rep, T, -1).masked_fill(~visible, float("-inf")).view(Hkv, rep * T, -1)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.bmm(probs, v.transpose(0, 1).to(q.dtype))
    return out.view(Hkv, rep, T, hd).permute(2, 0, 1, 3).reshape(T, Hq, hd)


def tree_attention(q: torch.Tensor, cache: KVCache, start: int, scale: float, tree: TreeMask,
                   pos_t: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the tree rows ``q`` over the cache rows ``0 .. start+T-1`` (tree rows written at ``start``, or
    at ``pos_t`` (a one-element device tensor) in a captured forward): the Triton split-K kernel with the ancestor
    bits on CUDA (every tree size: its row blocks cover up to 64 rows of 64-bit masks), else the reference."""
    T = q.shape[0]
    if T <= TRITON_TREE_ROWS and use_triton(q):
        from edgespec.kernels.attention.triton_attention import cached_attention_triton
        return cached_attention_triton(q, cache, start, scale, start_t=pos_t, tree_bits=tree.bits)
    if pos_t is not None:
        k, v = cache.read(cache.max_len)
        return tree_attention_at(q, k, v, pos_t, scale, tree.ancestors)
    k, v = cache.read(start + T)
    return tree_attention_ref(q, k, v, start, scale, tree.ancestors)


# -- short convolution ---------------------------------------------------------------------------------------------
def tree_conv_ref(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, tree: TreeMask) -> torch.Tensor:
    """``silu`` of the depthwise causal conv of every tree row over its own ancestors: ``x [T, C]`` new inputs,
    ``state [C, K-1]`` the committed window (untouched), ``weight [C, K]``. Returns ``[T, C]`` in x's dtype."""
    K = weight.shape[1]
    seq = torch.cat([state, x.t().to(state.dtype)], dim=1).to(weight.dtype)     # [C, K-1+T]
    windows = seq[:, tree.conv_index(K)]                                         # [C, T, K]
    conv = (windows * weight[:, None, :]).sum(-1)                                # [C, T]
    return F.silu(conv).t().to(x.dtype).contiguous()


def tree_conv_gates(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    A_log: torch.Tensor, dt_bias: torch.Tensor, tree: TreeMask, *, out: torch.Tensor,
                    x_save: torch.Tensor, gates_out: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A tree verify's conv (:func:`tree_conv_ref`'s contract) and its GDN gates: ``out [T, C]`` takes the conv,
    ``x_save [T, C]`` the inputs as the window stores them (what the commit replays along the accepted path) and
    ``gates_out`` ``(g, beta)``. On CUDA one Triton launch (the chain conv kernel walking each row's ancestors
    through the tree's parents on the device: nothing host-built, so it can be captured) when the ``draft_tree_kernels``
    kernel option is ``conv`` or ``triton``; else the reference."""
    if use_triton(x) and active().draft_tree_kernels != "reference":
        from edgespec.kernels.pointwise.triton_activation import check_gates
        from edgespec.kernels.recurrent.triton_conv import causal_conv1d_triton
        a, b, g, beta = check_gates(a, b, A_log, dt_bias, gates_out)
        causal_conv1d_triton(x, state, weight, update_state=False, out=out, x_save=x_save,
                             gates=(a, b, A_log, dt_bias, g, beta), tree=(tree.parents, tree.depths))
        return
    out.copy_(tree_conv_ref(x, state, weight, tree))
    x_save.copy_(x)
    gdn_gates(a, b, A_log, dt_bias, out=gates_out)


# -- Gated DeltaNet -----------------------------------------------------------------------------------------------
def gdn_tree_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """Every tree row's output from the committed ``state`` along its own branch; ``state`` is not modified.

    Shapes as :func:`edgespec.kernels.recurrent.gdn.gdn_chunked_ref` (one chunk of T rows). With ``M[t, s]`` the
    ancestor mask and ``G_t = sum_{s: M[t, s]} g_s`` (the decay summed along t's path), the writes U solve
      (I + A) U = beta * (V - exp(G) * (K S0)),  A[t, s] = beta_t exp(G_t - G_s) (k_t . k_s) for s a strict ancestor,
    and O = exp(G) * (Q S0) + (M * exp(G_t - G_s) * (Q K^T)) U. Exactly the chain recurrence along each branch: a
    row's state is S0 decayed along its path plus the writes of its ancestors, each decayed from where it was made.
    """
    q, k = prepare_qk(q, k, v.shape[1])
    v, g, beta = v.float(), g.float(), beta.float()
    M = ancestors
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)        # [H, T, d]
    gh, bh = g.transpose(0, 1), beta.transpose(0, 1)                             # [H, T]
    G = gh @ M.float().t()                                                       # [H, T]: G[h, t] = sum_s M[t,s] g[h,s]
    diff = (G[:, :, None] - G[:, None, :]).masked_fill(~M, float("-inf"))
    decay = diff.exp()                                                           # exp(G_t - G_s) on ancestors
    strict = decay.masked_fill(torch.eye(M.shape[0], dtype=torch.bool, device=M.device), 0.0)
    A = bh[:, :, None] * strict * (kh @ kh.transpose(-1, -2))
    eye = torch.eye(M.shape[0], dtype=torch.float32, device=v.device).expand_as(A)
    rhs = bh[:, :, None] * (vh - G.exp()[:, :, None] * (kh @ state))
    u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    o = G.exp()[:, :, None] * (qh @ state) + (decay * (qh @ kh.transpose(-1, -2))) @ u
    return o.transpose(0, 1).contiguous()


def gdn_tree(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, tree: TreeMask, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dispatch: :func:`edgespec.kernels.verify.triton_tree_gdn.gdn_tree_triton` on CUDA when the ``draft_tree_kernels``
    kernel option is ``triton``, else :func:`gdn_tree_ref` (the faster of the two on an H200, see the module docstring).
    ``state`` is read, never written. Returns ``[T, Hv, dv]``."""
    if use_triton(v) and active().draft_tree_kernels == "triton":
        from edgespec.kernels.verify.triton_tree_gdn import gdn_tree_triton
        return gdn_tree_triton(q, k, v, g, beta, state, tree.bits, out_dtype)
    return gdn_tree_ref(q, k, v, g, beta, state, tree.ancestors).to(out_dtype)
