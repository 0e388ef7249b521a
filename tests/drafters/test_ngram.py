"""N-gram (prompt lookup) proposer: longest suffix first, bounded look-back, the acceptance gate."""

from __future__ import annotations

from edgespec.drafters.ngram import NGramProposer


def _proposer(history, **kw) -> NGramProposer:
    p = NGramProposer(**kw)
    p.begin(history[:-1], None)
    p.commit([history[-1]], 0, None)
    return p


def test_longest_suffix_wins_and_latest_match():
    # Suffix [1, 2, 3] occurred once followed by 9; the shorter suffix [3] occurred later followed by 7.
    hist = [1, 2, 3, 9, 9, 3, 7, 5, 1, 2, 3]
    d = _proposer(hist, max_match=3).propose(3, 2)
    assert d.tokens.tolist() == [9, 9]
    d = _proposer(hist, max_match=1).propose(3, 2)
    assert d.tokens.tolist() == [7, 5]


def test_no_match_gives_no_draft():
    assert _proposer([1, 2, 3, 4], max_match=3).propose(4, 3) is None


def test_lookback_bounds_the_search():
    hist = [8, 9] + [0] * 50 + [8]
    assert _proposer(hist, max_match=1, lookback=100).propose(8, 1).tokens.tolist() == [9]
    assert _proposer(hist, max_match=1, lookback=20).propose(8, 1) is None


def test_min_match_respected():
    hist = [5, 6, 1, 2, 5]
    assert _proposer(hist, max_match=2, min_match=2).propose(5, 1) is None


def test_gate_pauses_then_probes_again():
    p = _proposer([1, 2, 1, 2, 1], gate=0.5, warmup_tokens=4, probe_every=3)
    assert p.propose(1, 4) is not None
    p.commit([7], 0, None, drafted=4)           # 0 of 4 accepted: below the gate
    assert p.paused_cycles == 3
    assert [p.propose(7, 4) for _ in range(3)] == [None, None, None]
    p.commit([1, 2, 1], 0, None)
    assert p.propose(1, 4) is not None          # probing again


def test_gate_ratio_is_per_token_not_per_k():
    p = _proposer([1, 2, 1, 2, 1], gate=0.25, warmup_tokens=8)
    p.commit([2], 2, None, drafted=8)           # 2/8 = 0.25: not below the gate
    assert p.paused_cycles == 0
