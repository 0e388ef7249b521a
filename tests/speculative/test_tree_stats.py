"""What became of every candidate tree node (edgespec.speculative.tree_stats): outcomes known from the target's
greedy continuation, per-class counts and the calibration they give."""

from __future__ import annotations

import pytest
import torch

from edgespec.drafters.tree import Branch, chain_tree, tree_from_branches
from edgespec.speculative.tree_stats import NodeStats, node_classes, node_outcomes


def _tree():
    # Pre-order: 0:[5] 1:[5,6] 2:[5,6,7] 3:[5,6,8] 4:[5,9] 5:[3] 6:[3,4]
    return tree_from_branches([Branch((5, 6, 7), 3.0), Branch((5, 6, 8), 2.0), Branch((5, 9), 1.5),
                               Branch((3, 4), 1.0)], budget=16)


def test_greedy_outcomes_are_known_up_to_one_token_past_the_accepted_path():
    tree = _tree()
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9, 3, 4]
    # The target continues 5, 6, 8 (two accepted drafts, then 8); only the chain [5, 6, 7] was verified.
    verified = [True, True, True, False, False, False, False]
    out = node_outcomes(tree, verified, accepted_nodes=[0, 1], target_tokens=[5, 6, 8])
    assert out == [True, True, False, True, False, False, False]
    # The target continues 5, 9: [5, 9] is right but sized out, so nothing below it would be known (it has no
    # children here); [5, 6] and below are wrong.
    out = node_outcomes(tree, [True] * 4 + [False] * 3, accepted_nodes=[0], target_tokens=[5, 9])
    assert out == [True, False, False, False, True, False, False]
    # A right node at the last known depth that was not verified: its children are unknown.
    out = node_outcomes(tree, [False] * 7, accepted_nodes=[], target_tokens=[3])
    assert out == [False, False, False, False, False, True, None]
    # Sampling: only verified nodes are decided.
    out = node_outcomes(tree, verified, accepted_nodes=[0], target_tokens=None)
    assert out == [True, False, False, None, None, None, None]


def test_classes_split_the_chain_from_the_side_nodes_by_depth():
    assert node_classes(_tree()) == [("chain", 1), ("chain", 2), ("chain", 3), ("side", 3), ("side", 2),
                                     ("side", 1), ("side", 2)]


def test_stats_calibrate_each_class_and_estimates_stay_below_the_parent():
    tree = chain_tree([1, 2, 3], probs=torch.tensor([0.9, 0.9, 0.9]))
    stats = NodeStats()
    assert stats.estimates(tree).tolist() == pytest.approx([0.9, 0.81, 0.729])
    for _ in range(4):                       # confident, and only the first draft is ever right
        stats.record(tree, [True] * 3, [True, False, False], accepted_nodes=[0])
    assert stats.factor(("chain", 1)) == pytest.approx((4 + 1) / (4 * 0.9 + 1))
    assert stats.factor(("chain", 2)) == pytest.approx(1 / (4 * 0.81 + 1))
    est = stats.estimates(tree)
    assert est[0] == pytest.approx(min(1.0, 0.9 * 5 / 4.6))
    assert est[1] < 0.81 and est[2] <= est[1]
    d = stats.to_dict()
    assert d["chain@1"] == {"nodes": 4, "joint": 3.6, "right": 4, "verified": 4, "accepted": 4}
    assert d["chain@2"]["right"] == 0 and d["chain@2"]["accepted"] == 0
    total = NodeStats()
    total.add(stats)
    total.add(stats)
    assert total.cycles == 8 and total.to_dict()["chain@1"]["nodes"] == 8


def test_decaying_stats_follow_the_recent_cycles():
    tree = chain_tree([1], probs=torch.tensor([0.5]))
    stats = NodeStats(decay=0.5)
    for _ in range(20):
        stats.record(tree, [True], [False], [])
    for _ in range(20):
        stats.record(tree, [True], [True], [0])
    # Counts converge to 2 right against 1 expected, plus the calibrated pseudo-node: (2 + 1) / (1 + 1).
    assert stats.factor(("chain", 1)) == pytest.approx(1.5, rel=1e-3)
