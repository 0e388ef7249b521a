"""Draft trees sized by what a verify row costs (edgespec.speculative.tree_size)."""

from __future__ import annotations

import itertools

import pytest
import torch

from edgespec.drafters.tree import DraftTree, chain_tree, tree_from_logits
from edgespec.speculative.tree_size import CycleCost, best_node_count, size_tree


def test_cycle_cost_fits_the_line_of_recent_cycles():
    cost = CycleCost(prior=0.5)
    # Verify 8 ms + 3 ms a row, draft 12 ms (its own depth-dependent part is not the tree's row cost).
    for i in range(15):
        cost.record(1 + i % 17, 0.008 + 0.003 * (1 + i % 17), 0.012)
    assert cost.row_ratio == 0.5                              # too few cycles yet: the prior
    for i in range(15, 40):
        cost.record(1 + i % 17, 0.008 + 0.003 * (1 + i % 17), 0.012)
    fixed, per_row = cost.line()
    assert fixed == pytest.approx(0.020, rel=1e-6) and per_row == pytest.approx(0.003, rel=1e-6)
    assert cost.row_ratio == pytest.approx(0.15, rel=1e-6)
    # The device got slower per row: recent cycles outweigh old ones.
    for i in range(200):
        cost.record(1 + i % 17, 0.008 + 0.006 * (1 + i % 17), 0.012)
    assert cost.row_ratio == pytest.approx(0.30, rel=1e-3)


def test_cycle_cost_keeps_the_prior_when_widths_do_not_spread():
    cost = CycleCost(prior=0.2)
    for i in range(50):
        cost.record(8 + i % 2, 0.05 + 0.001 * i)
    assert cost.line() is None and cost.row_ratio == 0.2


@pytest.mark.parametrize("prior, decay", [(-0.1, 0.9), (0.1, 0.0), (0.1, 1.5)])
def test_cycle_cost_refuses_bad_settings(prior, decay):
    with pytest.raises(ValueError, match="cycle cost"):
        CycleCost(prior, decay)


def test_best_node_count_is_the_brute_force_optimum():
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        joint = torch.rand(12, generator=gen) ** 2
        factor, ratio = float(torch.rand((), generator=gen)) + 0.2, float(torch.rand((), generator=gen)) * 0.5
        kept, kept_nodes = (0.0, 0) if trial % 2 else (1.3, 3)
        top = sorted(joint.tolist(), reverse=True)
        lo = 1 if kept_nodes == 0 else 0
        rates = {n: (1 + factor * (kept + sum(top[:n]))) / (1 + ratio * (kept_nodes + n + 1))
                 for n in range(lo, len(top) + 1)}
        best = max(rates, key=lambda n: (rates[n], -n))
        assert best_node_count(joint, factor, ratio, kept, kept_nodes) == best


def _tree() -> DraftTree:
    torch.manual_seed(1)
    return tree_from_logits(torch.randn(5, 7) * 1.5, budget=20, chain_first=True)


def test_size_tree_keeps_the_chain_and_adds_only_nodes_worth_their_rows():
    tree = _tree()
    chain = tree.first_path()
    # Rows free: every node is worth verifying.
    assert size_tree(tree, 1.0, 0.0).size == tree.size
    # Rows dearer than any node's chance: the chain alone, whole.
    alone = size_tree(tree, 1.0, 1.0)
    assert alone.is_chain and alone.first_chain().tolist() == tree.first_chain().tolist()
    # In between: the chain plus the likeliest others, each worth its row at the optimum.
    mid = size_tree(tree, 1.0, 0.05)
    assert chain.sum() < mid.size < tree.size
    assert mid.first_chain().tolist() == tree.first_chain().tolist()
    joint = tree.joint_probs()
    others = sorted(joint[~chain].tolist(), reverse=True)
    kept = sorted(mid.joint_probs()[~mid.first_path()].tolist(), reverse=True)
    assert kept == pytest.approx(others[:len(kept)])


def test_size_tree_without_the_chain_takes_the_likeliest_nodes():
    tree = _tree()
    out = size_tree(tree, 1.0, 0.3, keep_chain=False)
    assert 1 <= out.size < tree.size
    assert sorted(out.joint_probs().tolist(), reverse=True) == pytest.approx(
        sorted(tree.joint_probs().tolist(), reverse=True)[:out.size])


def test_size_tree_of_a_chain_is_the_chain():
    tree = chain_tree([4, 5, 6], probs=torch.tensor([0.1, 0.1, 0.1]))
    assert size_tree(tree, 1.0, 1.0) is tree


def test_chain_first_tree_holds_the_whole_chain_then_the_most_probable_prefixes():
    """chain_first: all D first choices, then best-first: the other nodes are the most probable remaining path
    prefixes (brute force over every path of the per-depth top tokens)."""
    torch.manual_seed(2)
    D, V, budget = 4, 5, 10
    logits = torch.randn(D, V) * 2
    tree = tree_from_logits(logits, budget, chain_first=True)
    assert tree.size == budget
    top1 = logits.argmax(-1).tolist()
    assert tree.first_chain().tolist() == top1
    logp = torch.log_softmax(logits, -1)
    chain = {tuple(top1[:d]) for d in range(1, D + 1)}
    scores = {}
    for d in range(1, D + 1):
        for path in itertools.product(range(V), repeat=d):
            if path not in chain:
                scores[path] = sum(float(logp[i, t]) for i, t in enumerate(path))
    best = set(sorted(scores, key=lambda p: -scores[p])[:budget - D])
    paths = {tuple(int(tree.tokens[r - 1]) for r in tree.path_to(i + 1)[1:]) for i in range(tree.size)}
    assert paths == chain | best
    # A budget below the depth cuts the chain.
    short = tree_from_logits(logits, 2, chain_first=True)
    assert short.is_chain and short.first_chain().tolist() == top1[:2]
