"""Rollback strategies: how a verify forward leaves the GDN state, and how the rejected rows are taken back.

A Gated DeltaNet state folds the whole past into one tensor, so it cannot be truncated like a KV cache. Each
strategy owns the three decisions that must agree: how big the cache's per-row room is (:meth:`cache_rows`), what
the verify forward does with the state (:meth:`verify_mode`, captured into the static verify graph), and how the
accepted rows are kept afterwards (:meth:`rollback`). The session holds one instance, chosen by the ``rollback``
setting or the arch default, the way ``edgespec.speculative.acceptance`` holds the acceptance policies.

* :class:`Checkpoint`: verify saves the GDN state after every row; rollback copies one slot back (constant time).
* :class:`Replay`: snapshot the GDN state before verify; on a partial accept restore it and re-run the accepted
  rows (a second, shorter forward; needs no per-row slots).
* :class:`Deferred`: verify leaves the GDN state untouched and keeps each row's inputs (a few KB); the accept
  stage advances the state by the accepted rows in one launch for all layers. Fewest state bytes of the three:
  one read in the verify, one read + write in the commit (checkpoints write the state once per verify row).

Attention-only models never replay or defer: truncating their KV cache is O(1), so every strategy reduces to
setting the length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from edgespec.arch.tree_graphs import graph_budget
from edgespec.cache.model_cache import ModelCache
from edgespec.cache.state import StateMode
from edgespec.errors import ConfigError
from edgespec.kernels.verify.tree import TreeMask
from edgespec.models.decoder import ForwardOutput, TargetModel


@dataclass(frozen=True)
class CacheRows:
    """Per-row room a strategy needs in the cache: ``TargetModel.new_cache``'s two sizing arguments."""

    checkpoint_rows: int = 0     # verify rows that keep a per-row state slot
    defer_rows: int = 0          # forward rows whose inputs are kept for a deferred commit


class RollbackStrategy:
    """One way to take back rejected verify rows. Subclasses set ``name`` and ``mode`` and override what differs."""

    name: ClassVar[str]
    mode: ClassVar[StateMode]              # the verify forward's state mode (on a model with GDN layers)

    def cache_rows(self, verify_rows: int, wide_rows: int) -> CacheRows:
        """Room for a verify of ``verify_rows`` rows and, where :meth:`wide_prefill` allows one, a static forward
        of ``wide_rows`` rows for short resumed prefills."""
        return CacheRows()

    def verify_mode(self, cache: ModelCache) -> StateMode:
        """What the verify forward over ``cache`` does with its GDN states."""
        return self.mode if cache.has_state else StateMode.ADVANCE

    def wide_prefill(self, cache: ModelCache) -> bool:
        """Whether a static forward wider than the verify may serve short resumed prefills: its padding rows are
        dropped by the same rollback a rejected draft gets, so the strategy must keep per-row state for them."""
        return not cache.has_state

    def before_verify(self, cache: ModelCache) -> None:
        """Save what :meth:`rollback` will need (nothing by default)."""

    def rollback(self, model: TargetModel, cache: ModelCache, start: int, rows: torch.Tensor, keep: int,
                 taps: Sequence[int]) -> ForwardOutput | None:
        """Keep the first ``keep`` of the verify ``rows`` written at ``start``. Returns a replay forward's output
        when one ran (its taps then cover exactly the kept rows)."""
        # Also when every row is kept: a deferred verify's rows are committed here.
        cache.rollback(start + keep)
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))


class Checkpoint(RollbackStrategy):
    """Verify saves the GDN state after every row; rollback copies the kept row's slot back."""

    name = "checkpoint"
    mode = StateMode.CHECKPOINT

    def cache_rows(self, verify_rows: int, wide_rows: int) -> CacheRows:
        # A checkpointed wide forward would need a whole state per row: resumed prefills go through the verify.
        return CacheRows(checkpoint_rows=verify_rows)


