"""Telemetry counts once (AcceptanceCounts) and publishes through sinks that only read the counts."""

from __future__ import annotations

from edgespec.speculative.telemetry import CumulativeTelemetry, RequestTelemetry, log_summary, telemetry_dict


def _request(cycles: list[tuple[int, int]]) -> RequestTelemetry:
    t = RequestTelemetry(drafter="ngram", prompt_tokens=5)
    for drafted, accepted in cycles:
        t.record_cycle(drafted, accepted)
    return t


def test_formulas_on_a_tiny_request():
    # Three verify cycles of 3, 2, 3 drafts with 3, 0, 1 accepted, and one plain decode step.
    t = _request([(3, 3), (2, 0), (0, 0), (3, 1)])
    assert (t.cycles, t.drafts, t.draft_tokens, t.accepted_tokens) == (4, 3, 8, 4)
    assert t.accepted_per_pos == [2, 1, 1]
    assert t.acceptance_length == 1 + 4 / 3
    assert t.acceptance_rate == 4 / 8
    assert t.per_position_rate == [2 / 3, 1 / 3, 1 / 3]


def test_no_drafts_gives_neutral_rates():
    t = _request([(0, 0), (0, 0)])
    assert (t.cycles, t.drafts) == (2, 0)
    assert (t.acceptance_length, t.acceptance_rate, t.per_position_rate) == (1.0, 0.0, [])


def test_cumulative_adds_the_same_counts():
    a, b = _request([(3, 3)]), _request([(2, 1), (4, 0)])
    total = CumulativeTelemetry()
    total.add(a)
    total.add(b)
    assert (total.requests, total.prompt_tokens, total.drafts, total.draft_tokens) == (2, 10, 3, 9)
    assert total.accepted_per_pos == [2, 1, 1, 0]
    assert total.acceptance_length == 1 + 4 / 3


def test_sinks_read_the_counts():
    t = _request([(3, 2)])
    t.generated_tokens, t.decode_ms = 11, 100.0
    d = telemetry_dict(t)
    assert d == t.to_dict()
    assert d["acceptance_length"] == 3.0 and d["per_position_rate"] == [1.0, 1.0, 0.0] and d["decode_tok_s"] == 100.0
    assert "sync" not in d
    line = log_summary(t)
    assert line == t.summary() and "AL=3.00" in line and "decode=100.0 tok/s" in line


def test_stage_sync_runs_around_each_stage():
    calls = []
    t = RequestTelemetry(sync=lambda: calls.append(1))
    with t.stage("verify"):
        assert calls == [1]
    assert calls == [1, 1] and t.stage_ms["verify"] >= 0.0
