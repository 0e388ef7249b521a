"""All caches of one target model for one request: a KV cache per attention layer, a state per GDN layer.

``length`` is the number of positions whose K/V and state are valid. Attention rows past ``length`` are garbage
that the next write overwrites, which makes truncating an attention-only cache O(1). For GDN layers the state
must be put back explicitly: :meth:`rollback` does it from the per-step checkpoints of the last multi-row
forward (constant time) or, after a deferred forward, commits the kept rows into the untouched state;
:meth:`snapshot` / :meth:`restore_snapshot` serve the replay strategy.
"""

from __future__ import annotations

import torch

from edgespec.cache.kv import KVCache
from edgespec.cache.state import GDNState, GDNStateBank
from edgespec.errors import PromptTooLongError


class ModelCache:
    """Per-request cache of every layer plus the committed length."""

    def __init__(self, layers: list[KVCache | GDNState], max_len: int, states: GDNStateBank | None = None) -> None:
        self.layers = layers
        self.states = states
        self._kv_layers = [c for c in layers if isinstance(c, KVCache)]
        self._state_layers = [c for c in layers if isinstance(c, GDNState)]
        if self._state_layers and states is None:
            raise ValueError("GDN layers need their GDNStateBank (the stacked tensors every state copy goes through)")
        self.max_len = max_len
        self.length = 0
        self.resets = 0     # counts reset(): lets a PrefixCache notice that someone else started over in this cache
        # Start position and row count of the last forward that wrote per-step checkpoints (None: no such forward).
        self._ckpt_start: int | None = None
        self._ckpt_rows = 0
        # Start position and row count of a deferred forward whose rows are not committed yet (None: none).
        self._defer_start: int | None = None
        self._defer_rows = 0
        self._tree_start: int | None = None     # start of a tree forward not settled by commit_path yet
        self._tree_rows = 0
        # Multimodal RoPE: rows after a prompt's images sit at position = cache index + rope_delta (negative after
        # an image; edgespec.models.multimodal). The device copy (allocated by a model with a vision tower) is what
        # captured forwards read.
        self.rope_delta = 0
        self.rope_delta_t: torch.Tensor | None = None

    # -- queries ------------------------------------------------------------------------------------------------
    @property
    def kv_layers(self) -> list[KVCache]:
        return self._kv_layers

    @property
    def state_layers(self) -> list[GDNState]:
        return self._state_layers

    @property
    def has_state(self) -> bool:
        return self.states is not None

    @property
    def max_checkpoint_rows(self) -> int:
        """Largest multi-row forward that can save per-step checkpoints (slots minus the 'before' slot)."""
        return self.states.checkpoint_slots - 1 if self.states is not None else 1 << 30

    @property
    def max_deferred_rows(self) -> int:
        """Largest forward that can defer its GDN state update (rows of kept inputs)."""
        return self.states.defer_rows if self.states is not None else 1 << 30

    @property
    def deferred_pending(self) -> bool:
        """True between a deferred forward and the rollback/commit that settles it."""
        return self._defer_start is not None

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)

    def check_room(self, start: int, rows: int) -> None:
        if self._tree_start is not None:
            raise ValueError(f"the tree forward at {self._tree_start} is not committed: call commit_path first")
        if self._defer_start is not None:
            # A forward now would read GDN states that are missing the deferred rows.
            raise ValueError(f"a deferred forward at {self._defer_start} is not committed: call rollback first")
        if start + rows > self.max_len:
            raise PromptTooLongError(
                f"sequence of {start + rows} tokens exceeds max_seq_len {self.max_len}")

    # -- mutation -----------------------------------------------------------------------------------------------
    def set_rope_delta(self, delta: int) -> None:
        """Position minus cache index of the rows written from now on (text after a prompt's images)."""
        if delta != self.rope_delta:
            if self.rope_delta_t is None:
                raise ValueError("a rope delta needs a cache of a model with a vision tower (rope_delta_t)")
            self.rope_delta_t.fill_(delta)
            self.rope_delta = delta

    def reset(self) -> None:
        self.set_rope_delta(0)
        self.length = 0
        self.resets += 1
        self._ckpt_start = None
        self._defer_start = None
        self._tree_start = None
        if self.states is not None:
            self.states.reset()

    def begin_checkpointed_forward(self, start: int, rows: int) -> None:
        """Called by a model before a forward that saves per-step GDN checkpoints (slot 0 = state before)."""
        self.mark_checkpointed_forward(start, rows)
        self.save_states()

    def mark_checkpointed_forward(self, start: int, rows: int) -> None:
        """Host-side bookkeeping of a checkpointed forward (a CUDA-graph replay does the device part itself)."""
        if rows > self.max_checkpoint_rows:
            raise ValueError(f"checkpointed forward of {rows} rows exceeds {self.max_checkpoint_rows} slots")
        self._ckpt_start, self._ckpt_rows = start, rows

    def begin_deferred_forward(self, start: int, rows: int) -> None:
        """Host bookkeeping of a forward whose GDN layers keep their state and stash each row's inputs."""
        if rows > self.max_deferred_rows:
            raise ValueError(f"deferred forward of {rows} rows exceeds the {self.max_deferred_rows} rows kept")
        self._defer_start, self._defer_rows = start, rows

    def save_states(self) -> None:
        """Device part: copy every live GDN state to slot 0."""
        if self.states is not None:
            self.states.save(0)

    def rollback(self, length: int) -> None:
        """Make the cache hold exactly ``length`` positions after a longer forward.

        Attention layers: O(1). GDN layers: after a deferred forward, advance the state by its first
        ``length - start`` rows (also when every row is kept: the state has not moved yet); otherwise copy the
        checkpoint saved after row ``length - start - 1`` of the last checkpointed forward. A rollback outside
        that forward's rows is impossible and raises.
        """
        if length > self.length:
            raise ValueError(f"cannot roll back forward from {self.length} to {length}")
        if self._defer_start is not None:
            start = self._defer_start
            if not start <= length <= start + self._defer_rows:
                raise ValueError(f"cannot commit length {length} of the deferred forward at {start} "
                                 f"({self._defer_rows} rows)")
            self.states.advance(length - start)
            self._defer_start = None
        elif self.has_state and length != self.length:
            start = self._ckpt_start
            if start is None or not (start <= length <= start + self._ckpt_rows):
                raise ValueError(f"no state checkpoint for length {length} (last checkpointed forward: "
                                 f"start {start}, rows {self._ckpt_rows})")
            self.states.restore(length - start)
        self.length = length

    def commit_path(self, rows: list[int]) -> None:
        """Settle a tree forward (``TargetModel.forward(tree=...)``): keep its rows ``rows`` -- the accepted path,
        root first, each row's parent before it -- as positions ``start .. start+len(rows)-1``. Attention layers move
        those K/V rows to the positions of their depths; GDN states advance along the path only."""
        start = self._tree_start
        if start is None:
            raise ValueError("commit_path without a tree forward to settle")
        if not rows or rows[0] != 0 or any(b <= a for a, b in zip(rows, rows[1:], strict=False)):
            raise ValueError(f"a tree path starts at row 0 and goes down the rows in order, got {rows}")
        n = len(rows)
        if rows != list(range(n)):
            device = self._kv_layers[0].k.device if self._kv_layers else self.states.conv.device
            src = torch.tensor(rows, device=device)
            if self._kv_layers:
                dst = torch.arange(start, start + n, device=device)
                for kv in self._kv_layers:
                    kv.move_rows(src + start, dst)
            if self._defer_start is not None:
                self.states.take_rows(src)
        self.length = start + n         # attention rows past it are garbage the next write overwrites
        self.rollback(start + n)        # commits the deferred GDN rows (now the path's) into the states
        self._tree_start = None

    def commit_path_tensor(self, path: torch.Tensor, kept: torch.Tensor, start: torch.Tensor) -> None:
        """Device part of settling a tree forward written at ``start [1]`` (a device tensor): keep its rows
        ``path [P]`` (a device index tensor, root first) of which the first ``kept [1]`` count, moving them to the
        positions ``start .. start+kept-1`` (every K/V row ``start + path[d] -> start + d``: rows past ``kept`` are
        garbage afterwards, so a fixed-length move of all P is right) and advancing the GDN states along them. No
        host value: a captured tree commit runs it (``edgespec.arch.tree_graphs``); :meth:`settle_tree` then does
        the host bookkeeping."""
        steps = torch.arange(path.shape[0], device=path.device)
        for kv in self._kv_layers:
            kv.move_rows(start + path, start + steps)
        if self.states is not None:
            self.states.advance_path(path, kept)

    def settle_tree(self, start: int, kept: int) -> None:
        """Host part after :meth:`commit_path_tensor`: the cache holds ``start + kept`` positions and no forward is
        pending. ``start`` must be the tree forward's, ``kept`` within its rows."""
        if self._tree_start != start:
            raise ValueError(f"settle_tree at {start}: the tree forward to settle is at {self._tree_start}")
        if not 1 <= kept <= self._tree_rows:
            raise ValueError(f"settle_tree: {kept} kept rows, the tree forward at {start} has {self._tree_rows}")
        self.length = start + kept
        self._defer_start = None
        self._tree_start = None

    def begin_tree_forward(self, start: int, rows: int) -> None:
        """Host bookkeeping of a tree forward: its GDN layers defer (state untouched, inputs kept per row) and
        :meth:`commit_path` must settle it before the next forward."""
        if self.has_state:
            self.begin_deferred_forward(start, rows)
        self._tree_start, self._tree_rows = start, rows

    def snapshot(self) -> None:
        """Save the live GDN state in slot 0 (replay strategy); the attention rows need no copy."""
        self._ckpt_start, self._ckpt_rows = self.length, 0
        self.save_states()

    def restore_snapshot(self) -> int:
        """Put back the state saved by :meth:`snapshot` and return the length it was taken at."""
        if self._ckpt_start is None:
            raise ValueError("restore_snapshot without a snapshot")
        if self.states is not None:
            self.states.restore(0)
        self.length = self._ckpt_start
        return self.length


def state_equal(a: ModelCache, b: ModelCache, atol: float = 0.0) -> bool:
    """True when both caches hold the same committed content (valid attention rows and GDN states)."""
    if a.length != b.length:
        return False
    n = a.length
    for x, y in zip(a.layers, b.layers, strict=True):
        if isinstance(x, KVCache):
            pairs = [(x.k[:n].float(), y.k[:n].float()), (x.v_rows(n).float(), y.v_rows(n).float())]
        else:
            pairs = [(x.conv, y.conv), (x.recurrent, y.recurrent)]
        for p, q in pairs:
            if not torch.allclose(p.float(), q.float(), atol=atol, rtol=0):
                return False
    return True
