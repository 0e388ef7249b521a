"""How many draft-tree nodes a cycle should verify, from what a verify row costs on this device.

A cycle costs ``fixed + per_row * rows``: the draft and the forward's fixed part, plus every verify row. On a GPU
the verify is bound by the weight bytes and extra rows cost little; on a CPU every row is a full pass of arithmetic
over the weights, so a wide tree raises AL and still loses tok/s (docs/benchmarks.md, "Trees sized by cost"). A node
pays for its row only when its chance of being accepted is worth the row.

For a calibrated drafter the expected accepted depth of a tree is the sum of its nodes' joint probabilities (a
node is on the accepted path exactly when its whole path is right), so the best tree of ``n`` nodes is the ``n``
likeliest (:meth:`DraftTree.likeliest`) and the cycle yields ``(1 + f * S_n) / (fixed + per_row * (n + 1))``
tokens per unit of time, ``S_n`` their summed joint probability and ``f`` the request's calibration
(:class:`~edgespec.drafters.tree.JointCalibration`). :func:`size_tree` keeps the chain of first choices whole
(a block drafter's joint probabilities, products of per-position marginals, undervalue a long right run: cut by
them, the chain lost AL) and adds the likeliest other nodes while they pay for their rows.

:class:`CycleCost` measures ``per_row / fixed`` while the session runs: a least-squares line through the recent
cycles' (verify rows, verify seconds), chains and trees alike, plus their mean draft time, with the arch's prior
(``ArchDefaults.tree_row_cost``) until enough cycles of different widths were seen.
"""

from __future__ import annotations

import torch

from edgespec.drafters.tree import DraftTree


class CycleCost:
    """Online fit of a cycle's cost against its verify rows, recent cycles weighted most (each older cycle's weight
    decays by ``decay``): the verify's seconds as a line ``intercept + per_row * rows`` and the draft's mean
    seconds. The fixed cost of a cycle is the draft plus the intercept; a tree node beside the chain costs one verify
    row and no draft (a chain's deeper drafts cost drafter rows too, so the draft is not fitted against rows).
    :attr:`row_ratio` is ``per_row / fixed`` -- all the node count needs -- or ``prior`` while fewer than
    ``min_cycles`` were seen or their widths hardly differ."""

    def __init__(self, prior: float, decay: float = 0.97, min_cycles: int = 16) -> None:
        if prior < 0 or not 0 < decay <= 1:
            raise ValueError(f"cycle cost: prior {prior} must be >= 0 and decay {decay} in (0, 1]")
        self.prior, self.decay, self.min_cycles = prior, decay, min_cycles
        self.cycles = 0
        self._w = self._x = self._y = self._xx = self._xy = self._draft = 0.0

    def record(self, rows: int, verify_s: float, draft_s: float = 0.0) -> None:
        """One cycle: ``rows`` verified (1 for a plain decode step) in ``verify_s`` seconds, after a draft (and the
        proposer's commit) of ``draft_s``."""
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + rows
        self._y = self._y * d + verify_s
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * verify_s
        self._draft = self._draft * d + draft_s
        self.cycles += 1

    def line(self) -> tuple[float, float] | None:
        """``(fixed, per_row)`` seconds: the draft's mean plus the verify line's intercept, and its slope; None while
        it cannot be trusted (too few cycles, or widths spread by less than two rows)."""
        if self.cycles < self.min_cycles:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < 4.0:          # widths spread by less than two rows: the slope is noise
            return None
        per_row = max(0.0, (self._xy / self._w - mx * my) / var)
        fixed = my - per_row * mx + self._draft / self._w
        if fixed <= 0:          # noise steeper than the data: the cycle is all rows; no fixed part to share
            return None
        return fixed, per_row

    @property
    def row_ratio(self) -> float:
        """What one more verify row costs, as a share of a cycle's fixed cost."""
        fit = self.line()
        # A row dearer than the whole fixed cost is noise on a loaded machine, not a cost model.
        return self.prior if fit is None else min(1.0, fit[1] / fit[0])


def best_node_count(joint: torch.Tensor, factor: float, row_ratio: float, kept: float = 0.0, kept_nodes: int = 0
                    ) -> int:
    """How many of the nodes with joint probabilities ``joint [N]`` to add, likeliest first, to ``kept_nodes``
    nodes already verified whose joint probabilities sum to ``kept``: the count maximising
    ``(1 + factor * (kept + sum of the added)) / (1 + row_ratio * (kept_nodes + added + 1))``, expected tokens of
    a cycle over its cost in units of the fixed cost. At least one node is verified."""
    top = torch.sort(joint.float(), descending=True, stable=True).values
    gain = 1.0 + factor * (kept + torch.cat([torch.zeros(1), torch.cumsum(top, 0)]))
    cost = 1.0 + row_ratio * (kept_nodes + 1 + torch.arange(top.numel() + 1, dtype=torch.float32))
    rate = gain / cost
    if kept_nodes == 0:
        if top.numel() == 0:
            raise ValueError("best_node_count needs at least one node")
        rate[0] = -1.0
    return int(torch.argmax(rate))


def size_tree(tree: DraftTree, factor: float, row_ratio: float, keep_chain: bool = True) -> DraftTree:
    """The nodes of ``tree`` worth their rows: its first-child path (``keep_chain``: the chain a chain verify would
    check, so the tree's AL is never below the chain's), then the likeliest other nodes while each pays for its row
    (:func:`best_node_count`). A parent's joint probability is at least its child's and ties go to the earlier
    node in pre-order (the parent), so the kept nodes form a tree."""
    joint = tree.joint_probs()
    base = tree.first_path() if keep_chain else torch.zeros(tree.size, dtype=torch.bool)
    rest = torch.nonzero(~base).view(-1)
    order = rest[torch.sort(-joint[rest], stable=True).indices]
    n = best_node_count(joint[order], factor, row_ratio, float(joint[base].sum()), int(base.sum()))
    keep = base.clone()
    keep[order[:n]] = True
    out = tree.subset(keep)
    assert out is not None      # at least one node
    return out
