"""Recurrent and convolution state of one Gated DeltaNet layer, with per-step checkpoints for rollback.

A GDN layer carries no per-position cache: its whole past is folded into ``recurrent [Hv, dk, dv]`` (fp32, as the
reference keeps it) and ``conv [conv_dim, kernel-1]`` (the last pre-conv inputs). Such state cannot be truncated,
so speculative decoding needs one of two rollback strategies (see ``arch``):

* checkpoint: a multi-row forward in ``StateMode.CHECKPOINT`` saves the state before row 0 in slot 0 and the
  state after row i in slot i+1; rolling back to "n rows accepted" copies slot n into the live state. Constant
  time, costs ``(K+2)`` state copies of memory.
* replay: the caller snapshots the live state (slot 0) before the forward, restores it, and re-runs the accepted
  rows. Needs one slot only.
* deferred: a multi-row forward in ``StateMode.DEFER`` leaves the live state as it was and keeps each row's
  inputs (the pre-conv row as the window stores it, the conv output, the decay and write strength: a few KB per
  row); the accept stage then advances every layer by the accepted rows (:meth:`GDNStateBank.advance`: one
  launch for all layers, the same recurrence kernel decode runs, so the state ends exactly as plain decoding
  leaves it). Per verify that is one state read in the forward and one read + write in the commit, where
  checkpoints write the whole state once per row (16 state writes for K=15).
"""

from __future__ import annotations

from enum import Enum

import torch

from edgespec.kernels.recurrent.gdn import gdn_advance


class StateMode(Enum):
    """What one forward does with the GDN states: the single mode argument of ``TargetModel.forward`` (a rollback
    strategy of ``edgespec.arch.rollback`` picks it for its verify). Attention-only caches ignore it."""

    ADVANCE = "advance"          # update the live state row by row (prefill, decode, a replay verify)
    CHECKPOINT = "checkpoint"    # update it and save the state after every row in its slot
    DEFER = "defer"              # leave it as it was and keep each row's inputs for the commit


