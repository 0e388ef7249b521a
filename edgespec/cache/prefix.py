"""Prefix reuse across requests: keep what the cache holds after one request and start the next from it.

A robot controller's conversation grows by a few dozen tokens per turn, and each request re-sends the whole of it.
:class:`PrefixCache` remembers which tokens the engine's :class:`~edgespec.cache.model_cache.ModelCache` holds
after a request, and the next request resumes from the longest common token prefix, prefilling only the rest.

* Attention layers: the K/V rows of positions ``0..L-1`` are still in the preallocated buffers; resuming at ``L``
  only sets the length (rows past ``L`` are overwritten by the next prefill). Any ``L`` works.
* Gated DeltaNet layers fold the whole past into one recurrent state that cannot be truncated, so a hybrid model
  resumes only at a position whose state was saved. Snapshots are taken at turn boundaries: before the last
  turn-start token of every prompt (:meth:`PrefixCache.split`: the prefill stops there once; the generation prompt
  after it, ``<|im_start|>assistant\n<think>\n\n</think>\n\n``, is usually rendered differently in the next
  request's history), at the end of every prompt and at the end of every answer; the ``max_snapshots`` longest are
  kept. Each snapshot costs one copy of the GDN state (about 150 MB for Qwen3.5-27B, 3 by default).

The resumed cache holds exactly what a fresh prefill of the prefix would have written (same rows, same state), so
greedy output is the same with and without reuse up to the rounding of a prefill split at another point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgespec.cache.model_cache import ModelCache


@dataclass
class _Snapshot:
    """GDN conv and recurrent state of every layer after the first ``length`` tokens."""

    length: int
    conv: torch.Tensor
    recurrent: torch.Tensor


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: conversations share thousands of tokens and a Python loop per token adds up.
    step = 256
    while i + step <= n and list(a[i:i + step]) == list(b[i:i + step]):
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """What ``cache`` holds between requests (token ids, GDN snapshots) and where the next request may resume."""

    def __init__(self, cache: ModelCache, max_snapshots: int = 3, turn_ids: Sequence[int] = ()) -> None:
        if max_snapshots < 1:
            raise ValueError(f"max_snapshots {max_snapshots} must be >= 1")
        self.cache = cache
        self.turn_ids = frozenset(turn_ids)   # tokens that open a chat turn (ChatTokenizer.turn_token_id)
        self.max_snapshots = max_snapshots
        self.tokens: list[int] = []          # tokens at positions 0..len-1 whose rows/state the cache holds
        self._snaps: list[_Snapshot] = []
        self._spare: list[_Snapshot] = []    # evicted snapshots' buffers, reused (no allocation per request)
        self._length = 0                     # cache.length when the cache was last left to us
        self._resets = -1                    # cache.resets after our own reset (another one: the cache was reused)
        self.last_reused = 0

    @property
    def snapshot_lengths(self) -> list[int]:
        return sorted(s.length for s in self._snaps)

    def nbytes(self) -> int:
        return sum(s.conv.nbytes + s.recurrent.nbytes for s in self._snaps + self._spare)

    def clear(self) -> None:
        """Forget everything (the cache was used by someone else)."""
        self.tokens = []
        self._spare += self._snaps
        self._snaps = []

    def plan(self, prompt_ids: Sequence[int], tail: int | None) -> int:
        """How many leading prompt tokens can be taken from the cache. ``tail``: prompt rows the prefill must still
        compute for the drafter (None: the drafter cannot resume, start from scratch). At least one row is always
        recomputed: its logits give the first token."""
        if tail is None or not self.tokens or self.cache.length != self._length or self.cache.resets != self._resets:
            return 0
        limit = len(prompt_ids) - max(1, tail)
        n = min(common_prefix(self.tokens, prompt_ids), limit)
        if self.cache.has_state:
            n = max((s.length for s in self._snaps if s.length <= n), default=0)
        return max(n, 0)

    def begin(self, prompt_ids: Sequence[int], tail: int | None) -> int:
        """Put the cache at the longest reusable prefix of ``prompt_ids`` (reset when there is none) and return
        its length; the caller prefills the rest."""
        n = self.plan(prompt_ids, tail)
        self.cache.reset()
        self._resets = self.cache.resets
        if n:
            if self.cache.has_state:
                snap = next(s for s in self._snaps if s.length == n)
                self.cache.states.conv.copy_(snap.conv)
                self.cache.states.recurrent.copy_(snap.recurrent)
            self.cache.length = n
        # From here on only the first n tokens are known good: a failure mid-request leaves nothing stale behind.
        self.tokens = self.tokens[:n]
        self._drop(lambda s: s.length > n)
        self._length = n
        self.last_reused = n
        return n

    def split(self, prompt_ids: Sequence[int], start: int) -> int | None:
        """Where a hybrid model's prefill should pause for a snapshot: the last turn-start token after ``start``
        (None: no pause; attention-only caches resume anywhere and need none)."""
        if not self.cache.has_state or not self.turn_ids:
            return None
        for i in range(len(prompt_ids) - 1, start, -1):
            if prompt_ids[i] in self.turn_ids:
                return i
        return None

    def mark(self, prompt_ids: Sequence[int], length: int) -> None:
        """The cache holds the first ``length`` prompt tokens (a paused prefill): snapshot there."""
        self.tokens = list(prompt_ids[:length])
        self._snapshot(length)
        self._length = self.cache.length

    def prefilled(self, prompt_ids: Sequence[int]) -> None:
        """The cache now holds the whole prompt: remember it, snapshot the state at the prompt's end."""
        self.tokens = list(prompt_ids)
        self._snapshot(len(self.tokens))
        self._length = self.cache.length

    def finished(self, tokens: Sequence[int]) -> None:
        """The request ended; ``tokens`` = prompt + emitted. The cache holds rows for a prefix of them (the last
        emitted token was never fed; rows after a stop token inside accepted drafts are not ``tokens``)."""
        n = min(self.cache.length, len(tokens))
        self.tokens = list(tokens[:n])
        if n == self.cache.length:
            self._snapshot(n)
        self._length = self.cache.length

    # -- snapshots ------------------------------------------------------------------------------------------------
    def _drop(self, pred) -> None:
        keep = []
        for s in self._snaps:
            (self._spare if pred(s) else keep).append(s)
        self._snaps = keep

    def _snapshot(self, length: int) -> None:
        states = self.cache.states
        if states is None or length == 0 or any(s.length == length for s in self._snaps):
            return
        if len(self._snaps) >= self.max_snapshots:
            self._snaps.sort(key=lambda s: s.length)
            self._spare.append(self._snaps.pop(0))      # the shortest prefix is the least likely to be resumed
        if self._spare:
            snap = self._spare.pop()
            snap.length = length
            snap.conv.copy_(states.conv)
            snap.recurrent.copy_(states.recurrent)
        else:
            snap = _Snapshot(length, states.conv.clone(), states.recurrent.clone())
        self._snaps.append(snap)
