"""The proposer protocol: the one small interface n-gram, DFlash and MTP drafters implement."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgespec.config import MAX_DRAFT_TOKENS
from edgespec.drafters.tree import DraftTree, chain_tree
from edgespec.models.decoder import ForwardOutput


@dataclass
class Draft:
    """Proposed tokens ``[K']`` (K' <= K) and, for sampled drafts, their proposal distributions ``[K', V]``."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None


class Proposer(ABC):
    """Proposes draft tokens each cycle and learns what the target committed.

    Lifecycle per request: :meth:`begin` after prefill, :meth:`commit` of the first token (sampled from the
    prefill logits), then per cycle :meth:`propose` and :meth:`commit`. Every emitted token is committed exactly
    once, in order, so a proposer's history always ends with the token the next verify starts from.
    ``taps`` lists the target layers whose outputs the proposer needs from prefill and verify.
    """

    name: str = "proposer"
    taps: tuple[int, ...] = ()
    default_k: int = 4
    max_k: int = MAX_DRAFT_TOKENS
    # Trailing prompt rows :meth:`begin` must see in the prefill forward when the session resumes a cached prefix
    # (0: the token ids are enough); None: every prompt row, so a request never resumes a prefix.
    resume_rows: int | None = None
    # True: the proposer sizes every draft itself from its own statistics (the suffix drafter drafts as far as
    # its counts agree), so the session's adaptive draft length, which cuts the next draft to one more than the
    # last accepted, is not applied on top (edgespec.speculative.session.adapts).
    sizes_drafts: bool = False

    @abstractmethod
    def begin(self, prompt_ids: Sequence[int], prefill: ForwardOutput) -> None:
        """Start a request: see the prompt and the prefill forward's hidden states/taps."""

    @abstractmethod
    def propose(self, last_token: int, k: int) -> Draft | None:
        """Up to ``k`` tokens expected after ``last_token``; None when drafting is not worth it now."""

    @abstractmethod
    def commit(self, tokens: Sequence[int], accepted: int, verify: ForwardOutput | None,
               drafted: int = 0) -> None:
        """The target emitted ``tokens`` (``accepted`` of ``drafted`` drafts, then the next token). ``verify``
        is the forward whose rows ``0 .. accepted`` are now in the cache (None after prefill). It may hold views
        of static CUDA-graph output buffers that the next forward overwrites: copy what must outlive this call."""

    def propose_tree(self, last_token: int, k: int, budget: int, chain_first: bool = False) -> DraftTree | None:
        """A draft tree of at most ``budget`` nodes and depth ``k`` after ``last_token`` (tree verification); None
        when drafting is not worth it now. ``chain_first``: the tree holds the chain :meth:`propose` would
        draft (within the budget) whatever else it holds. Default: :meth:`propose`'s chain as the one-branch
        tree. The commit that follows is the same as after a chain: ``tokens`` = the accepted path + the next
        token, and ``verify`` holds the rows of that path (root first) in order."""
        draft = self.propose(last_token, min(k, budget))
        return None if draft is None else chain_tree(draft.tokens[:min(k, budget)])

    def reset(self) -> None:
        """Drop per-request state."""