class GDNState:
    """Live and checkpointed state of one Gated DeltaNet layer (batch 1): views into a :class:`GDNStateBank`,
    which copies between the live tensors and the slots for all layers at once."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor, conv_slots: torch.Tensor,
                 recurrent_slots: torch.Tensor, pending: PendingRows | None = None) -> None:
        self.conv = conv                        # [conv_dim, kernel-1]
        self.recurrent = recurrent              # [Hv, dk, dv] fp32
        # Slot 0 = state before the last checkpointed forward; slot i+1 = state after its row i.
        self.conv_slots = conv_slots            # [slots, conv_dim, kernel-1]
        self.recurrent_slots = recurrent_slots  # [slots, Hv, dk, dv] fp32
        self.pending = pending                  # inputs of a deferred forward's rows (None: no deferral)

    def nbytes(self) -> int:
        tensors = [self.conv, self.recurrent, self.conv_slots, self.recurrent_slots]
        if self.pending is not None:
            tensors += [self.pending.x, self.pending.qkv, self.pending.g, self.pending.beta]
        return sum(t.nbytes for t in tensors)


class PendingRows:
    """Per-row inputs a deferred forward keeps for its commit (views of one layer's rows, ``R`` = max rows)."""

    def __init__(self, x: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        self.x = x          # [R, conv_dim] pre-conv inputs in the conv window's dtype
        self.qkv = qkv      # [R, conv_dim] conv outputs (q | k | v), the recurrence's inputs
        self.g = g          # [R, Hv] fp32 log decay
        self.beta = beta    # [R, Hv] fp32 write strength


class GDNStateBank:
    """Every GDN layer's state and slots in four stacked tensors (layer-major, so each layer's views are
    contiguous for the kernels). Saving or restoring a slot for all layers is then one copy per tensor kind at
    copy bandwidth, where per-layer or multi-tensor ``_foreach_copy_`` copies ran several times slower
    (docs/benchmarks.md, "Design figures")."""

    def __init__(self, n_layers: int, conv_dim: int, conv_kernel: int, n_v_heads: int, k_head_dim: int,
                 v_head_dim: int, dtype: torch.dtype, device: torch.device | str, checkpoint_slots: int = 1,
                 defer_rows: int = 0) -> None:
        self.conv = torch.zeros(n_layers, conv_dim, conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(n_layers, n_v_heads, k_head_dim, v_head_dim, dtype=torch.float32,
                                     device=device)
        self.conv_slots = torch.zeros(n_layers, checkpoint_slots, conv_dim, conv_kernel - 1, dtype=dtype,
                                      device=device)
        self.recurrent_slots = torch.zeros(n_layers, checkpoint_slots, n_v_heads, k_head_dim, v_head_dim,
                                           dtype=torch.float32, device=device)
        # Deferred forwards: each row's inputs, layer-major so one launch advances every layer.
        self.key_dim = (conv_dim - n_v_heads * v_head_dim) // 2
        self.head_dims = (k_head_dim, v_head_dim)
        self.defer_rows = defer_rows
        self.graph_commits = False          # capture each row count's commit as a CUDA graph (see advance)
        self._commit_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._commit_pool = None
        self.pending_x = torch.zeros(n_layers, defer_rows, conv_dim, dtype=dtype, device=device)
        self.pending_qkv = torch.zeros(n_layers, defer_rows, conv_dim, dtype=dtype, device=device)
        self.pending_g = torch.zeros(n_layers, defer_rows, n_v_heads, dtype=torch.float32, device=device)
        self.pending_beta = torch.zeros(n_layers, defer_rows, n_v_heads, dtype=torch.float32, device=device)
        self.layers = [GDNState(self.conv[i], self.recurrent[i], self.conv_slots[i], self.recurrent_slots[i],
                                PendingRows(self.pending_x[i], self.pending_qkv[i], self.pending_g[i],
                                            self.pending_beta[i]) if defer_rows else None)
                       for i in range(n_layers)]

    @property
    def checkpoint_slots(self) -> int:
        return self.conv_slots.shape[1]

    def reset(self) -> None:
        """Zero every layer's live state (a new request)."""
        self.conv.zero_()
        self.recurrent.zero_()

    def save(self, slot: int) -> None:
        """Copy every layer's live state into ``slot``."""
        self.conv_slots[:, slot].copy_(self.conv)
        self.recurrent_slots[:, slot].copy_(self.recurrent)

    def restore(self, slot: int) -> None:
        """Copy ``slot`` of every layer back into the live state."""
        self.conv.copy_(self.conv_slots[:, slot])
        self.recurrent.copy_(self.recurrent_slots[:, slot])

    def advance(self, n: int) -> None:
        """Commit the first ``n`` rows of the last deferred forward: every layer's conv window and recurrent state
        move on by those rows, as ``n`` decode steps would have moved them.

        With :attr:`graph_commits` (set by the arch hooks when the session runs CUDA graphs) each row count's commit
        is captured once, at its first use, and replayed after that: eagerly it is a handful of launches, whose host
        cost in the accept stage was comparable to the GPU work (docs/benchmarks.md, "Design figures")."""
        if not 0 <= n <= self.defer_rows:
            raise ValueError(f"cannot advance by {n} rows: a deferred forward keeps at most {self.defer_rows}")
        if n == 0:
            return
        graph = self._commit_graphs.get(n) if self.graph_commits else None
        if graph is not None:
            graph.replay()
            return
        self._advance(n)
        if self.graph_commits and self.conv.is_cuda:
            # Capturing records the launches without running them, so the state just committed stays as it is.
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._commit_pool):
                self._advance(n)
            self._commit_pool = graph.pool()        # every row count's graph shares one memory pool
            self._commit_graphs[n] = graph

    def take_rows(self, rows: torch.Tensor) -> None:
        """Put the kept inputs of the deferred rows ``rows`` (a device index tensor, a tree's accepted path) first,
        in that order, so :meth:`advance` by ``len(rows)`` commits exactly that path."""
        n = rows.shape[0]
        for t in (self.pending_x, self.pending_qkv, self.pending_g, self.pending_beta):
            t[:, :n] = t.index_select(1, rows)

    def advance_path(self, rows: torch.Tensor, kept: torch.Tensor) -> None:
        """Commit the deferred rows ``rows [P]`` (a device index tensor: a tree's accepted path, root first), of which
        only the first ``kept [1]`` (a device tensor) count: the fixed-length, host-free form of :meth:`take_rows` +
        :meth:`advance` that a captured tree commit runs (``edgespec.arch.tree_graphs``).

        Rows past ``kept`` step the recurrence with decay 0 and write strength 0, which leaves each state exactly as
        it was (``S * exp(0) + k (v - S^T k) * 0``); the conv window takes the last ``K-1`` of the old window and
        the kept rows. The pending rows themselves are only read."""
        P = rows.shape[0]
        if P > self.defer_rows:
            raise ValueError(f"a path of {P} rows exceeds the {self.defer_rows} deferred rows kept")
        live = torch.arange(P, device=rows.device) < kept                       # [P]
        x = self.pending_x.index_select(1, rows)                                # [L, P, C]
        width = self.conv.shape[2]
        seq = torch.cat([self.conv, x.transpose(1, 2)], dim=2)                  # [L, C, K-1+P]
        self.conv.copy_(seq.index_select(2, kept + torch.arange(width, device=rows.device)))
        kd = self.key_dim
        dk, dv = self.head_dims
        qkv = self.pending_qkv.index_select(1, rows)
        zero = torch.zeros((), dtype=torch.float32, device=rows.device)
        g = torch.where(live[None, :, None], self.pending_g.index_select(1, rows), zero)
        beta = torch.where(live[None, :, None], self.pending_beta.index_select(1, rows), zero)
        k = qkv[..., kd:2 * kd].unflatten(-1, (kd // dk, dk))
        v = qkv[..., 2 * kd:].unflatten(-1, (-1, dv))
        gdn_advance(k, v, g, beta, self.recurrent)

    def _advance(self, n: int) -> None:
        # The window holds the last K-1 inputs: drop the n oldest, append the n accepted rows.
        seq = torch.cat([self.conv, self.pending_x[:, :n].transpose(1, 2)], dim=2)
        self.conv.copy_(seq[:, :, n:])
        kd = self.key_dim
        dk, dv = self.head_dims
        rows = self.pending_qkv[:, :n]
        k = rows[..., kd:2 * kd].unflatten(-1, (kd // dk, dk))
        v = rows[..., 2 * kd:].unflatten(-1, (-1, dv))
        gdn_advance(k, v, self.pending_g[:, :n], self.pending_beta[:, :n], self.recurrent)
