"""K for an MoE target from AL x measured verify cost (edgespec.profile.k_choice): AL(K) read from a chain run's
per-position acceptance, a verify cost that grows with the expert union choosing a shorter K than acceptance alone
would, the verify of K+1 rows measured on a real tiny MoE session with its union, and the profiler's K group
measuring only the predicted K."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_dflash import prompt_ids

from edgespec.arch.detect import select_hooks
from edgespec.drafters.ngram import NGramProposer
from edgespec.errors import ConfigError
from edgespec.profile.k_choice import al_by_k, measure_verify, pooled_counts, predict
from edgespec.profile.search import CandidateResult, ProfileOptions, Profiler
from edgespec.profile.space import GROUPS, TUNED_KNOBS, SpaceContext, candidate_key
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession


def telemetry(accepted_per_pos, drafts, cycles, draft_ms, verify_ms, other_ms):
    return {"telemetry": {"accepted_per_pos": accepted_per_pos, "drafts": drafts, "cycles": cycles,
                          "stage_ms": {"draft": draft_ms, "verify": verify_ms, "accept": other_ms}}}


def test_al_by_k_from_per_position_acceptance():
    counts = pooled_counts([telemetry([8, 6, 3, 1], 10, 10, 5.0, 50.0, 1.0),
                            telemetry([2, 2, 1, 0], 10, 10, 5.0, 50.0, 1.0)])
    assert counts["accepted_per_pos"] == [10, 8, 4, 1] and counts["drafts"] == 20
    assert al_by_k(counts, 4) == {1: 1.5, 2: 1.9, 3: 2.1, 4: 2.15}
    with pytest.raises(ConfigError, match="no drafts"):
        al_by_k({"drafts": 0, "accepted_per_pos": []}, 4)


def test_union_growth_picks_a_shorter_k():
    """The same acceptance: with a flat verify cost (dense) the longest K wins; with a cost that grows with the
    expert union (MoE) a shorter one does."""
    counts = pooled_counts([telemetry([9, 8, 7, 6], 10, 10, 4.0, 0.0, 1.0)])
    flat = predict(counts, 4, "mtp", {k: (10.0, 0.0) for k in (1, 2, 3, 4)})
    assert flat[0].k == 4
    growing = predict(counts, 4, "mtp", {1: (10.0, 12.0), 2: (13.0, 20.0), 3: (18.0, 27.0), 4: (25.0, 33.0)})
    assert growing[0].k == 2 and growing[0].union == 20.0
    best = growing[0]          # K=2: AL 2.7, verify 13 + 2 of 4 draft-ms + 0.1 other
    assert best.tok_s == pytest.approx(2.7 / (13.0 + 0.2 + 0.1) * 1e3)
    dflash = predict(counts, 4, "dflash", {2: (13.0, 20.0)})
    assert dflash[0].draft_ms == pytest.approx(0.4)       # a block drafter's cost does not shrink with K


def _engine(model, k):
    session = SpecSession.with_defaults(model, select_hooks("base", model.device), NGramProposer(), k=k,
                                        kv_fp8=False, max_len=256)
    return SimpleNamespace(session=session)


def test_measure_verify_on_a_moe_session(tiny_models):
    model = tiny_models["qwen3_5_moe"]
    ms, union = measure_verify(_engine(model, 3), 4, context=32, iters=2)
    assert ms > 0 and 2 <= union <= 8           # 4 rows x top-2 of 8 experts
    ms1, union1 = measure_verify(_engine(model, 1), 2, context=32, iters=2)
    assert 2 <= union1 <= 4


class _MoeBench:
    """The profiler's view of a loaded MoE target: opens an engine per candidate on the tiny model."""

    is_moe = True
    device = SimpleNamespace(type="cpu")
    has_state = True

    def __init__(self, model):
        self.model = model
        self.opened: list[int] = []

    def open(self, candidate):
        assert candidate["drafter"] == "ngram"
        self.opened.append(candidate["num_draft_tokens"])
        return _engine(self.model, candidate["num_draft_tokens"])

    def release(self):
        pass


def test_profiler_k_group_measures_the_predicted_k(tiny_models):
    """A measured n-gram run at K=4 and the verify costs measured per K give the K group its two candidates."""
    model = tiny_models["qwen3_5_moe"]
    prompt = prompt_ids(320, n=21, seed=6)
    s = _engine(model, 4).session
    tel = s.generate(prompt, max_tokens=24, policy=StrictGreedy()).telemetry.to_dict()
    cur = {**{k: None for k in TUNED_KNOBS}, "drafter": "ngram", "num_draft_tokens": 4}
    prof = Profiler.__new__(Profiler)       # the search state alone: no Bench to load (the model is given)
    bench = _MoeBench(model)
    prof.bench, prof.current, prof.notes = bench, cur, []
    prof.opt = ProfileOptions(values={"num_draft_tokens": [1, 2, 4, 8]})
    prof.progress = SimpleNamespace(message=lambda text: None)
    prof.results = {candidate_key(cur): CandidateResult(cur, "start", "start", status="ok", measurements=[
        {"resolved": {"k": 4}, "telemetry": tel}])}
    prof.predict_moe_k()
    assert sorted(bench.opened) == [1, 2, 4]         # K=8 is beyond the run: its acceptance is unknown
    assert sorted(prof.k_predicted) == [1, 2, 4] and "expert union" in prof.notes[-1]
    ctx = SpaceContext("cpu", False, True, False, 30, resolved_k=4, k_predicted=prof.k_predicted)
    plan = GROUPS["k"].plan(cur, ctx)
    assert "AL x measured verify cost" in plan.note
    assert [c["num_draft_tokens"] for c in plan.candidates[1:]] == [k for k in prof.k_predicted[:2] if k != 4]
