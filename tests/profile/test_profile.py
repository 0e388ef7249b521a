"""``edgespec profile``: input checks, the search rules, an end-to-end run on the demo model whose tuned YAML
starts a server, and Ctrl-C + resume (on a tiny random chat model, which measures in milliseconds)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from edgespec.config import Settings, load_settings, read_yaml
from edgespec.errors import ConfigError
from edgespec.profile import parse_budget
from edgespec.profile.cli import main
from edgespec.profile.measure import Bench
from edgespec.profile.search import CandidateResult, Profiler, choose
from edgespec.profile.space import GROUPS, SpaceContext, parse_groups, parse_values, start_candidate

# Short answers (a repeat and a one-word reply) so generations often stop before the token limit.
PROMPTS = [
    {"id": "repeat", "user": "Repeat exactly: red cube, blue box, red cube, blue box."},
    {"id": "one_word", "user": "Answer with one word: what colour is the sky?"},
]


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """One torch thread: on a shared 2-core runner two threads contend with the other jobs and run 5-10x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def prompts_file(tmp_path: Path) -> Path:
    p = tmp_path / "prompts.yaml"
    p.write_text(yaml.safe_dump(PROMPTS))
    return p


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer Llama with a byte tokenizer and <think> tokens (loads and runs in milliseconds)."""
    pytest.importorskip("fastapi")
    from serving_helpers import write_tiny_chat_model

    return write_tiny_chat_model(tmp_path_factory.mktemp("profile-tiny") / "tiny-chat")


def _args(out: Path, prompts: Path, *extra: str) -> list[str]:
    return ["--prompts", str(prompts), "--out", str(out), "--repeats", "1", "--warmup", "0", "--no-chart", *extra]


# -- inputs -----------------------------------------------------------------------------------------------------
def test_parse_budget() -> None:
    assert parse_budget("10m") == 600
    assert parse_budget("90s") == 90
    assert parse_budget("1h30m") == 5400
    assert parse_budget("45") == 45
    assert parse_budget("none") is None
    for bad in ("10x", "", "m", "5m10", "-3m", "0"):
        with pytest.raises(ConfigError, match="--budget"):
            parse_budget(bad)


@pytest.mark.parametrize("flags, message", [
    (["--groups", "drafter,bogus"], "unknown group(s) 'bogus'"),
    (["--budget", "10x"], "--budget '10x' is not a duration"),
    (["--values", "num_draft_tokens=0"], "below the minimum 1"),
    (["--values", "temperature=0.5"], "not a tuned knob"),
    (["--prompts", "/nonexistent/prompts.yaml"], "prompt file not found: /nonexistent/prompts.yaml"),
])
def test_bad_inputs_fail_clearly_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                flags: list[str], message: str) -> None:
    # The model path does not exist either: the input error must come first (loading takes minutes on a device).
    rc = main(["--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err, err
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_groups_keep_search_order() -> None:
    assert parse_groups("k,drafter") == ["drafter", "k"]
    assert parse_groups(None) == list(GROUPS)
    assert parse_values(["num_draft_tokens=2,4", "kv_dtype=fp8"]) == {"num_draft_tokens": [2, 4], "kv_dtype": ["fp8"]}


# -- search rules (no model) ------------------------------------------------------------------------------------
def _ctx(**kw: Any) -> SpaceContext:
    base = dict(device_type="cpu", allow_lossy=False, has_state=False, thinking_prompts=True, longest_prompt=40)
    return SpaceContext(**{**base, **kw})


def test_group_plans_explain_skips() -> None:
    from edgespec.arch.base import ArchDefaults

    cur = start_candidate(Settings(drafter="ngram"), ArchDefaults())
    assert cur["kv_dtype"] == "model" and cur["rollback"] == "checkpoint" and cur["cuda_graphs"] is False
    assert "--allow-lossy" in GROUPS["relaxed"].plan(cur, _ctx()).note
    relaxed = GROUPS["relaxed"].plan(cur, _ctx(allow_lossy=True)).candidates
    assert relaxed[0] == cur and all(c["acceptance"] == "relaxed_thinking" for c in relaxed[1:])
    assert "GPU" in GROUPS["graphs"].plan(cur, _ctx()).note
    assert "attention-only" in GROUPS["rollback"].plan(cur, _ctx()).note
    assert len(GROUPS["rollback"].plan(cur, _ctx(has_state=True)).candidates) == 3   # checkpoint, replay, deferred
    ks = [c["num_draft_tokens"] for c in GROUPS["k"].plan(cur, _ctx(resolved_k=4)).candidates]
    assert ks == [None, 2, 3, 6, 8]          # K=4 is what the start ran with (the n-gram default)
    drafters = GROUPS["drafter"].plan({**cur, "num_draft_tokens": 6}, _ctx()).candidates
    assert [c["drafter"] for c in drafters] == ["ngram", "none", "dflash", "mtp"]
    assert all(c["num_draft_tokens"] is None for c in drafters[1:])   # a new drafter starts at its default K
    assert "model drafter" in GROUPS["lookup"].plan(cur, _ctx()).note          # n-gram already drafts by lookup
    lookups = GROUPS["lookup"].plan({**cur, "drafter": "dflash"}, _ctx()).candidates
    assert cur["lookup_min_match"] == 3                    # the default
    assert [c["lookup_min_match"] for c in lookups] == [3, 0, 2, 4]


def test_tree_group_measures_budgets_with_the_deferred_rollback() -> None:
    from edgespec.arch.base import ArchDefaults

    cur = start_candidate(Settings(drafter="dflash", draft_tree="auto"), ArchDefaults(tree_budget=12))
    assert cur["draft_tree"] == "12"                     # auto resolved to the arch's budget: one candidate, not two
    plans = GROUPS["tree"].plan({**cur, "draft_tree": "off"}, _ctx()).candidates
    assert [c["draft_tree"] for c in plans] == ["off", "4", "8", "12", "16", "32"]
    assert all(c["rollback"] == "deferred" for c in plans[1:]) and plans[0]["rollback"] == "checkpoint"
    assert "no drafter" in GROUPS["tree"].plan({**cur, "drafter": "none"}, _ctx()).note
    assert "deferred" in GROUPS["rollback"].plan(plans[2], _ctx(has_state=True)).note
    assert parse_values(["draft_tree=off,8"]) == {"draft_tree": ["off", "8"]}
    with pytest.raises(ConfigError, match="draft_tree"):
        parse_values(["draft_tree=wide"])


def _fake(label: str, tok_s: float, status: str = "ok", lossy: bool = False) -> CandidateResult:
    cand = {"drafter": "ngram", "acceptance": "relaxed_thinking" if lossy else "strict", "label": label}
    m = {"generated_tokens": 11, "decode_ms": 10_000 / max(tok_s, 1e-3), "ttft_ms": 5.0, "acceptance_length": 2.0,
         "same_as_plain": status != "disqualified", "peak_memory_bytes": 0}
    return CandidateResult(cand, label, "test", status, measurements=[m])


def test_choose_keeps_incumbent_unless_a_clean_candidate_wins_clearly() -> None:
    inc = _fake("inc", 10.0)
    assert choose([inc, _fake("faster-but-wrong", 50.0, "disqualified")], inc, "objective", "decode", 0.02) is inc
    assert choose([inc, _fake("noise", 10.1)], inc, "objective", "decode", 0.02) is inc
    win = _fake("win", 12.0)
    assert choose([inc, _fake("skipped", 0.0, "skipped"), win], inc, "objective", "decode", 0.02) is win
    broken = _fake("broken-start", 99.0, "skipped")
    assert choose([broken, win], broken, "objective", "decode", 0.02) is win


def test_missing_matplotlib_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from edgespec.profile.report import ChartUnavailable, write_chart
    from edgespec.profile.search import SearchOutcome

    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib -> ImportError
    outcome = SearchOutcome({}, None, [], [], "complete", None, [])
    with pytest.raises(ChartUnavailable, match="needs matplotlib.*pip install 'edgespec\\[profile\\]'"):
        write_chart(tmp_path / "chart.png", outcome, [])


# -- end to end on the demo model -------------------------------------------------------------------------------
def test_profile_demo_model_writes_a_yaml_that_serves(demo_model_dir: Path, tmp_path: Path, prompts_file: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"model": str(demo_model_dir), "max_seq_len": 256, "drafter": "none",
                                    "port": 8123, "served_model_name": "robot"}))
    out = tmp_path / "out"
    chart = _has_matplotlib()
    flags = _args(out, prompts_file, "--config", str(base), "--tokens", "16", "--groups", "drafter,k",
                  "--values", "num_draft_tokens=2", "--budget", "5m")
    if chart:
        flags.remove("--no-chart")
    assert main(flags) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "ETA" in err and "skip drafter=dflash" in err

    for name in ("tuned.yaml", "plan.yaml", "measurements.json", "report.md", "results.jsonl"):
        assert (out / name).is_file(), name
    assert (out / "chart.png").is_file() == chart
    data = json.loads((out / "measurements.json").read_text())
    assert data["status"] == "complete"
    statuses = {c["label"]: c["status"] for c in data["candidates"]}
    assert statuses["start"] == "ok" and statuses["drafter=ngram"] == "ok", statuses
    assert statuses["drafter=dflash"] == "skipped" and statuses["drafter=mtp"] == "skipped"
    assert "failed" not in statuses.values()
    ok = [c for c in data["candidates"] if c["status"] == "ok"]
    assert {m["prompt"] for m in data["measurements"]} == {"repeat", "one_word"}
    assert all(m["same_as_plain"] for m in data["measurements"])          # n-gram speculation is lossless
    assert len(data["measurements"]) == 2 * len(ok)
    m = data["measurements"][0]
    assert m["decode_tok_s"] >= 0 and m["ttft_ms"] > 0 and m["peak_memory_bytes"] > 0
    report = (out / "report.md").read_text()
    assert "## Candidates" in report and "drafter=ngram" in report and "needs drafter_path" in report

    # The tuned YAML holds only settings keys, keeps the base's own values, and starts a server.
    tuned_file = out / "tuned.yaml"
    raw = read_yaml(tuned_file)
    assert raw["model"] == str(demo_model_dir) and raw["port"] == 8123 and raw["max_seq_len"] == 256
    assert raw.get("drafter", "none") == data["tuned"]["drafter"]
    tuned = load_settings(tuned_file, environ={})
    from edgespec.engine import Engine
    from edgespec.plan import build_plan, describe

    engine = Engine.load(build_plan(tuned))
    assert describe(engine.plan) == describe(build_plan(tuned))
    assert yaml.safe_load((out / "plan.yaml").read_text()) == describe(engine.plan)   # the plan written beside
    assert engine.session.drafter_name == data["tuned"]["drafter"]
    if tuned.drafter != "none":
        assert tuned.num_draft_tokens == engine.session.k                 # K pinned, not left to a default
    _serve_once(engine, tuned)


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _serve_once(engine: Any, settings: Settings) -> None:
    try:
        from fastapi.testclient import TestClient
        from serving_helpers import app_for
    except ImportError:
        return                                   # serving extras not installed: the engine check above stands
    with TestClient(app_for(settings, engine)) as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["drafter"] == settings.drafter
        r = client.post("/v1/chat/completions", json={
            "model": "robot", "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi."}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1


# -- Ctrl-C and resume --------------------------------------------------------------------------------------------
def _count_measure(monkeypatch: pytest.MonkeyPatch, interrupt_after: int | None = None) -> list[tuple[str, str]]:
    """Record (candidate drafter/kv, prompt) of every measurement; raise KeyboardInterrupt after N of them."""
    calls: list[tuple[str, str]] = []
    real = Bench.measure

    def measure(self: Bench, engine: Any, case: Any, tokens: int, repeats: int) -> dict[str, Any]:
        if interrupt_after is not None and len(calls) == interrupt_after:
            raise KeyboardInterrupt
        calls.append((f"{engine.plan.drafter.name}/{engine.plan.model.kv_dtype}", case.id))
        return real(self, engine, case, tokens, repeats)

    monkeypatch.setattr(Bench, "measure", measure)
    return calls


def test_interrupt_keeps_partial_results_and_resume_skips_them(tiny_chat_dir: Path, tmp_path: Path,
                                                                prompts_file: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    flags = _args(out, prompts_file, "--model", str(tiny_chat_dir), "--max-seq-len", "256", "--tokens", "8",
                  "--groups", "drafter,kv", "--values", "drafter=none,ngram", "--budget", "5m")
    with monkeypatch.context() as mp:
        first = _count_measure(mp, interrupt_after=3)
        assert main(flags) == 130
    err = capsys.readouterr().err
    assert "interrupted; 3 measurement(s) kept" in err
    lines = [json.loads(s) for s in (out / "results.jsonl").read_text().splitlines()]
    assert len([r for r in lines if r["type"] == "measurement"]) == 3
    assert not (out / "tuned.yaml").exists()                 # no winner from a half search
    assert "INTERRUPTED" in (out / "report.md").read_text()

    second = _count_measure(monkeypatch)
    assert main([*flags, "--resume"]) == 0, capsys.readouterr().err
    assert not set(first) & set(second)                      # nothing measured twice
    data = json.loads((out / "measurements.json").read_text())
    assert data["status"] == "complete"
    assert len(data["measurements"]) == len(first) + len(second) == 6   # none, ngram, kv=fp8 x 2 prompts
    assert data["meta"]["resumed"] >= 3
    assert read_yaml(out / "tuned.yaml")["model"] == str(tiny_chat_dir)


def test_output_change_disqualifies_a_strict_candidate(tiny_chat_dir: Path, tmp_path: Path, prompts_file: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend plain decoding said something else: the n-gram candidate's output no longer matches, so however
    # fast it is it must not be chosen.
    real = Profiler._reference

    def wrong_reference(self: Profiler, engine: Any, cand: dict[str, Any], case: Any) -> list[int] | None:
        ref = real(self, engine, cand, case)
        return None if ref is None else [-1, *ref]

    monkeypatch.setattr(Profiler, "_reference", wrong_reference)
    monkeypatch.setattr(Profiler, "_save_reference", lambda self, cand, case, ids, m: list(ids))
    out = tmp_path / "out"
    flags = _args(out, prompts_file, "--model", str(tiny_chat_dir), "--max-seq-len", "256", "--tokens", "8",
                  "--groups", "drafter", "--values", "drafter=ngram", "--min-gain", "0")
    assert main(flags) == 0
    data = json.loads((out / "measurements.json").read_text())
    statuses = {c["label"]: c["status"] for c in data["candidates"]}
    assert statuses == {"start": "ok", "drafter=ngram": "disqualified"}
    assert data["tuned"]["drafter"] == "none"
    assert "**no**" in (out / "report.md").read_text()


def test_relaxed_thinking_is_measured_only_with_allow_lossy_and_marked_lossy(tiny_chat_dir: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = tmp_path / "think.yaml"
    prompts.write_text(yaml.safe_dump([{"id": "think", "user": "plan: pick, place", "thinking": True}]))
    flags = ["--model", str(tiny_chat_dir), "--max-seq-len", "256", "--drafter", "ngram", "--tokens", "8",
             "--groups", "relaxed", "--values", "relaxed_top_k=3", "--values", "relaxed_delta=2.0"]
    assert main(_args(tmp_path / "strict", prompts, *flags)) == 0
    assert "pass --allow-lossy" in (tmp_path / "strict" / "report.md").read_text()

    assert main(_args(tmp_path / "lossy", prompts, *flags, "--allow-lossy")) == 0
    data = json.loads((tmp_path / "lossy" / "measurements.json").read_text())
    relaxed = [c for c in data["candidates"] if c["candidate"]["acceptance"] == "relaxed_thinking"]
    assert len(relaxed) == 1 and relaxed[0]["lossy"] and relaxed[0]["status"] == "ok"
    assert relaxed[0]["candidate"]["relaxed_top_k"] == 3 and relaxed[0]["candidate"]["relaxed_delta"] == 2.0
    assert "lossy (opt-in)" in (tmp_path / "lossy" / "report.md").read_text()


def test_budget_spent_before_anything_was_measured(tiny_chat_dir: Path, tmp_path: Path, prompts_file: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(_args(out, prompts_file, "--model", str(tiny_chat_dir), "--tokens", "8", "--budget", "0.001s"))
    assert rc == 3
    assert "Raise --budget" in capsys.readouterr().err
    assert not (out / "tuned.yaml").exists()
    assert "stopped by the time budget" in (out / "report.md").read_text()
