"""The n-gram match as a pure function, on tiny arrays (the proposer's gate and look-back: test_ngram.py)."""

from __future__ import annotations

import numpy as np

from edgespec.drafters.ngram import ngram_match


def _match(history: list[int], k: int, max_match: int, min_match: int = 1) -> list[int]:
    return ngram_match(np.array(history, dtype=np.int64), k, max_match, min_match).tolist()


def test_worked_example_of_the_docstring():
    history = [1, 2, 3, 9, 9, 3, 7, 5, 1, 2, 3]
    assert _match(history, 2, max_match=3) == [9, 9]      # the longest suffix [1, 2, 3] wins
    assert _match(history, 2, max_match=1) == [7, 5]      # [3]: the latest of its two earlier occurrences


def test_continuation_is_cut_at_k_and_at_the_end():
    assert _match([4, 5, 6, 7, 4], 2, max_match=1) == [5, 6]
    assert _match([4, 5, 4], 3, max_match=1) == [5, 4]    # only what history holds after the match


def test_no_earlier_occurrence_and_min_match():
    assert _match([1, 2, 3, 4], 3, max_match=3) == []
    assert _match([5, 6, 1, 2, 5], 1, max_match=2, min_match=2) == []
    assert _match([7], 2, max_match=4) == []              # one token has no earlier part to match
