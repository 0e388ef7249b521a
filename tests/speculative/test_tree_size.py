"""Draft trees sized by cost: the cost models (edgespec.speculative.tree_cost) and the choice of nodes
(edgespec.speculative.tree_size)."""

from __future__ import annotations

import json

import pytest
import torch

from edgespec.drafters.tree import DraftTree, chain_tree, tree_from_logits
from edgespec.errors import ConfigError
from edgespec.speculative.tree_cost import CostModel, LineCost, MeasuredCost, RowCosts, load_row_costs
from edgespec.speculative.tree_size import choose_tree


class Linear(CostModel):
    """A cycle of R rows costs ``1 + ratio * R`` (``tree_ratio`` more for a tree forward)."""

    def __init__(self, ratio: float, tree_ratio: float = 1.0) -> None:
        self.ratio, self.tree_ratio = ratio, tree_ratio

    def record(self, rows, tree, verify_s, draft_s) -> None:
        pass

    def cycle(self, rows: int, tree: bool) -> float:
        return 1.0 + self.ratio * rows * (self.tree_ratio if tree else 1.0)


def test_line_cost_fits_the_line_of_recent_cycles():
    cost = LineCost(prior=0.5)
    # Verify 8 ms + 3 ms a row, draft 12 ms (its own depth-dependent part is not the tree's row cost).
    for i in range(15):
        cost.record(1 + i % 17, False, 0.008 + 0.003 * (1 + i % 17), 0.012)
    assert cost.row_ratio == 0.5                              # too few cycles yet: the prior
    assert cost.cycle(10, False) == pytest.approx(1.0 + 0.5 * 10)
    for i in range(15, 40):
        cost.record(1 + i % 17, False, 0.008 + 0.003 * (1 + i % 17), 0.012)
    fixed, per_row = cost.line()
    assert fixed == pytest.approx(0.020, rel=1e-6) and per_row == pytest.approx(0.003, rel=1e-6)
    assert cost.row_ratio == pytest.approx(0.15, rel=1e-6)
    assert cost.cycle(10, False) == pytest.approx(0.012 + 0.008 + 0.030, rel=1e-6)
    # Tree forwards measured 1.5x a chain of the same rows: trees are predicted so, chains are not.
    for _ in range(30):
        cost.record(12, True, 1.5 * (0.008 + 0.003 * 12), 0.012)
    assert cost.tree_ratio == pytest.approx(1.5, rel=1e-6)
    assert cost.cycle(12, True) == pytest.approx(0.012 + 1.5 * (0.008 + 0.036), rel=1e-6)
    # The device got slower per row: recent cycles outweigh old ones.
    for i in range(200):
        cost.record(1 + i % 17, False, 0.008 + 0.006 * (1 + i % 17), 0.012)
    assert cost.row_ratio == pytest.approx(0.30, rel=1e-3)


def test_line_cost_keeps_the_prior_when_widths_do_not_spread():
    cost = LineCost(prior=0.2)
    for i in range(50):
        cost.record(8 + i % 2, False, 0.05 + 0.001 * i, 0.0)
    assert cost.line() is None and cost.row_ratio == 0.2


@pytest.mark.parametrize("prior, decay", [(-0.1, 0.9), (0.1, 0.0), (0.1, 1.5)])
def test_line_cost_refuses_bad_settings(prior, decay):
    with pytest.raises(ValueError, match="cycle cost"):
        LineCost(prior, decay)


def test_row_costs_interpolate_or_step_and_scale_with_the_measured_cycles():
    lin = RowCosts({1: 10.0, 5: 14.0, 9: 22.0}, {2: 12.0, 10: 28.0})
    assert lin.verify_ms(5, False) == 14.0 and lin.verify_ms(3, False) == pytest.approx(12.0)
    assert lin.verify_ms(7, False) == pytest.approx(18.0) and lin.verify_ms(11, False) == pytest.approx(26.0)
    assert lin.verify_ms(6, True) == pytest.approx(20.0)
    steps = RowCosts({1: 5.0, 16: 11.0}, {16: 12.0, 32: 20.0, 64: 26.0}, step=True)
    assert steps.verify_ms(9, False) == 11.0                  # a shorter chain replays the 16-row graph
    assert steps.verify_ms(17, True) == 20.0 and steps.verify_ms(33, True) == 26.0
    cost = MeasuredCost(steps)
    assert cost.cycle(17, True) == 20.0                       # nothing measured yet: the table as it is
    for _ in range(40):                                       # a loaded machine: every verify takes twice as long
        cost.record(16, False, 2 * 11.0e-3, 3.0e-3)
        cost.record(20, True, 2 * 20.0e-3, 3.0e-3)
    assert cost.scale == pytest.approx(2.0, rel=1e-3)
    assert cost.cycle(33, True) == pytest.approx(3.0 + 2 * 26.0, rel=1e-3)


