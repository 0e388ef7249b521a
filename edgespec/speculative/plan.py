"""What a speculative session runs with, resolved: no ``auto`` and no None left.

:meth:`SessionPlan.resolve` is the one place a session knob left at auto/None takes its arch default
(``edgespec.arch.base.ArchDefaults``); the engine does it once, inside its runtime plan (``edgespec.plan``), and
tests and tools that build a session by hand go through the same function (``SpecSession.with_defaults``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from edgespec.arch.base import ArchDefaults
from edgespec.arch.rollback import RollbackStrategy, TreeVerify, rollback_strategy
from edgespec.drafters.base import Proposer
from edgespec.drafters.tree import tree_setting
from edgespec.errors import ConfigError
from edgespec.speculative.tree_cost import RowCosts

StageTiming = Literal["host", "device"]


@dataclass(frozen=True)
class SessionPlan:
    """The session's resolved knobs: cache format and length, rollback strategy, prefill and graph choices."""

    kv_fp8: bool
    rollback: RollbackStrategy
    prefill_chunk: int
    max_len: int
    cuda_graphs: bool
    adaptive_k: bool
    graph_prefill_max: int           # resumed prefills up to this many tokens replay a static forward (0: never)
    stage_timing: StageTiming = "host"
    # draft_tree: auto sizes every tree by cost (a number verifies every node of its budget); tree_costs: the
    # measured row costs it uses (edgespec profile's draft_tree_costs), None: measured by the session itself.
    tree_sized: bool = False
    tree_costs: RowCosts | None = None

    @classmethod
    def resolve(cls, defaults: ArchDefaults, *, kv_fp8: bool | None = None, rollback: str | None = "auto",
                prefill_chunk: int | None = None, max_len: int = 4096, cuda_graphs: bool | None = None,
                adaptive_k: bool | None = None, graph_prefill_max: int | None = None,
                stage_timing: StageTiming = "host", draft_tree: int | str | None = "off",
                tree_costs: RowCosts | None = None) -> SessionPlan:
        """Each knob given, or (None / ``auto``) the arch default. ``draft_tree`` other than off makes the rollback
        the tree strategy (:class:`~edgespec.arch.rollback.TreeVerify`, deferred), which an explicit other
        rollback refuses; ``auto`` also sizes each tree by cost (from ``tree_costs`` when given)."""
        def pick(value, default):
            return default if value is None else value

        if rollback is None:
            rollback = "auto"
        strategy = rollback_strategy(defaults.rollback if rollback == "auto" else rollback)
        budget, min_joint = tree_setting(draft_tree, defaults.tree_min_joint, defaults.tree_budget)
        if budget is not None:
            if rollback not in ("auto", "deferred"):
                raise ConfigError(f"draft_tree needs rollback 'deferred' (tree GDN layers defer), not {rollback!r}")
            strategy = TreeVerify(budget, min_joint, defaults.tree_row_cost)
        return cls(kv_fp8=pick(kv_fp8, defaults.kv_fp8),
                   rollback=strategy,
                   prefill_chunk=pick(prefill_chunk, defaults.prefill_chunk), max_len=max_len,
                   cuda_graphs=pick(cuda_graphs, defaults.cuda_graphs),
                   adaptive_k=pick(adaptive_k, defaults.adaptive_k),
                   graph_prefill_max=pick(graph_prefill_max, defaults.graph_prefill_max), stage_timing=stage_timing,
                   tree_sized=budget is not None and _is_auto(draft_tree), tree_costs=tree_costs)


def _is_auto(setting: int | str | None) -> bool:
    return isinstance(setting, str) and setting.strip().lower() == "auto"


def draft_tokens(k: int | None, proposer: Proposer | None) -> int:
    """Drafts per cycle K: ``k``, or the proposer's default; 0 without a proposer. Raises when the proposer
    cannot draft that many."""
    if proposer is None:
        return 0
    k = k or proposer.default_k
    if not 1 <= k <= proposer.max_k:
        raise ConfigError(f"num_draft_tokens {k} out of range 1..{proposer.max_k} for {proposer.name}")
    return k
