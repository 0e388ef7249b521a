"""Captured tree verification: a static tree forward per node budget from a small set, and its commit, as two CUDA
graphs with no host synchronisation between them.

A :class:`StaticTreeForward` of ``P = budget + 1`` rows owns device buffers for the rows' tokens, the start position,
the number of real rows and the tree's structure (parents, depths, ancestor mask and bits, the conv windows' index:
a :meth:`TreeMask.static`). :meth:`~StaticTreeForward.verify` pads a smaller tree up to ``P`` rows with inert leaves
of the root (no real row has them as ancestors, so attention, conv and GDN rows of the real tree never see them;
the verdict never accepts them), copies it into the buffers and replays the forward graph, which also computes the
greedy tree verdict on the device (:func:`edgespec.kernels.verify.tree_verdict.greedy_tree_verdict`). The commit graph
reads the accepted path from that verdict tensor and settles the cache as a fixed-length masked step of the longest
path a tree may have (the drafts per cycle + 1, which bounds its depth; not all its rows)
(:meth:`ModelCache.commit_path_tensor`: K/V rows moved to the positions of their depths, the GDN and conv states
advanced along the path), and gathers the path's hidden rows and taps for the drafter. The accept stage then copies
``P + 2`` integers to the host, once, after both replays. A sampling policy chooses the path on the host from the
logits instead and hands it to :meth:`~StaticTreeForward.commit_rows`, which runs the same commit graph.

Graphs are keyed by budget from :data:`TREE_GRAPH_BUDGETS` (a budget between two members pads up to the next); a
budget above the set is refused by name. Without CUDA the same graph-mode code runs eagerly, which is how the CPU
tests prove it exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edgespec.arch.graphs import capture_graph
from edgespec.cache.model_cache import ModelCache
from edgespec.errors import ConfigError
from edgespec.kernels.verify.tree import TreeMask
from edgespec.kernels.verify.tree_verdict import greedy_tree_verdict
from edgespec.models.decoder import ForwardOutput, TargetModel

# Node budgets a tree forward is captured for. 63: the largest tree (64 rows, the width of the ancestor bit masks).
TREE_GRAPH_BUDGETS: tuple[int, ...] = (16, 32, 63)


def graph_budget(budget: int) -> int:
    """The captured budget a tree of up to ``budget`` nodes pads up to; a budget above the set is refused."""
    for key in TREE_GRAPH_BUDGETS:
        if budget <= key:
            return key
    raise ConfigError(f"draft_tree budget {budget} is above the captured tree forwards (budgets "
                      f"{', '.join(map(str, TREE_GRAPH_BUDGETS))})")


def graph_budgets(budget: int) -> tuple[int, ...]:
    """The captured budgets a session with node budget ``budget`` uses: every member of the set up to the one its
    full trees pad up to (a smaller tree takes the smallest that holds it)."""
    top = graph_budget(budget)
    return tuple(b for b in TREE_GRAPH_BUDGETS if b <= top)


class StaticTreeForward:
    """A tree verify of exactly ``budget + 1`` rows at a device-held position, and its commit, optionally captured
    as two CUDA graphs (see the module doc)."""

    def __init__(self, model: TargetModel, cache: ModelCache, budget: int, taps: Sequence[int],
                 capture: bool, max_path: int | None = None) -> None:
        """``max_path``: the longest path a tree may have (root included: the session's drafts per cycle + 1, which
        bounds every tree's depth); the commit moves and advances that many rows, not all ``budget + 1``."""
        self.model, self.cache, self.taps = model, cache, tuple(taps)
        self.rows = P = budget + 1
        self.path_rows = min(P, max_path or P)
        device = model.device
        self.tokens = torch.zeros(P, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.real = torch.full((1,), P, dtype=torch.long, device=device)
        kernels = sorted({layer.linear_attn.conv1d.kernel_size[0] for layer in model.model.layers
                          if layer.kind != "full_attention"})
        self.tree = TreeMask.static(P, tuple(kernels), device)
        self.verdict = torch.zeros(P + 2, dtype=torch.long, device=device)
        self.out: ForwardOutput | None = None
        self.kept_rows: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.verify_graph: torch.cuda.CUDAGraph | None = None
        self.commit_graph: torch.cuda.CUDAGraph | None = None
        self._start: int | None = None        # the verify whose commit is due
        self._parents: list[int] = []
        if capture and device.type == "cuda":
            # The warm-ups write cache rows at position 0: callers capture before serving and reset the cache.
            self.verify_graph, self.out = capture_graph(self._verify)
            self.commit_graph, self.kept_rows = capture_graph(self._commit)

    # -- the captured bodies ------------------------------------------------------------------------------------
    def _verify(self) -> ForwardOutput:
        tree = self.tree
        out = self.model.forward(self.tokens, self.cache, taps=self.taps, chunked=False, pos_t=self.pos, tree=tree)
        greedy_tree_verdict(out.logits, self.tokens, tree.parents, tree.depths, tree.ancestors, self.real,
                            out=self.verdict)
        return out

    @torch.inference_mode()
    def _commit(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        path = self.verdict[2:2 + self.path_rows]
        self.cache.commit_path_tensor(path, self.verdict[:1] + 1, self.pos)
        out = self.out
        return out.hidden.index_select(0, path), None if out.taps is None else out.taps.index_select(0, path)

    # -- a cycle -------------------------------------------------------------------------------------------------
    def fits(self, cache: ModelCache, rows: int) -> bool:
        """Whether a tree of ``rows`` rows can run here now (it fits the buffers and, padded, the cache)."""
        return cache is self.cache and rows <= self.rows and cache.length + self.rows <= cache.max_len

    def verify(self, tokens: torch.Tensor, parents: torch.Tensor) -> ForwardOutput:
        """Forward the tree rows ``tokens [n]`` (root first, pre-order) with row parents ``parents [n]`` (CPU; -1
        for the root) at ``cache.length``, padded to the captured rows. Returns the real rows' logits, hidden and
        taps (views of the static buffers); :meth:`commit_greedy` or :meth:`commit_rows` must follow."""
        n, P, cache = tokens.shape[0], self.rows, self.cache
        if parents.shape != (n,):
            raise ValueError(f"tree verify: {n} tokens but parents of shape {tuple(parents.shape)}")
        if not 1 <= n <= P:
            raise ValueError(f"a tree of {n} rows does not fit the captured {P}-row tree forward")
        start = cache.length
        cache.check_room(start, P)
        padded = [int(p) for p in parents.tolist()] + [0] * (P - n)    # inert leaves of the root
        mask = TreeMask.from_parents(torch.tensor(padded), "cpu")
        if int(mask.depths.max()) >= self.path_rows:
            raise ValueError(f"a tree of depth {int(mask.depths.max())} has paths longer than the "
                             f"{self.path_rows} rows this tree forward commits")
        self.tree.load(mask)
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.tokens[n:].zero_()
        self.real.fill_(n)
        self.pos.fill_(start)
        cache.begin_tree_forward(start, P)
        if self.verify_graph is not None:
            self.verify_graph.replay()
        else:
            self.out = self._verify()
        self._start, self._parents = start, padded[:n]
        out = self.out
        return ForwardOutput(out.logits[:n], out.hidden[:n], None if out.taps is None else out.taps[:n])

    def commit_greedy(self) -> tuple[list[int], int]:
        """Keep the greedy path the verify graph chose: ``(rows root first, the next token)``. One host copy of
        ``P + 2`` integers, after the commit is queued."""
        self._run_commit()
        verdict = self.verdict.tolist()
        rows = verdict[2:3 + verdict[0]]
        self._settle(len(rows))
        return rows, verdict[1]

    def commit_rows(self, rows: Sequence[int]) -> None:
        """Keep the path ``rows`` (root first, each the child of the one before) chosen on the host (sampling)."""
        rows, n = [int(r) for r in rows], len(self._parents)
        if not rows or rows[0] != 0 or not all(0 < b < n and self._parents[b] == a
                                               for a, b in zip(rows, rows[1:], strict=False)):
            raise ValueError(f"tree commit: {rows} is not a path of the verified tree from its root")
        path = rows + list(range(len(rows), self.path_rows))
        self.verdict[2:2 + self.path_rows].copy_(torch.tensor(path), non_blocking=True)
        self.verdict[0:1].fill_(len(rows) - 1)
        self._run_commit()
        self._settle(len(rows))

    def kept(self, rows: int) -> ForwardOutput:
        """The committed path's hidden rows and taps (``rows`` of them, root first), for the drafter's commit."""
        hidden, taps = self.kept_rows
        return ForwardOutput(None, hidden[:rows], None if taps is None else taps[:rows])

    def _run_commit(self) -> None:
        if self._start is None:
            raise ValueError("tree commit without a tree verify to commit")
        if self.commit_graph is not None:
            self.commit_graph.replay()
        else:
            self.kept_rows = self._commit()

    def _settle(self, kept: int) -> None:
        self.cache.settle_tree(self._start, kept)
        self._start = None
