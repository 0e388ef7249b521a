"""The tree half of a speculative session (``draft_tree``): each cycle's tree chosen, verified and learned from.

Per cycle, :class:`TreeCycles` (the tree :class:`~edgespec.speculative.strategy.CycleStrategy`):

1. asks the proposer for a *candidate* tree (at most the budget, depth at most the draft length), cut to the rows
   the cache has left, to the nodes a grammar accepts (each node judged in its own parent's grammar state:
   ``TokenConstraint.tree_valid``) and to the node floor;
2. sizes it by cost (``draft_tree: auto``; :func:`~edgespec.speculative.tree_size.choose_tree` over the node
   chances of :class:`~edgespec.speculative.tree_stats.NodeStats` and the :mod:`~edgespec.speculative.tree_cost`
   model) -- the chain alone when the tree does not pay, which it then verifies as a chain (through the
   session's :class:`~edgespec.speculative.chain_cycle.ChainCycles`, as its plain decode steps);
3. verifies a real tree in one forward (the captured static tree verify when the hooks have one, else eager), its
   rows masked by the grammar row by row (``TokenConstraint.tree_masks``), accepts a path (strict greedy, or
   recursive rejection sampling over the masked distributions) and commits that path only;
4. records what became of every candidate node (:meth:`TreeCycles.record`), for the next cycles' chances and for
   telemetry, and each cycle's times for the cost model (:meth:`TreeCycles.record_cost`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edgespec.arch.base import ArchHooks
from edgespec.arch.rollback import TreeVerify
from edgespec.arch.tree_graphs import StaticTreeForward
from edgespec.cache.model_cache import ModelCache
from edgespec.drafters.base import Draft, Proposer
from edgespec.drafters.tree import DraftTree
from edgespec.kernels.verify.tree import TreeMask
from edgespec.models.decoder import ForwardOutput
from edgespec.speculative.acceptance import AcceptancePolicy, RejectionSampling, StrictGreedy, Verdict
from edgespec.speculative.chain_cycle import ChainCycles
from edgespec.speculative.cycle import Cycle, TokenConstraint, mask_logits
from edgespec.speculative.plan import SessionPlan
from edgespec.speculative.telemetry import RequestTelemetry
from edgespec.speculative.tree_accept import TreeVerdict, accept_tree, path_verdict
from edgespec.speculative.tree_cost import CostModel, LineCost, MeasuredCost, measure_graph_costs
from edgespec.speculative.tree_size import choose_tree
from edgespec.speculative.tree_stats import NodeStats, node_outcomes

# Each cycle scales the session's earlier node counts by this: the chances follow the request under way.
STATS_DECAY = 0.98


def supports_trees(constraint: TokenConstraint | None) -> bool:
    """Whether a grammar constraint can judge a draft tree node by node (``tree_valid`` and ``tree_masks``)."""
    return constraint is None or (hasattr(constraint, "tree_valid") and hasattr(constraint, "tree_masks"))


def tree_cost_model(plan: SessionPlan, rollback: TreeVerify, hooks: ArchHooks, cache: ModelCache) -> CostModel:
    """What sizes each tree by cost: the measured row costs the plan holds (``draft_tree_costs``, written by
    ``edgespec profile``), else those of the captured chain and tree verifies timed now (the cache is reset
    after), else the online line with the arch's prior (CPU: no graphs)."""
    if plan.tree_costs is not None:
        return MeasuredCost(plan.tree_costs)
    chain = {r: s.graph for r, s in hooks.static.items() if s.graph is not None}
    tree = {r: s.verify_graph for r, s in hooks.static_trees.items() if s.verify_graph is not None}
    measured = measure_graph_costs(chain, tree)
    cache.reset()
    if measured is not None:
        return MeasuredCost(measured)
    return LineCost(rollback.row_cost)