def test_row_costs_round_trip_and_bad_files_are_refused_by_name(tmp_path):
    costs = RowCosts({1: 5.0, 16: 11.0}, {16: 12.0}, {"device": "cpu", "model": "demo"}, step=True)
    path = costs.save(tmp_path / "row_costs.json")
    back = load_row_costs(path, {"device": "cpu"})
    assert back == RowCosts({1: 5.0, 16: 11.0}, {16: 12.0}, {"device": "cpu", "model": "demo"}, step=True)
    with pytest.raises(ConfigError, match="measured for device 'cpu' \\(here 'NVIDIA Thor"):
        load_row_costs(path, {"device": "NVIDIA Thor (20 SMs)"})
    with pytest.raises(ConfigError, match="no such file"):
        load_row_costs(tmp_path / "missing.json", {})
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read it as JSON"):
        load_row_costs(tmp_path / "bad.json", {})
    (tmp_path / "old.json").write_text(json.dumps({"version": 0}))
    with pytest.raises(ConfigError, match="not a row-cost table"):
        load_row_costs(tmp_path / "old.json", {})
    with pytest.raises(ConfigError, match="rows >= 1 and milliseconds > 0"):
        RowCosts({0: 1.0}, {2: 1.0})
    with pytest.raises(ConfigError, match="no tree verify measured"):
        RowCosts({1: 1.0}, {})


def _tree() -> DraftTree:
    torch.manual_seed(1)
    return tree_from_logits(torch.randn(5, 7) * 1.5, budget=20, chain_first=True)


def test_choose_tree_keeps_the_chain_and_adds_only_nodes_worth_their_rows():
    tree = _tree()
    chain = tree.first_path()
    joint = tree.joint_probs()
    # Rows free: every node is worth verifying.
    assert choose_tree(tree, joint, Linear(0.0)).tree.size == tree.size
    # Rows dearer than any node's chance: the chain alone, whole.
    alone = choose_tree(tree, joint, Linear(1.0))
    assert alone.tree.is_chain and alone.tree.first_chain().tolist() == tree.first_chain().tolist()
    assert alone.keep.tolist() == chain.tolist() and alone.rate == alone.chain_rate
    # In between: the chain plus the likeliest others.
    mid = choose_tree(tree, joint, Linear(0.05))
    assert chain.sum() < mid.tree.size < tree.size and mid.rate > mid.chain_rate
    assert mid.tree.first_chain().tolist() == tree.first_chain().tolist()
    others = sorted(joint[~chain].tolist(), reverse=True)
    kept = sorted(mid.tree.joint_probs()[~mid.tree.first_path()].tolist(), reverse=True)
    assert kept == pytest.approx(others[:len(kept)])
    # A tree forward dearer than a chain's of the same rows keeps the chain where the rows alone would not.
    assert choose_tree(tree, joint, Linear(0.05, tree_ratio=3.0)).tree.is_chain


def test_choose_tree_is_the_brute_force_optimum_and_never_below_the_chain():
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        torch.manual_seed(trial)
        tree = tree_from_logits(torch.randn(4, 6) * 2, budget=14, chain_first=True)
        chances = tree.joint_probs() * (float(torch.rand((), generator=gen)) + 0.2)
        cost = Linear(float(torch.rand((), generator=gen)) * 0.3, 1.0 + float(torch.rand((), generator=gen)))
        choice = choose_tree(tree, chances, cost, margin=0.0)
        chain = tree.first_path()
        base = 1.0 + float(chances[chain].sum())
        top = sorted(chances[~chain].tolist(), reverse=True)
        rates = {0: base / cost.cycle(int(chain.sum()) + 1, False)}
        rates |= {n: (base + sum(top[:n])) / cost.cycle(int(chain.sum()) + n + 1, True)
                  for n in range(1, len(top) + 1)}
        best = max(rates, key=lambda n: (rates[n], -n))
        assert choice.tree.size == int(chain.sum()) + best
        assert choice.rate >= choice.chain_rate


def test_choose_tree_without_the_chain_takes_the_likeliest_nodes():
    tree = _tree()
    out = choose_tree(tree, tree.joint_probs(), Linear(0.3), keep_chain=False).tree
    assert 1 <= out.size < tree.size
    assert sorted(out.joint_probs().tolist(), reverse=True) == pytest.approx(
        sorted(tree.joint_probs().tolist(), reverse=True)[:out.size])


def test_choose_tree_of_a_chain_is_the_chain():
    tree = chain_tree([4, 5, 6], probs=torch.tensor([0.1, 0.1, 0.1]))
    assert choose_tree(tree, tree.joint_probs(), Linear(1.0)).tree is tree
