"""How many draft-tree nodes a cycle should verify: the most expected tokens per unit of cycle cost, or the chain.

Expected tokens. A node is on the accepted path exactly when its whole path is right, so a cycle's expected
accepted depth is the sum of its nodes' chances of being right, and the best tree of ``n`` nodes holds the ``n``
likeliest. The chances are the drafter's own joint probabilities corrected per node class by what this session's
earlier cycles showed (:meth:`edgespec.speculative.tree_stats.NodeStats.estimates`: a drafter overconfident on
text unlike its training data is discounted, nodes beside the chain are weighed by how often such nodes were
really right).

Cost. A cycle of ``R`` verify rows costs what :mod:`edgespec.speculative.tree_cost` predicts for a chain or a
tree forward of ``R`` rows (measured row costs per device, or a line fitted online), draft time included.

:func:`choose_tree` keeps the chain of first choices whole (what a chain verify would check, so the AL never falls
below the chain's), then weighs the chain alone, verified as a chain, against the chain plus the ``n`` likeliest
other nodes verified as one tree, for every ``n``: the best rate ``(1 + sum of chances) / cost`` wins, and the
chain keeps the cycle unless a tree beats it by ``margin`` (DDTree's best-first order under a budget that is itself
chosen by cost, and never a tree that is predicted to be slower than the chain).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgespec.drafters.tree import DraftTree
from edgespec.speculative.tree_cost import CostModel

# A tree must be predicted this much faster than the chain to replace it (noise in the estimates should not flip
# cycles between the two).
TREE_MARGIN = 0.02


@dataclass
class TreeChoice:
    """The nodes a cycle verifies: ``keep [N]`` over the candidate tree, the verified ``tree``, and the predicted
    expected tokens and cost of it and of the chain alone."""

    keep: torch.Tensor
    tree: DraftTree
    expected: float
    cost: float
    chain_expected: float
    chain_cost: float

    @property
    def rate(self) -> float:
        return self.expected / self.cost

    @property
    def chain_rate(self) -> float:
        return self.chain_expected / self.chain_cost


def choose_tree(tree: DraftTree, chances: torch.Tensor, cost: CostModel, margin: float = TREE_MARGIN,
                keep_chain: bool = True) -> TreeChoice:
    """The nodes of ``tree`` worth their rows (see the module doc); ``chances [N]``: each node's chance of being
    right, never above its parent's. ``keep_chain`` False: the base is no node at all (at least one node is still
    verified), so a tree of the likeliest nodes competes with nothing."""
    n = tree.size
    base = tree.first_path() if keep_chain else torch.zeros(n, dtype=torch.bool)
    n_base = int(base.sum())
    rest = torch.nonzero(~base).view(-1)
    # Likeliest first; ties keep pre-order, so a parent (whose chance is at least its child's) goes first and every
    # prefix of this order, with the base, is a tree.
    order = rest[torch.sort(-chances[rest], stable=True).indices]
    gains = torch.cumsum(chances[order], 0).tolist()
    chain_expected = 1.0 + float(chances[base].sum())
    chain_cost = cost.cycle(n_base + 1, tree=False) if n_base else float("inf")
    best_n, best_rate = 0, chain_expected / chain_cost * (1.0 + margin)
    for added, gain in enumerate(gains, start=1):
        rate = (chain_expected + gain) / cost.cycle(n_base + added + 1, tree=True)
        if rate > best_rate:
            best_n, best_rate = added, rate
    if best_n == 0 and n_base == 0:
        best_n = 1                      # no chain to fall back to: the likeliest node alone
    keep = base.clone()
    keep[order[:best_n]] = True
    chosen = tree.subset(keep)
    assert chosen is not None           # the base or at least one node
    expected = chain_expected + (gains[best_n - 1] if best_n else 0.0)
    spent = chain_cost if best_n == 0 else cost.cycle(n_base + best_n + 1, tree=True)
    return TreeChoice(keep, chosen, expected, spent, chain_expected, chain_cost)
