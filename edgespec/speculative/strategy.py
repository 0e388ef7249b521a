"""A speculative session's cycle strategy: what a cycle drafts, and how it is verified, accepted and committed.

The session (:class:`~edgespec.speculative.session.SpecSession`) owns the loop around a cycle: the prefill, the
proposer's commits, the emit, the draft length and the telemetry of the whole. The middle of each cycle is a
:class:`CycleStrategy`'s job: draft chains (:class:`~edgespec.speculative.chain_cycle.ChainCycles`) or draft trees
(:class:`~edgespec.speculative.tree_cycle.TreeCycles`, over the chains), so the loop is one for both;
:func:`session_cycles` picks a session's.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from edgespec.arch.rollback import TreeVerify
from edgespec.drafters.base import Proposer
from edgespec.speculative.acceptance import AcceptancePolicy
from edgespec.speculative.chain_cycle import ChainCycles
from edgespec.speculative.cycle import Cycle, TokenConstraint
from edgespec.speculative.plan import SessionPlan
from edgespec.speculative.telemetry import RequestTelemetry
from edgespec.speculative.tree_cycle import TreeCycles, tree_cost_model

# What a strategy's propose hands its verify: a draft chain, a draft tree.
P = TypeVar("P")


class CycleStrategy(Protocol[P]):
    """The middle of a cycle: propose a draft (inside the session's draft stage), then verify, accept and commit
    it (or, with no draft, a plain decode step); the session runs everything around it."""

    @property
    def chain(self) -> CycleStrategy:
        """The chain strategy of the session (itself for chains): what a request verifies without trees."""

    @property
    def label(self) -> str:
        """How runs name the strategy: ``chain``, ``tree<budget>``."""

    def for_request(self, constraint: TokenConstraint | None) -> CycleStrategy:
        """The strategy for a request under ``constraint``: itself, or the chain strategy when it cannot follow
        the grammar."""

    def propose(self, proposer: Proposer, last: int, room: int, constraint: TokenConstraint | None) -> P | None:
        """The draft after ``last``, at most ``room`` deep and valid under the grammar; None: nothing to verify."""

    def verify(self, last: int, draft: P | None, policy: AcceptancePolicy, constraint: TokenConstraint | None,
               tel: RequestTelemetry) -> Cycle:
        """Verify ``last`` and ``draft`` (None: a plain decode step), accept, and leave the cache holding the
        accepted rows only."""

    def record_cost(self, cycle: Cycle, draft_s: float, verify_s: float) -> None:
        """Learn from the cycle's times: its draft stage (the proposer's commit and propose) and its verify (the
        verify, accept and commit), for a strategy that sizes its drafts by cost."""


def session_cycles(chains: ChainCycles, plan: SessionPlan, proposer: Proposer | None) -> CycleStrategy:
    """A session's strategy: :class:`TreeCycles` over ``chains`` when the plan's rollback verifies trees
    (``draft_tree``) and there is a proposer to draft them, sized by cost under ``draft_tree: auto``; else
    ``chains``. Called once the hooks are prepared: sizing by cost may time their captured verifies."""
    rollback = plan.rollback
    if proposer is None or not isinstance(rollback, TreeVerify):
        return chains
    cost = tree_cost_model(plan, rollback, chains.hooks, chains.cache) if plan.tree_sized else None
    return TreeCycles(chains, rollback, cost)
