"""Suffix drafter: the most frequent continuation of the current context, over this request and earlier outputs.

Two suffix tries are matched each cycle (SuffixDecoding, arXiv 2411.04975): one over the current request (its
prompt tail and every committed token, grown one token at a time) and the selected client partition of the
deployment's :class:`~edgespec.drafters.suffix_cache.SuffixCache` of recent outputs. Each proposes its greedy most
frequent continuation of the longest matching suffix, as long as the match supports
(:func:`~edgespec.drafters.suffix_tree.draft_budget`); the draft with the higher expected acceptance wins.
Unlike the n-gram proposer it sees the previous requests, and it drafts the continuation seen most often rather
than the latest. :meth:`SuffixProposer.branches` gives several continuations with their counts for tree
verification.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from edgespec.drafters.base import Draft, Proposer
from edgespec.drafters.suffix_cache import SuffixCache
from edgespec.drafters.suffix_tree import SuffixTrie, draft_budget, greedy_draft, match_suffix, suffix_branches
from edgespec.errors import ConfigError
from edgespec.models.decoder import ForwardOutput


class SuffixProposer(Proposer):
    """Drafts from suffix tries over the request (prompt tail + output) and the cache of earlier outputs.

    ``max_match``/``min_match``: suffix lengths tried (longest first); ``factor``: draft tokens per matched token
    (:func:`draft_budget`); ``min_prob``: a draft token's minimum share of the match's occurrences;
    ``lookback``: prompt tokens indexed at :meth:`begin`. :attr:`proposals` and :attr:`propose_s` count the
    proposals and their time (the bench reports time per proposal).
    """

    name = "suffix"
    resume_rows = 0          # drafts from token ids alone
    # K 8, half a draft token per matched token, a token's share >= 0.5 (factor, min_prob below and the
    # suffix_* settings): chosen by replaying two recorded robot streams (robot_stream seeds 1 and 2, not the
    # bench's seed 0; tools/suffix_replay.py) for tokens per unit of CPU verify cost, a drafted row costing 0.3 of
    # a plain forward on the CPU demo. Deeper drafts raise AL but not speed there (docs/benchmarks.md).
    default_k = 8
    sizes_drafts = True      # each draft runs as far as the counts agree (find), not the session's adaptive K

    def __init__(self, cache: SuffixCache | None = None, max_depth: int = 24, max_match: int = 12,
                 min_match: int = 1, factor: float = 0.5, min_prob: float = 0.5, lookback: int = 2048) -> None:
        if not 1 <= min_match <= max_match:
            raise ConfigError(f"suffix drafter: min_match {min_match} must be within 1..max_match {max_match}")
        if max_depth <= max_match:
            raise ConfigError(f"suffix_max_depth {max_depth} must exceed the longest match {max_match} (room for "
                              f"the continuation)")
        if factor <= 0 or not 0.0 <= min_prob <= 1.0 or lookback < 1:
            raise ConfigError(f"suffix drafter: factor {factor} must be > 0, min_prob {min_prob} within 0..1, "
                              f"lookback {lookback} >= 1")
        self.suffix_cache = cache
        self.max_depth, self.max_match, self.min_match = max_depth, max_match, min_match
        self.factor, self.min_prob, self.lookback = factor, min_prob, lookback
        self.request = SuffixTrie(max_depth)
        self.history: list[int] = []
        self._active: list[int] = []
        self.proposals = 0
        self.propose_s = 0.0

    def reset(self) -> None:
        self.request = SuffixTrie(self.max_depth)
        self.history = []
        self._active = []

    def begin(self, prompt_ids: Sequence[int], prefill: ForwardOutput | None) -> None:
        self.reset()
        self._append(list(prompt_ids)[-self.lookback:])

    def _append(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self._active = self.request.extend(self._active, int(t))
        self.history.extend(int(t) for t in tokens)

    def commit(self, tokens: Sequence[int], accepted: int, verify: ForwardOutput | None,
               drafted: int = 0) -> None:
        self._append(tokens)

    def _tries(self) -> list[SuffixTrie]:
        shared = None if self.suffix_cache is None else self.suffix_cache.trie()
        return [self.request] if shared is None else [self.request, shared]

    def find(self, k: int) -> list[int]:
        """The best draft of up to ``k`` tokens (history already ends with the pending token); [] when none."""
        t0 = time.perf_counter()
        context = self.history[-self.max_match:]
        best: list[int] = []
        best_score = 0.0
        for trie in self._tries():
            node, n = match_suffix(trie, context, self.max_match, self.min_match)
            budget = draft_budget(n, k, self.factor)
            if budget == 0:
                continue
            tokens, score = greedy_draft(trie, node, budget, self.min_prob)
            if score > best_score:
                best, best_score = tokens, score
        self.proposals += 1
        self.propose_s += time.perf_counter() - t0
        return best

    def branches(self, k: int, max_branches: int = 4) -> list[tuple[list[int], int]]:
        """Up to ``max_branches`` continuations of up to ``k`` tokens with their occurrence counts (the request's
        and the cache's, merged by count), for a tree verifier: see
        :func:`~edgespec.drafters.suffix_tree.suffix_branches`."""
        context = self.history[-self.max_match:]
        out: list[tuple[list[int], int]] = []
        for trie in self._tries():
            node, n = match_suffix(trie, context, self.max_match, self.min_match)
            budget = draft_budget(n, k, self.factor)
            if budget:
                out += suffix_branches(trie, node, budget, max_branches, self.min_prob)
        merged: dict[tuple[int, ...], int] = {}
        for tokens, count in out:
            merged[tuple(tokens)] = merged.get(tuple(tokens), 0) + count
        ranked = sorted(merged.items(), key=lambda kv: (-kv[1], kv[0]))
        return [(list(tokens), count) for tokens, count in ranked[:max_branches]]

    def propose(self, last_token: int, k: int) -> Draft | None:
        tokens = self.find(k)
        if not tokens:
            return None
        return Draft(torch.tensor(tokens, dtype=torch.long))
