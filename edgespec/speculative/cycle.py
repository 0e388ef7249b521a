"""What one propose -> verify -> accept cycle of a speculative session works with and hands on: the grammar
constraint it follows (:class:`TokenConstraint`), its masks (:func:`mask_logits`) and its record (:class:`Cycle`).

The cycle strategies (:mod:`~edgespec.speculative.strategy`: chains or trees) build a :class:`Cycle` per verify;
the session's loop reads it to emit, adapt the draft length and commit the proposer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from edgespec.drafters.base import Proposer
from edgespec.models.decoder import ForwardOutput
from edgespec.speculative.acceptance import Verdict


class TokenConstraint(Protocol):
    """A grammar matcher driving constrained decoding (JSON mode). Implemented in ``edgespec.serving.grammar``."""

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar accepts from the current state."""

    def row_masks(self, drafts: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
        """Allowed-token masks ``[len(drafts)+1, vocab_size]`` (bool) for the verify rows."""

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance by exactly the committed tokens."""

    def is_finished(self) -> bool:
        """True once the grammar has matched a complete value."""

    # Optional, for draft trees (a constraint without them makes the session verify chains):
    # ``tree_valid(tokens, parents) -> list[bool]``: per node (pre-order), whether its whole path is accepted;
    # ``tree_masks(tokens, parents, vocab_size, device) -> [N + 1, vocab_size] bool``: each verify row's mask from
    # its own path's state. Both leave the matcher where it was.


@dataclass
class Cycle:
    """What one cycle carries from its verify to the emit and the proposer's commit.

    A cycle without a draft is a plain decode step (one row). Its commit to the proposer runs at the start of the
    next cycle's draft stage (see :meth:`~edgespec.speculative.session.SpecSession.generate`).
    """

    verdict: Verdict                 # accepted drafts, then tokens = accepted drafts + the next token
    forward: ForwardOutput           # the forward whose rows 0 .. accepted are in the cache: logits [rows, vocab]
    drafted: int                     # draft tokens verified (0: a plain decode step); rows = drafted + 1
    depth: int                       # the draft's depth (a chain's: drafted), what the draft length adapts to
    tree_forward: bool = False       # the rows were verified as a tree (not a chain)

    def commit_to(self, proposer: Proposer) -> None:
        proposer.commit(self.verdict.tokens, self.verdict.accepted, self.forward, self.drafted)


def mask_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token the grammar's ``mask`` (bool, a row per logits row or more) forbids at -inf."""
    return logits.masked_fill(~mask[:logits.shape[0]], float("-inf"))
