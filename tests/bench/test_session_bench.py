"""Session bench (edgespec.bench.session): a request stream through every drafter's engine on one model, answers
equal to plain, first requests and steady state apart; the generated stream and bad arguments."""

from __future__ import annotations

import argparse
import json

import pytest

from edgespec.bench.cli import add_session_arguments
from edgespec.bench.robot_stream import robot_stream
from edgespec.bench.session import parse_drafters, run_session, session_requests
from edgespec.bench.shapes import tiny_config, write_chat_tokenizer, write_random_checkpoint
from edgespec.config import Settings
from edgespec.distill.workload import robot_prompts
from edgespec.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--out")
    add_session_arguments(p)
    return p.parse_args(list(argv))


def test_stream_is_seeded_and_unlike_the_training_templates():
    a = robot_stream(40, seed=3)
    assert a == robot_stream(40, seed=3) and a != robot_stream(40, seed=4)
    assert len(set(a)) > 20
    train = robot_prompts(200, seed=0)
    # no request shares a training template's opening words
    openings = {" ".join(t.split()[:4]) for t in train}
    assert not any(" ".join(t.split()[:4]) in openings for t in a)
    with pytest.raises(ValueError, match="at least 1 request"):
        robot_stream(0)


def test_stream_runs_on_every_engine_and_matches_plain(tmp_path, capsys):
    folder = write_chat_tokenizer(write_random_checkpoint(tmp_path / "m", tiny_config("llama", vocab_size=272),
                                                          seed=3))
    out = tmp_path / "session.json"
    args = _args("--session-drafters", "ngram,suffix", "--session-requests", "5", "--session-first", "2",
                 "--out", str(out))
    figures = run_session(args, Settings(model=str(folder), max_seq_len=512))
    text = capsys.readouterr().out
    assert "first (2 requests)" in text and "steady (3 requests)" in text and "us per proposal" in text
    assert set(figures["first"]) == set(figures["steady"]) == {"plain", "ngram", "suffix"}
    assert all(row[n]["same_as_plain"] for row in figures["rows"] for n in ("ngram", "suffix"))
    assert figures["steady"]["plain"]["x_plain"] == 1.0
    assert figures["suffix"]["suffix"]["cached_outputs"] == 5 + 1        # the stream + the warm-up
    assert json.loads(out.read_text())["session"]["steady"]["suffix"]["same_as_plain"] == "3/3"


def test_replays_a_request_log(tmp_path):
    from edgespec.distill.request_log import RequestLog

    log = RequestLog(tmp_path / "log.jsonl")
    log.log_completion([1, 2, 3], [4, 5], "x", "stop", "ngram", 1.0)
    log.log_completion([6, 7], [8], "y", "stop", "ngram", 1.0)
    reqs = session_requests(_args("--session-log", str(tmp_path / "log.jsonl")))
    assert [r.prompt_ids for r in reqs] == [[1, 2, 3], [6, 7]] and reqs[0].cache_key == reqs[1].cache_key
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no request to replay"):
        session_requests(_args("--session-log", str(tmp_path / "empty.jsonl")))


def test_bad_arguments_are_named():
    assert parse_drafters("suffix, ngram,suffix") == ["plain", "suffix", "ngram"]
    with pytest.raises(ConfigError, match="eagle not among"):
        parse_drafters("ngram,eagle")
    with pytest.raises(ConfigError, match="empty"):
        parse_drafters(" , ")
    with pytest.raises(ConfigError, match="--session-requests 0"):
        session_requests(_args("--session-requests", "0"))
    with pytest.raises(ConfigError, match="--session-first -1"):
        run_session(_args("--session-first", "-1"), Settings())