class Replay(RollbackStrategy):
    """Snapshot the GDN state before verify; on a partial accept restore it and re-run the accepted rows."""

    name = "replay"
    mode = StateMode.ADVANCE

    def before_verify(self, cache: ModelCache) -> None:
        cache.snapshot()

    def rollback(self, model: TargetModel, cache: ModelCache, start: int, rows: torch.Tensor, keep: int,
                 taps: Sequence[int]) -> ForwardOutput | None:
        if not cache.has_state:
            return super().rollback(model, cache, start, rows, keep, taps)
        if start + keep == cache.length:
            return None
        cache.restore_snapshot()
        return model.forward(rows[:keep], cache, taps=taps, chunked=False, logits="none")


class Deferred(RollbackStrategy):
    """Verify keeps each row's inputs and leaves the GDN state; the rollback advances it by the kept rows."""

    name = "deferred"
    mode = StateMode.DEFER

    def cache_rows(self, verify_rows: int, wide_rows: int) -> CacheRows:
        return CacheRows(defer_rows=max(verify_rows, wide_rows))

    def wide_prefill(self, cache: ModelCache) -> bool:
        return True


class TreeVerify(Deferred):
    """Tree verification (``draft_tree``): a verify of a whole draft tree in one forward, whose GDN layers defer
    (each row computed from the committed state along its own branch, the state untouched), then a commit of the
    accepted path only: its K/V rows move to the positions of their depths and the GDN states advance along it
    (:meth:`ModelCache.commit_path`). Chains in the same session (a grammar-constrained request) are deferred.

    ``budget``: draft nodes per tree (the forward has ``budget + 1`` rows); ``min_joint``: nodes whose path the
    drafter gives a lower joint probability are not verified (0: the budget alone decides); ``row_cost``: the prior
    share of a cycle's fixed cost one more verify row costs, for sizing each tree by cost
    (:mod:`edgespec.speculative.tree_size`; 0: every node of the budget is verified)."""

    name = "tree"

    def __init__(self, budget: int, min_joint: float = 0.0, row_cost: float = 0.0) -> None:
        self.budget, self.min_joint, self.row_cost = budget, min_joint, row_cost

    def cache_rows(self, verify_rows: int, wide_rows: int) -> CacheRows:
        # A captured tree verify pads its tree up to the budget it was captured for (edgespec.arch.tree_graphs).
        return CacheRows(defer_rows=max(verify_rows, wide_rows, graph_budget(self.budget) + 1))

    def verify_tree(self, model: TargetModel, cache: ModelCache, rows: torch.Tensor, tree: TreeMask,
                    taps: Sequence[int]) -> ForwardOutput:
        """One eager forward over the tree's rows (root first, nodes in pre-order; the mask's structure)."""
        return model.forward(rows, cache, taps=taps, chunked=False, tree=tree)

    def commit(self, cache: ModelCache, path: list[int]) -> None:
        """Keep the accepted ``path`` of the last tree forward's rows (root first)."""
        cache.commit_path(path)

    def __repr__(self) -> str:
        return f"TreeVerify(budget={self.budget}, min_joint={self.min_joint}, row_cost={self.row_cost})"

    def _key(self) -> tuple[int, float, float]:
        return self.budget, self.min_joint, self.row_cost

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self), self._key()))


# The strategies every arch offers, by setting name (see the module doc).
STRATEGIES: dict[str, type[RollbackStrategy]] = {cls.name: cls for cls in (Checkpoint, Replay, Deferred)}
ROLLBACK_STRATEGIES: tuple[str, ...] = tuple(STRATEGIES)


def rollback_strategy(name: str) -> RollbackStrategy:
    """The strategy named ``name`` (one of ``ROLLBACK_STRATEGIES``)."""
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ConfigError(f"rollback {name!r} is not one of {', '.join(ROLLBACK_STRATEGIES)}") from None
