"""Prompt-lookup (n-gram) proposer: copy what followed the latest earlier occurrence of the current suffix.

Tries the longest suffix first (``max_match`` down to ``min_match``), searching the last ``lookback`` tokens of
prompt + output. A per-request gate stops drafting when drafts do not pay (accepted / drafted below ``gate``
after a warm-up) and probes again later; the ratio is per drafted token, so it does not drift with K.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from edgespec.drafters.base import Draft, Proposer
from edgespec.drafters.tree import Branch, DraftTree, tree_from_branches
from edgespec.models.decoder import ForwardOutput


def ngram_match(history: np.ndarray, k: int, max_match: int, min_match: int = 1) -> np.ndarray:
    """The up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of ``history``.

    Suffix lengths are tried from ``max_match`` down to ``min_match``; the first length with an earlier
    occurrence wins, and among its occurrences the latest. Returns an empty array when none matches.

    Worked example, ``history = [1, 2, 3, 9, 9, 3, 7, 5, 1, 2, 3]``, ``k = 2``:

    - ``max_match = 3``: the suffix ``[1, 2, 3]`` occurred at 0, followed by ``[9, 9]`` -> ``[9, 9]``;
    - ``max_match = 1``: the suffix ``[3]`` occurred at 2 and 5; the latest (5) is followed by ``[7, 5]``.
    """
    n, hits = suffix_hits(history, max_match, min_match)
    if not hits.size:
        return history[:0]
    start = int(hits[-1]) + n
    return history[start:start + k]


def suffix_hits(history: np.ndarray, max_match: int, min_match: int = 1) -> tuple[int, np.ndarray]:
    """The longest suffix length ``n`` (``max_match`` down to ``min_match``) that occurred earlier in ``history``
    and the starts of those earlier occurrences, oldest first (an empty array when none recurs)."""
    L = history.shape[0]
    for n in range(min(max_match, L - 1), min_match - 1, -1):
        suffix = history[L - n:]                                   # [n]
        # Candidate starts i with history[i:i+n] == suffix, excluding the suffix itself (i = L - n).
        windows = np.lib.stride_tricks.sliding_window_view(history[:L - 1], n)    # [L - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < L]
        if hits.size:
            return n, hits
    return 0, np.zeros(0, dtype=np.int64)


def ngram_branches(history: np.ndarray, k: int, max_match: int, min_match: int = 1, max_branches: int = 8
                   ) -> list[Branch]:
    """Every continuation (up to ``k`` tokens) of the up to ``max_branches`` latest earlier occurrences of the
    longest recurring suffix (the suffix :func:`ngram_match` picks), latest first, one :class:`Branch` of weight 1
    each: :func:`~edgespec.drafters.tree.tree_from_branches` merges the shared prefixes, so a continuation seen
    more often weighs more. Empty when no suffix recurs."""
    n, hits = suffix_hits(history, max_match, min_match)
    return [Branch(tuple(history[h + n:h + n + k].tolist())) for h in hits[::-1][:max_branches]]


class NGramProposer(Proposer):
    """Suffix-match drafting over the request's own tokens. No model, no taps."""

    name = "ngram"
    resume_rows = 0          # drafts from token ids alone
    default_k = 4

    def __init__(self, max_match: int = 4, min_match: int = 1, lookback: int = 4096, gate: float = 0.1,
                 warmup_tokens: int = 16, probe_every: int = 8, max_len: int = 1 << 16) -> None:
        self.max_match, self.min_match, self.lookback = max_match, min_match, lookback
        self.gate, self.warmup_tokens, self.probe_every = gate, warmup_tokens, probe_every
        self.history = np.zeros(max_len, dtype=np.int64)   # prompt + committed tokens, preallocated
        self.length = 0
        self.reset()

    def reset(self) -> None:
        self.length = 0
        self.window_drafted = 0
        self.window_accepted = 0
        self.paused_cycles = 0

    def _append(self, tokens: Sequence[int]) -> None:
        n = len(tokens)
        if self.length + n > self.history.shape[0]:
            self.history = np.concatenate([self.history, np.zeros_like(self.history)])
        self.history[self.length:self.length + n] = tokens
        self.length += n

    def begin(self, prompt_ids: Sequence[int], prefill: ForwardOutput | None) -> None:
        self.reset()
        self._append(list(prompt_ids))

    def find(self, k: int) -> list[int]:
        """:func:`ngram_match` over the last ``lookback`` tokens (the pending token included)."""
        hist = self.history[max(0, self.length - self.lookback):self.length]
        return ngram_match(hist, k, self.max_match, self.min_match).tolist()

    def propose_tree(self, last_token: int, k: int, budget: int, chain_first: bool = False) -> DraftTree | None:
        """The continuations of several earlier occurrences of the current suffix as one tree (see
        :func:`ngram_branches`); the gate pauses it as it pauses chains. The heaviest continuation comes first and
        whole, so ``chain_first`` holds already."""
        if self.paused_cycles > 0:
            self.paused_cycles -= 1
            return None
        branches = self.find_branches(k)
        return tree_from_branches(branches, budget) if branches else None

    def find_branches(self, k: int) -> list[Branch]:
        """:func:`ngram_branches` over the last ``lookback`` tokens."""
        hist = self.history[max(0, self.length - self.lookback):self.length]
        return ngram_branches(hist, k, self.max_match, self.min_match)

    def propose(self, last_token: int, k: int) -> Draft | None:
        if self.paused_cycles > 0:
            self.paused_cycles -= 1
            return None
        # History already ends with ``last_token``: the session commits every emitted token, pending one included.
        tokens = self.find(k)
        if not tokens:
            return None
        return Draft(torch.tensor(tokens, dtype=torch.long))

    def commit(self, tokens: Sequence[int], accepted: int, verify: ForwardOutput | None,
               drafted: int = 0) -> None:
        self._append(list(tokens))
        if drafted:
            self.window_drafted += drafted
            self.window_accepted += accepted
            if self.window_drafted >= self.warmup_tokens:
                if self.window_accepted / self.window_drafted < self.gate:
                    self.paused_cycles = self.probe_every
                self.window_drafted = self.window_accepted = 0
