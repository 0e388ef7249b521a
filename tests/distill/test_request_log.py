"""The opt-in request log (JSONL, size-bounded, rotated) and turning it into distillation data."""

from __future__ import annotations

import json

import pytest

from edgespec.bench.shapes import tiny_config, write_chat_tokenizer, write_random_checkpoint
from edgespec.config import Settings
from edgespec.distill.data import load_data
from edgespec.distill.request_log import RequestLog, log_data, read_log
from edgespec.engine import Engine, Request
from edgespec.errors import ConfigError
from edgespec.loading.checkpoint import load_target
from edgespec.plan import build_plan


def test_rotation_keeps_the_file_bounded(tmp_path) -> None:
    log = RequestLog(tmp_path / "logs" / "req.jsonl", max_bytes=300, keep=2)
    for i in range(20):
        log.log_completion([1, 2, i], [3, 4], f"reply {i}", "stop", "dflash", 2.5)
    files = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert files == ["req.jsonl", "req.jsonl.1", "req.jsonl.2"]
    for p in (tmp_path / "logs").iterdir():
        assert p.stat().st_size <= 300
    # the newest record is in the live file, the older ones in .1 then .2, every line readable
    last = [json.loads(x) for x in (tmp_path / "logs" / "req.jsonl").read_text().splitlines()]
    assert last[-1]["prompt_ids"] == [1, 2, 19] and last[-1]["text"] == "reply 19"
    assert list(read_log(tmp_path / "logs" / "req.jsonl.2"))


def test_keep_zero_discards_old_records(tmp_path) -> None:
    log = RequestLog(tmp_path / "r.jsonl", max_bytes=200, keep=0)
    for i in range(10):
        log.log_completion([i], [1, 2], "x", "stop", "none", None)
    assert [p.name for p in tmp_path.iterdir()] == ["r.jsonl"]


def test_malformed_logs_are_named(tmp_path) -> None:
    with pytest.raises(ConfigError, match="request log not found"):
        list(read_log(tmp_path / "none.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [1], "output_ids": [2, 3]}\n{"prompt_ids": [1]}\n')
    with pytest.raises(ConfigError, match="line 2 is not a request record"):
        list(read_log(bad))
    bad.write_text('{"prompt_ids": [1], "output_ids": ["a"]}\n')
    with pytest.raises(ConfigError, match="line 1"):
        list(read_log(bad))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    folder = write_random_checkpoint(tmp_path_factory.mktemp("t") / "llama", tiny_config("llama"), seed=5)
    return write_chat_tokenizer(folder)


def test_engine_logs_when_asked_and_only_then(target_dir, tmp_path) -> None:
    path = tmp_path / "served.jsonl"
    quiet = Engine.load(build_plan(Settings(model=str(target_dir), max_tokens=6)))
    assert quiet.request_log is None
    engine = Engine.load(build_plan(Settings(model=str(target_dir), max_tokens=6, request_log=str(path))))
    out = engine.complete(Request(messages=[{"role": "user", "content": "pick the cube"}], max_tokens=6))
    (prompt, output), = list(read_log(path))
    assert output == out.token_ids and prompt == engine.prompt_ids(
        Request(messages=[{"role": "user", "content": "pick the cube"}]))
    rec = json.loads(path.read_text())
    assert rec["text"] == out.text and rec["finish_reason"] == out.finish_reason


def test_log_becomes_training_data_with_target_taps(target_dir, tmp_path) -> None:
    log = RequestLog(tmp_path / "r.jsonl")
    log.log_completion([5, 6, 7], [8, 9, 10], "t", "stop", "dflash", 1.0)
    log.log_completion([5], [8], "short", "length", "dflash", 1.0)          # 1 output token: skipped
    target = load_target(target_dir, merge=False)
    folder = log_data(tmp_path / "r.jsonl", tmp_path / "data", target, target_dir, [0, 2])
    meta, seqs = load_data(folder)
    assert len(seqs) == 1 and seqs[0].tokens.tolist() == [5, 6, 7, 8, 9, 10] and seqs[0].prompt_len == 3
    assert seqs[0].taps.shape == (6, 2, target.config.hidden_size) and meta["taps"] == [0, 2]
    log.log_completion([5000], [1, 2], "x", "stop", "none", None)
    with pytest.raises(ConfigError, match="outside the target's vocabulary"):
        log_data(tmp_path / "r.jsonl", tmp_path / "data2", target, target_dir, [0])