class TreeCycles:
    """Per session: the chain strategy it falls back on, the cost model (None: every node of the budget is
    verified), the decaying node statistics the chances come from, and the candidate of the cycle under way (see
    the module doc)."""

    def __init__(self, chains: ChainCycles, rollback: TreeVerify, cost: CostModel | None) -> None:
        self.chains = chains
        self.model, self.cache, self.hooks, self.taps = chains.model, chains.cache, chains.hooks, chains.taps
        self.rollback, self.budget, self.cost = rollback, rollback.budget, cost
        self.stats = NodeStats(decay=STATS_DECAY)
        self.candidate: DraftTree | None = None
        self.keep: torch.Tensor | None = None

    @property
    def chain(self) -> ChainCycles:
        return self.chains

    @property
    def label(self) -> str:
        return f"tree{self.budget}"

    def for_request(self, constraint: TokenConstraint | None) -> TreeCycles | ChainCycles:
        """Trees, unless the grammar cannot judge one node by node (then chains). A tree's depth follows the draft
        length as a chain's would (adaptive on CPU, where each drafted depth costs a drafter head row)."""
        return self if supports_trees(constraint) else self.chains

    # -- 1, 2: the tree of this cycle -----------------------------------------------------------------------------
    def propose(self, proposer: Proposer, last: int, room: int,
                constraint: TokenConstraint | None) -> DraftTree | None:
        """The tree to verify after ``last`` (depth at most ``room``), or None (nothing worth drafting: a plain
        decode step). A tree sized down to its chain comes back as a chain (:attr:`DraftTree.is_chain`)."""
        # Sized by cost, a tree holds the chain a chain verify would (its AL never falls below the chain's).
        tree = proposer.propose_tree(last, room, self.budget, chain_first=self.cost is not None)
        self.candidate = self.keep = None
        if tree is None:
            return None
        fit = min(tree.size, self.cache.max_len - self.cache.length - 1)
        tree = tree.pruned(room, fit)
        if tree is not None and constraint is not None:
            tree = tree.subset(torch.tensor(constraint.tree_valid(tree.tokens.tolist(), tree.parents.tolist()),
                                            dtype=torch.bool))
        if tree is None:
            return None
        chances = self.stats.estimates(tree)
        if self.rollback.min_joint > 0:
            tree = tree.subset(chances >= self.rollback.min_joint)
            if tree is None:
                return None
            chances = self.stats.estimates(tree)
        self.candidate = tree
        if self.cost is None:
            self.keep = torch.ones(tree.size, dtype=torch.bool)
            return tree
        choice = choose_tree(tree, chances, self.cost)
        self.keep = choice.keep
        return choice.tree

    # -- 3: the verify of this cycle's tree -----------------------------------------------------------------------
    def verify(self, last: int, tree: DraftTree | None, policy: AcceptancePolicy,
               constraint: TokenConstraint | None, tel: RequestTelemetry) -> Cycle:
        """Verify ``last`` + every tree node in one forward, accept a path, keep only that path's rows and states
        (no tree: a plain decode step). The proposer's commit sees the path's rows in order, as after a chain."""
        if tree is None:
            return self.chains.decode(last, policy, constraint, tel)
        if tree.is_chain:
            # A tree sized down to its chain verifies as one: the chain's forward (compiled on CPU, captured on a
            # GPU) and rollback, and the same verdict (one-hot drafts on both rules).
            cycle = self.chains.verify_chain(last, Draft(tree.tokens.to(self.model.device)), policy, constraint,
                                             tel)
            tel.record_tree(tree.size, False)
            exact = type(policy) is StrictGreedy
            self.record(list(range(cycle.verdict.accepted + 1)), cycle.verdict.tokens if exact else None, tel)
            return cycle
        verdict, kept = self.verify_tree(last, tree, policy, constraint, tel)
        tel.record_tree(tree.size, verdict.sibling)
        greedy = not isinstance(policy, RejectionSampling)        # trees are judged strictly under every greedy rule
        self.record(verdict.rows, verdict.tokens if greedy else None, tel)
        return Cycle(Verdict(verdict.accepted, verdict.tokens), kept, tree.size, tree.max_depth, tree_forward=True)

    def record_cost(self, cycle: Cycle, draft_s: float, verify_s: float) -> None:
        """Feed the cost model (if it sizes the trees) this cycle's rows, form and times."""
        if self.cost is not None:
            self.cost.record(cycle.drafted + 1, cycle.tree_forward, verify_s, draft_s)

    def verify_tree(self, last: int, tree: DraftTree, policy: AcceptancePolicy, constraint: TokenConstraint | None,
                    tel: RequestTelemetry) -> tuple[TreeVerdict, ForwardOutput]:
        """Verify ``last`` + every node of ``tree`` in one forward, accept a path and keep only its rows and states;
        returns the verdict and the kept path's rows (root first) for the proposer's commit."""
        device = self.model.device
        rows = torch.cat([torch.tensor([last]), tree.tokens]).to(device)
        static = self.hooks.tree_forward(self.cache, tree.size + 1)
        if static is not None:
            return self._verify_static(static, rows, tree, policy, constraint, tel)
        with tel.stage("verify"):
            step = self.rollback.verify_tree(self.model, self.cache, rows,
                                             TreeMask.from_parents(tree.row_parents(), device), self.taps)
        with tel.stage("accept"):
            verdict = accept_tree(policy, _masked_rows(step.logits, tree, constraint), tree)
            self.rollback.commit(self.cache, verdict.rows)
            path = torch.tensor(verdict.rows, device=device)
            kept = ForwardOutput(step.logits[path], step.hidden[path], None if step.taps is None else step.taps[path])
        return verdict, kept

    def _verify_static(self, static: StaticTreeForward, rows: torch.Tensor, tree: DraftTree,
                       policy: AcceptancePolicy, constraint: TokenConstraint | None,
                       tel: RequestTelemetry) -> tuple[TreeVerdict, ForwardOutput]:
        """The captured tree verify (graphs on): the forward and, for a greedy policy without a grammar, the
        verdict and the commit replayed back to back, then one copy of the verdict's integers; a sampling policy
        or a grammar (whose masks change the verdict) picks the path from the logits on the host and the same
        commit graph keeps it."""
        with tel.stage("verify"):
            step = static.verify(rows, tree.row_parents())
        with tel.stage("accept"):
            if isinstance(policy, RejectionSampling) or constraint is not None:
                verdict = accept_tree(policy, _masked_rows(step.logits, tree, constraint), tree)
                static.commit_rows(verdict.rows)
            else:
                path, next_token = static.commit_greedy()
                verdict = path_verdict(tree, path, next_token)
            kept = static.kept(len(verdict.rows))
        return verdict, kept

    # -- 4: what became of the candidate's nodes ------------------------------------------------------------------
    def record(self, accepted_rows: Sequence[int], target_tokens: Sequence[int] | None,
               tel: RequestTelemetry) -> None:
        """After the verify of this cycle's tree (or of its chain): ``accepted_rows`` = the accepted path in the
        verified tree's rows (root first), ``target_tokens`` = the target's greedy continuation after the root
        (the accepted drafts then the next token; None under sampling or relaxed acceptance)."""
        if self.candidate is None or self.keep is None:
            return
        index = torch.nonzero(self.keep).view(-1).tolist()          # verified node -> candidate node
        accepted = [index[r - 1] for r in accepted_rows[1:]]
        verified = self.keep.tolist()
        outcomes = node_outcomes(self.candidate, verified, accepted, target_tokens)
        self.stats.record(self.candidate, verified, outcomes, accepted)
        tel.node_stats.record(self.candidate, verified, outcomes, accepted)
        self.candidate = self.keep = None


def _masked_rows(logits: torch.Tensor, tree: DraftTree, constraint: TokenConstraint | None) -> torch.Tensor:
    """The verify rows' logits with each row masked by its own path's grammar state (no grammar: as they are)."""
    if constraint is None:
        return logits
    masks = constraint.tree_masks(tree.tokens.tolist(), tree.parents.tolist(), logits.shape[-1], logits.device)
    return mask_logits(logits, masks)
