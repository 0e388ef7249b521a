"""Suffix trie (edgespec.drafters.suffix_tree): counts equal brute-force substring counts, removal undoes an add,
and the drafting functions pick the most frequent continuation; the docstrings' worked examples run as doctests."""

from __future__ import annotations

import doctest
import random
import tracemalloc
from collections import Counter

import pytest

from edgespec.drafters import suffix_tree
from edgespec.drafters.suffix_tree import (
    SuffixTrie,
    draft_budget,
    greedy_draft,
    match_suffix,
    suffix_branches,
)


def _paths(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every path of the trie with its count."""
    out, stack = {}, [((), 0)]
    while stack:
        path, v = stack.pop()
        for t, c in trie.items(v):
            out[path + (t,)] = trie.counts[c]
            stack.append((path + (t,), c))
    return out


def _brute(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: Counter = Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                counts[tuple(s[i:i + n])] += 1
    return dict(counts)


def test_docstring_examples_hold():
    failed, tried = doctest.testmod(suffix_tree)
    assert tried >= 5 and failed == 0


def test_counts_equal_brute_force_and_remove_undoes_add():
    rng = random.Random(3)
    seqs = [[rng.randrange(6) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
    trie = SuffixTrie(5)
    for s in seqs:
        trie.add(s)
    assert _paths(trie) == _brute(seqs, 5)
    assert trie.counts[0] == sum(map(len, seqs)) and trie.edges == len(_brute(seqs, 5))
    for s in seqs[:7]:
        trie.remove(s)
    assert _paths(trie) == _brute(seqs[7:], 5)
    assert trie.nodes == 1 + len(_brute(seqs[7:], 5))       # freed nodes are gone, the root stays
    for s in seqs[7:]:
        trie.remove(s)
    assert trie.nodes == 1 and trie.edges == 0 and trie.counts[0] == 0
    trie.add(seqs[0])                                         # freed ids are reused
    assert _paths(trie) == _brute(seqs[:1], 5)


def test_nbytes_tracks_measured_memory():
    rng = random.Random(0)
    seqs = [[rng.randrange(3000) for _ in range(150)] for _ in range(20)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        trie = SuffixTrie(16)
        for s in seqs:
            trie.add(s)
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.8 * measured < trie.nbytes() < 1.3 * measured


def test_match_prefers_the_longest_suffix_with_a_continuation():
    trie = SuffixTrie(6)
    trie.add([1, 2, 3, 4, 9, 2, 3, 5])
    node, n = match_suffix(trie, [7, 1, 2, 3], max_match=4)
    assert n == 3 and greedy_draft(trie, node, 4)[0] == [4, 9, 2]
    # [2, 3] also occurs at the end of the sequence (nothing after it) but occurs once more before 5.
    node, n = match_suffix(trie, [8, 2, 3], max_match=4)
    assert n == 2 and trie.counts[node] == 2
    assert match_suffix(trie, [7, 1, 2, 3], max_match=4, min_match=4) == (0, 0)
    assert match_suffix(trie, [6], max_match=4) == (0, 0)
    # after a removal empties a node's children, it matches as a leaf again (the shorter suffix wins)
    other = SuffixTrie(6)
    other.add([4, 2, 3, 8])
    other.add([2, 3, 9])
    other.remove([4, 2, 3, 8])
    node, n = match_suffix(other, [4, 2, 3], max_match=3)
    assert n == 2 and greedy_draft(other, node, 2)[0] == [9]
    for seq in ([1, 5], [1, 5, 7], [1, 5, 6], [5, 2]):
        other.add(seq)
    other.remove([1, 5, 7])
    other.remove([1, 5, 6])            # [1, 5] still occurs, its two children are gone
    assert other.children[other.walk([1, 5])] is None
    assert match_suffix(other, [1, 5], max_match=2) == (other.walk([5]), 1)
    # a suffix that occurred only at a sequence end predicts nothing
    assert match_suffix(trie, [3, 5], max_match=2) == (0, 0)


def test_greedy_takes_the_most_frequent_not_the_latest():
    trie = SuffixTrie(8)
    for s in ([1, 2, 7, 7], [1, 2, 7, 8], [1, 2, 9, 9]):   # after [1, 2]: 7 twice, 9 once (latest)
        trie.add(s)
    draft, score = greedy_draft(trie, trie.walk([1, 2]), max_len=3)
    assert draft == [7, 7] and score == pytest.approx(2 / 3 + 1 / 3)
    assert greedy_draft(trie, trie.walk([1, 2]), max_len=3, min_prob=0.5)[0] == [7]


def test_branches_are_ranked_and_bounded():
    trie = SuffixTrie(8)
    for s in ([1, 2, 7, 7], [1, 2, 7, 8], [1, 2, 9, 9], [1, 2, 7, 7]):
        trie.add(s)
    node = trie.walk([1, 2])
    assert suffix_branches(trie, node, max_len=2, max_branches=4) == [([7, 7], 2), ([7, 8], 1), ([9, 9], 1)]
    assert suffix_branches(trie, node, max_len=2, max_branches=1) == [([7, 7], 2)]
    assert suffix_branches(trie, node, max_len=1, max_branches=4) == [([7], 3), ([9], 1)]
    assert suffix_branches(trie, node, max_len=2, max_branches=4, min_prob=0.5) == [([7, 7], 2)]   # 2/4
    assert suffix_branches(trie, node, max_len=2, max_branches=4, min_prob=0.6) == [([7], 3)]
    assert suffix_branches(trie, node, max_len=0, max_branches=4) == []


def test_budget_and_bad_depth():
    assert [draft_budget(n, k=6, factor=0.5, offset=1) for n in (0, 1, 4, 40)] == [0, 1, 3, 6]
    with pytest.raises(ValueError, match="max_depth 1"):
        SuffixTrie(1)
