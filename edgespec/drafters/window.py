"""Per-token context window of the DFlash drafter: a fixed-size ring buffer of committed tokens' features.

The window holds one context feature per committed token (a token whose target forward has run, so its tapped
hidden states exist), for the last ``capacity`` such tokens, together with everything the drafter derives from a
feature alone: each drafter layer's context key (k_norm + RoPE at the token's absolute position) and value. A
draft then costs one block of queries against these cached keys instead of recomputing the window every cycle.

Layout: position ``t`` lives in slot ``t % capacity``. Attention does not care about key order, so the buffer is
never shifted; ``positions[slot]`` (-1 = empty) lets the caller build masks (validity, sliding window) from
absolute positions. All buffers are allocated once; an append writes only the new rows. ``scratch_rows`` extra
K/V rows after the ring (slots ``capacity ..``) are the caller's: the drafter writes its block's keys there, so
one attention call covers context + block without concatenating tensors every cycle.
"""

from __future__ import annotations

import torch

from edgespec.kernels.draft.window_write import window_store_ref, window_write


class FeatureWindow:
    """Ring buffer of the last ``capacity`` context features and their per-layer K/V, keyed by absolute position.

    Invariant kept by the owner (and checked here): appended positions are contiguous, so the window always
    holds the features of positions ``end - length .. end - 1`` in slots ``position % capacity``.
    """

    def __init__(self, capacity: int, feature_dim: int, n_layers: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, scratch_rows: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"window capacity {capacity} must be >= 1")
        self.capacity = capacity
        self.features = torch.zeros(capacity, feature_dim, dtype=dtype, device=device)
        self.keys = torch.zeros(n_layers, capacity + scratch_rows, n_kv_heads, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.positions = torch.full((capacity,), -1, dtype=torch.long, device=device)   # ring slots only
        self._arange = torch.arange(capacity, device=device)
        self.length = 0   # valid slots
        self.end = 0      # position after the newest feature (= next position to append)

    def reset(self) -> None:
        self.positions.fill_(-1)
        self.length = 0
        self.end = 0

    def append(self, start: int, features: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store rows for positions ``start .. start+r-1``.

        ``features [r, F]``, ``keys``/``values [n_layers, r, Hkv, hd]``. Only the last ``capacity`` rows are kept
        when ``r`` exceeds the capacity (older ones would be overwritten by the newer rows of the same append).
        """
        r = features.shape[0]
        if r == 0:
            return
        self.check_next(start)
        first = start
        if r > self.capacity:
            drop = r - self.capacity
            features, keys, values = features[drop:], keys[:, drop:], values[:, drop:]
            first = start + drop
        self.write(first + self._arange[:features.shape[0]], features, keys, values)
        self.advance(start, r)

    # The two halves of an append, for callers that run the device part inside a CUDA graph (positions then
    # come from a device tensor) and keep the host bookkeeping outside it.
    def check_next(self, start: int) -> None:
        """Raise unless ``start`` continues the window (any start is fine while it is empty)."""
        if self.length and start != self.end:
            raise ValueError(f"window append at position {start}, expected {self.end} (positions must be "
                             f"contiguous: one feature per committed token, in order)")

    def write(self, positions: torch.Tensor, features: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Device part: store rows of (at most ``capacity`` distinct, contiguous) ``positions [r]``."""
        window_store_ref(positions, features, keys, values, self.features, self.keys, self.values, self.positions)

    def write_at(self, start_t: torch.Tensor, features: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor) -> None:
        """Device part, start on the device: store rows of positions ``start_t[0] .. + r - 1`` (one launch on
        CUDA, :func:`~edgespec.kernels.draft.window_write.window_write`)."""
        window_write(start_t, features, keys, values, self.features, self.keys, self.values, self.positions)

    def advance(self, start: int, rows: int) -> None:
        """Host part: account for ``rows`` positions appended at ``start``."""
        self.length = min(self.capacity, self.length + rows)
        self.end = start + rows

    # -- ordered views (tests, debugging, the naive reference) --------------------------------------------------
    def ordered_slots(self) -> torch.Tensor:
        """Slots of the valid rows, oldest first."""
        first = self.end - self.length
        return (first + self._arange[:self.length]) % self.capacity

    def ordered_features(self) -> torch.Tensor:
        """``[length, F]`` features in position order."""
        return self.features[self.ordered_slots()]

    def ordered_positions(self) -> list[int]:
        return list(range(self.end - self.length, self.end))

    def nbytes(self) -> int:
        return self.features.nbytes + self.keys.nbytes + self.values.nbytes + self.positions.nbytes
