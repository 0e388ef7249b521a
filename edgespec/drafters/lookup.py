"""Lookup first: a model drafter (DFlash, MTP) that takes an n-gram draft instead when the request repeats itself.

Robot replies repeat their own structure: the same JSON keys, the same step template with another waypoint.
Where the request's own tokens already hold the continuation (a suffix of ``min_match`` or more tokens recurs), an
n-gram lookup drafts it for free and often further than a small drafter would; elsewhere the model drafter runs
as usual. Both see every committed token (the model drafter keeps its context window whichever drafted), so
switching costs nothing, and the target verifies every draft either way: the output never changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edgespec.drafters.base import Draft, Proposer
from edgespec.drafters.ngram import NGramProposer
from edgespec.drafters.tree import DraftTree, tree_from_branches
from edgespec.models.decoder import ForwardOutput


class LookupFirstProposer(Proposer):
    """``model`` drafts unless the n-gram ``lookup`` finds a recurring suffix of at least ``min_match`` tokens
    followed by at least ``min_draft`` tokens; :attr:`lookup_cycles` / :attr:`model_cycles` count the choices.
    ``lookup`` replaces the n-gram lookup by another token-id drafter with a ``find(k)`` (the suffix drafter,
    built with the same ``min_match``: it also matches earlier outputs)."""

    def __init__(self, model: Proposer, min_match: int = 3, min_draft: int = 2, max_match: int = 8,
                 max_len: int = 1 << 16, lookup: Proposer | None = None) -> None:
        self.model = model
        self.lookup = lookup if lookup is not None else NGramProposer(
            max_match=max(max_match, min_match), min_match=min_match, gate=0.0, max_len=max_len)
        self.suffix_cache = getattr(self.lookup, "suffix_cache", None)   # the engine feeds it each output
        self.min_draft = min_draft
        self.name = f"{model.name}+lookup" if lookup is None else f"{model.name}+{lookup.name}"
        self.taps, self.default_k, self.max_k = model.taps, model.default_k, model.max_k
        self.resume_rows = model.resume_rows
        self.lookup_cycles = self.model_cycles = 0

    def reset(self) -> None:
        self.model.reset()
        self.lookup.reset()
        self.lookup_cycles = self.model_cycles = 0

    def begin(self, prompt_ids: Sequence[int], prefill: ForwardOutput) -> None:
        self.model.begin(prompt_ids, prefill)
        self.lookup.begin(prompt_ids, prefill)
        self.lookup_cycles = self.model_cycles = 0

    def propose(self, last_token: int, k: int) -> Draft | None:
        tokens = self.lookup.find(k)
        if len(tokens) >= min(self.min_draft, k):
            self.lookup_cycles += 1
            return Draft(torch.tensor(tokens, dtype=torch.long))
        self.model_cycles += 1
        return self.model.propose(last_token, k)

    def propose_tree(self, last_token: int, k: int, budget: int, chain_first: bool = False) -> DraftTree | None:
        """The lookup's branches as a tree when its latest continuation is long enough (as :meth:`propose`
        decides), else the model drafter's tree."""
        branches = self.lookup.find_branches(k)
        if branches and len(branches[0].tokens) >= min(self.min_draft, k):
            self.lookup_cycles += 1
            return tree_from_branches(branches, budget)
        self.model_cycles += 1
        return self.model.propose_tree(last_token, k, budget, chain_first)

    def commit(self, tokens: Sequence[int], accepted: int, verify: ForwardOutput | None,
               drafted: int = 0) -> None:
        self.model.commit(tokens, accepted, verify, drafted)
        self.lookup.commit(tokens, accepted, verify, drafted)
