"""The chain half of a speculative session: each cycle drafts one sequence, verifies it after the last token in
one forward, accepts a prefix and rolls the rest back (the arch hooks' rollback); with no draft, a decode step.

The tree half (:mod:`~edgespec.speculative.tree_cycle`) verifies its decode steps, and the trees it sizes down to
their chain, through the same :class:`ChainCycles`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edgespec.arch.base import ArchHooks
from edgespec.arch.rollback import RollbackStrategy
from edgespec.cache.model_cache import ModelCache
from edgespec.drafters.base import Draft, Proposer
from edgespec.models.decoder import TargetModel
from edgespec.speculative.acceptance import AcceptancePolicy, Verdict
from edgespec.speculative.cycle import Cycle, TokenConstraint, mask_logits
from edgespec.speculative.telemetry import RequestTelemetry


class ChainCycles:
    """The chain :class:`~edgespec.speculative.strategy.CycleStrategy` over one session's model, cache and hooks."""

    label = "chain"

    def __init__(self, model: TargetModel, cache: ModelCache, hooks: ArchHooks, rollback: RollbackStrategy,
                 taps: Sequence[int]) -> None:
        self.model, self.cache, self.hooks, self.rollback, self.taps = model, cache, hooks, rollback, tuple(taps)

    @property
    def chain(self) -> ChainCycles:
        return self

    def for_request(self, constraint: TokenConstraint | None) -> ChainCycles:
        return self

    def propose(self, proposer: Proposer, last: int, room: int,
                constraint: TokenConstraint | None) -> Draft | None:
        """The proposer's draft cut to ``room`` and to the grammar's valid prefix; None when nothing is left."""
        draft = proposer.propose(last, room)
        if draft is None:
            return None
        tokens = draft.tokens[:room]
        if constraint is not None:
            tokens = tokens[:constraint.valid_prefix(tokens.tolist())]
        return None if tokens.numel() == 0 else type(draft)(tokens.to(self.model.device), draft.probs)

    def verify(self, last: int, draft: Draft | None, policy: AcceptancePolicy, constraint: TokenConstraint | None,
               tel: RequestTelemetry) -> Cycle:
        if draft is None:
            return self.decode(last, policy, constraint, tel)
        return self.verify_chain(last, draft, policy, constraint, tel)

    def record_cost(self, cycle: Cycle, draft_s: float, verify_s: float) -> None:
        """Chains are not sized by cost: nothing to learn."""

    def decode(self, last: int, policy: AcceptancePolicy, constraint: TokenConstraint | None,
               tel: RequestTelemetry) -> Cycle:
        """A cycle without drafts: one decode step and the next token."""
        device = self.model.device
        with tel.stage("verify"):
            step = self.hooks.decode(self.model, self.cache, torch.tensor([last], device=device), self.taps)
        with tel.stage("accept"):
            logits, greedy = step.logits, step.greedy          # [1, vocab], [2] or None
            if constraint is not None:
                logits, greedy = mask_logits(logits, constraint.row_masks([], logits.shape[-1], device)), None
            verdict = Verdict(0, [policy.next_token(logits[0], greedy)])
        return Cycle(verdict, step, 0, 0)

    def verify_chain(self, last: int, draft: Draft, policy: AcceptancePolicy, constraint: TokenConstraint | None,
                     tel: RequestTelemetry) -> Cycle:
        """Verify ``last`` + the draft in one forward, accept a prefix, roll the rest back."""
        model, cache, device = self.model, self.cache, self.model.device
        drafted = draft.tokens.shape[0]
        rows = torch.cat([torch.tensor([last], device=device), draft.tokens])     # [drafted + 1]
        start = cache.length
        with tel.stage("verify"):
            step = self.hooks.verify(model, cache, rows, self.taps, self.rollback)
        with tel.stage("accept"):
            logits, greedy = step.logits, step.greedy          # [drafted + 1, vocab], [drafted + 2] or None
            if constraint is not None:
                # The graph's verdict is of the unmasked logits: the grammar's masks change it.
                logits = mask_logits(logits, constraint.row_masks(draft.tokens.tolist(), logits.shape[-1], device))
                greedy = None
            verdict = policy.accept(logits, draft.tokens, draft.probs, greedy)
            replayed = self.hooks.rollback(model, cache, start, rows, verdict.accepted + 1, self.taps, self.rollback)
        return Cycle(verdict, replayed if replayed is not None else step, drafted, drafted)
