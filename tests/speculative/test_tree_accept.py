"""Accepting a path of a verified tree: greedy longest matching path, lossless multi-draft sampling (chi-square)."""

from __future__ import annotations

import torch
from test_acceptance import _chi_square

from edgespec.drafters.tree import Branch, tree_from_branches
from edgespec.speculative.acceptance import RejectionSampling, StrictGreedy
from edgespec.speculative.sampling import SamplingParams, target_probs
from edgespec.speculative.tree_accept import accept_tree, greedy_tree_accept

# Root children 2 (-> 4 -> 1, -> 5) and 3 (-> 0); row order is pre-order: 2, 4, 1, 5, 3, 0.
BRANCHES = [Branch((2, 4, 1), 3), Branch((2, 5), 2), Branch((3, 0), 1)]


def _logits_with_argmax(targets: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(targets), vocab)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    return logits


def test_greedy_takes_the_matching_path_through_a_sibling():
    tree = tree_from_branches(BRANCHES, 16)
    assert tree.tokens.tolist() == [2, 4, 1, 5, 3, 0]
    # Root argmax 2 (row 1), row 1's argmax 5 (its second child, row 4), row 4's argmax 3 (no children: bonus).
    v = greedy_tree_accept(_logits_with_argmax([2, 5, 0, 0, 3, 0, 0]), tree)
    assert v.rows == [0, 1, 4] and v.tokens == [2, 5, 3] and v.sibling and v.accepted == 2
    # The first-choice path all the way down: no sibling.
    v = accept_tree(StrictGreedy(), _logits_with_argmax([2, 4, 1, 3, 0, 0, 0]), tree)
    assert v.rows == [0, 1, 2, 3] and v.tokens == [2, 4, 1, 3] and not v.sibling
    # Nothing matches at the root: one token, from the root row.
    v = greedy_tree_accept(_logits_with_argmax([1, 0, 0, 0, 0, 0, 0]), tree)
    assert v.rows == [0] and v.tokens == [1]


def test_tree_sampling_preserves_the_target_distribution():
    """The first emitted token follows the root row's distribution, and given it is node x, the second follows x's
    row: plain sampling's joint law, whatever the tree holds (99.9% chi-square quantile, <= 5 dof: 20.5)."""
    torch.manual_seed(0)
    vocab = 6
    tree = tree_from_branches(BRANCHES, 16)
    logits = torch.randn(tree.size + 1, vocab) * 1.5
    params = SamplingParams(temperature=0.9)
    p = target_probs(logits, params)
    policy = RejectionSampling(params, torch.Generator().manual_seed(2))
    n = 8000
    first = torch.zeros(vocab)
    after = {2: torch.zeros(vocab), 3: torch.zeros(vocab)}       # second token given the first was node 2 / 3
    siblings = 0
    for _ in range(n):
        v = accept_tree(policy, logits, tree)
        first[v.tokens[0]] += 1
        if v.tokens[0] in after:
            after[v.tokens[0]][v.tokens[1]] += 1
        siblings += v.sibling
    assert _chi_square(first, p[0]) < 20.5, (first / n, p[0])
    assert _chi_square(after[2], p[1]) < 20.5, (after[2], p[1])      # node 2 is row 1
    assert _chi_square(after[3], p[5]) < 20.5, (after[3], p[5])      # node 3 is row 5
    assert siblings > 0


def test_tree_sampling_rule_would_fail_if_siblings_were_judged_against_p_alone():
    """The test above can fail: judging every sibling against the unchanged p (no residual) over-emits the later
    siblings, which the same chi-square catches."""
    torch.manual_seed(0)
    vocab = 6
    tree = tree_from_branches(BRANCHES, 16)
    logits = torch.randn(tree.size + 1, vocab) * 1.5
    p = target_probs(logits, SamplingParams(temperature=0.9))
    gen = torch.Generator().manual_seed(2)
    first = torch.zeros(vocab)
    for _ in range(8000):
        token = None
        for x in (2, 3):                                             # the root's children, in order
            if float(torch.rand((), generator=gen)) < float(p[0, x]):
                token = x
                break
        if token is None:
            token = int(torch.multinomial(p[0], 1, generator=gen))
        first[token] += 1
    assert _chi_square(first, p[0]) > 20.5
