"""Draft tree structure and builders (edgespec.drafters.tree)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from edgespec.drafters.tree import Branch, DraftTree, chain_tree, tree_from_branches, tree_from_logits
from edgespec.errors import ConfigError


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Token sequence of every node's root path."""
    return {tuple(int(tree.tokens[r - 1]) for r in tree.path_to(i + 1)[1:]) for i in range(tree.size)}


def test_chain_is_the_one_branch_tree():
    tree = chain_tree([5, 9, 2])
    assert tree.is_chain and tree.size == 3 and tree.max_depth == 3
    assert tree.row_parents().tolist() == [-1, 0, 1, 2]
    assert tree.first_chain().tolist() == [5, 9, 2]


def test_tree_from_logits_takes_the_most_probable_prefixes():
    """Best-first by joint probability: the budget's nodes are exactly the most probable path prefixes (brute force
    over every path of the per-depth top tokens)."""
    torch.manual_seed(0)
    D, V, budget = 4, 6, 9
    logits = torch.randn(D, V) * 2
    tree = tree_from_logits(logits, budget)
    assert tree.size == budget
    logp = torch.log_softmax(logits, -1)
    scores = {}
    for d in range(1, D + 1):
        for path in itertools.product(range(V), repeat=d):
            scores[path] = sum(float(logp[i, t]) for i, t in enumerate(path))
    best = sorted(scores, key=lambda p: -scores[p])[:budget]
    assert _paths(tree) == set(best)
    # The first-child path is the chain of per-depth argmaxes, and children come likeliest first.
    assert tree.first_chain().tolist()[:1] == [int(logits[0].argmax())]
    for kids in tree.children():
        probs = [float(tree.probs[c - 1]) for c in kids]
        assert probs == sorted(probs, reverse=True)
    assert math.isclose(float(tree.probs[0]), float(torch.softmax(logits[0], -1).max()), rel_tol=1e-6)


def test_spine_only_tree_hangs_alternatives_off_the_first_choice_chain():
    torch.manual_seed(1)
    logits = torch.randn(4, 7)
    tree = tree_from_logits(logits, 12, spine_only=True)
    assert tree.first_chain().tolist() == logits.argmax(-1).tolist()
    kids = tree.children()
    row, chain_rows = 0, {0}
    while kids[row]:
        row = kids[row][0]
        chain_rows.add(row)
    assert all(row in chain_rows for row, children in enumerate(kids) if children)   # the rest are leaves
    assert tree.size == 12 and not tree.is_chain
    assert tree.size == 12


def test_tree_from_logits_peaked_rows_give_a_chain():
    logits = torch.full((5, 50), -20.0)
    logits[torch.arange(5), torch.tensor([3, 1, 4, 1, 5])] = 20.0
    tree = tree_from_logits(logits, 5)
    assert tree.is_chain and tree.tokens.tolist() == [3, 1, 4, 1, 5]


def test_tree_from_branches_merges_shared_prefixes_heaviest_first():
    branches = [Branch((1, 2, 3), 1), Branch((1, 2, 7, 8), 3), Branch((4, 5), 2)]
    tree = tree_from_branches(branches, budget=16)
    assert _paths(tree) == {(1,), (1, 2), (1, 2, 3), (1, 2, 7), (1, 2, 7, 8), (4,), (4, 5)}
    assert tree.first_chain().tolist() == [1, 2, 7, 8]               # the heaviest branch
    assert float(tree.probs[0]) == pytest.approx(4 / 6)              # token 1 carries weight 4 of 6
    cut = tree_from_branches(branches, budget=5)
    assert cut.size == 5 and _paths(cut) == {(1,), (1, 2), (1, 2, 7), (1, 2, 7, 8), (4,)}


@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_bad_budget_refused_by_name(budget):
    with pytest.raises(ConfigError, match="draft_tree budget"):
        tree_from_logits(torch.randn(3, 10), budget)


def test_bad_trees_refused():
    with pytest.raises(ValueError, match="parents must come first"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]), torch.tensor([2, 1]), torch.ones(2))
    with pytest.raises(ValueError, match="repeats token"):
        DraftTree(torch.tensor([1, 1]), torch.tensor([-1, -1]), torch.tensor([1, 1]), torch.ones(2))
    with pytest.raises(ValueError, match="depth"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.tensor([1, 3]), torch.ones(2))
    with pytest.raises(ValueError, match="weights must be positive"):
        tree_from_branches([Branch((1,), 0)], 4)
    with pytest.raises(ValueError, match="non-empty branch"):
        tree_from_branches([Branch((), 1)], 4)


def test_pruning_by_depth_nodes_and_joint_probability_keeps_parents():
    tree = tree_from_logits(torch.tensor([[2.0, 1.0, 0.0, -1.0], [3.0, 0.0, 0.0, 0.0], [0.5, 0.4, 0.0, 0.0]]), 10)
    joint = tree.joint_probs()
    for i, p in enumerate(tree.parents.tolist()):
        assert joint[i] <= (1.0 if p < 0 else joint[p])
    for depth, nodes, floor in ((1, 10, 0.0), (3, 4, 0.0), (3, 10, 0.2), (2, 6, 0.1)):
        cut = tree.pruned(depth, nodes, floor)
        assert cut.max_depth <= depth and cut.size <= nodes and bool((cut.joint_probs() >= floor).all())
        # Exactly the qualifying nodes, each under its own parent's path.
        want = {p for i, p in enumerate(_ordered_paths(tree)) if len(p) <= depth and i < nodes and joint[i] >= floor}
        assert _paths(cut) == want
    assert tree.pruned(3, 10, 0.99) is None


def _ordered_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(int(tree.tokens[r - 1]) for r in tree.path_to(i + 1)[1:]) for i in range(tree.size)]


def test_draft_tree_setting():
    from edgespec.drafters.tree import AUTO_TREE_BUDGET, tree_setting
    assert tree_setting("off", 0.1) == (None, 0.0) and tree_setting("False", 0.1) == (None, 0.0)
    assert tree_setting("24", 0.1) == (24, 0.0)
    assert tree_setting("auto", 0.1) == (AUTO_TREE_BUDGET, 0.1)
    assert tree_setting(" Auto ", 0.0) == (AUTO_TREE_BUDGET, 0.0)
    assert tree_setting("auto", 0.0, 12) == (12, 0.0)                 # the arch's budget
    assert tree_setting("20", 0.1, 12) == (20, 0.0)
