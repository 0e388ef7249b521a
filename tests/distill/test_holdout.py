"""Held-out guards of edgespec distill (edgespec.distill.holdout): whole templates or sources held out, the
user's own held-out file never trained on, the held-out AL printed and written next to the drafter."""

from __future__ import annotations

import doctest
import json

import pytest
import torch
from test_distill import _common, _distill

from edgespec.bench.shapes import tiny_config, write_chat_tokenizer, write_random_checkpoint
from edgespec.distill import holdout
from edgespec.distill.data import Sequence_
from edgespec.distill.holdout import held_groups, prompt_key, split, template_of
from edgespec.errors import ConfigError


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_chat_tokenizer(write_random_checkpoint(tmp_path_factory.mktemp("t") / "llama", tiny_config("llama"),
                                                        seed=3))


def _seq(prompt: list[int], out: int = 3) -> Sequence_:
    tokens = torch.tensor(prompt + list(range(100, 100 + out)))
    return Sequence_(tokens=tokens, prompt_len=len(prompt), taps=torch.zeros(len(tokens), 1, 2))


def test_docstring_example_and_template_labels():
    assert doctest.testmod(holdout)[0] == 0
    assert template_of("Move   the CUP now please") == "move the cup now"
    assert template_of("anything", label="pick") == "pick"


def test_group_split_holds_out_whole_groups_stably():
    groups = [f"t{i % 6}" for i in range(60)]
    out = held_groups(groups, every=4)
    assert len(out) == 2 and out == held_groups(list(reversed(groups)), every=4)
    assert len(held_groups(["a", "b"], every=10)) == 1                 # at least one, never all
    seqs = [_seq([i, i + 1]) for i in range(30)]
    group_of = {prompt_key(s): f"t{i % 3}" for i, s in enumerate(seqs)}
    train, held, rep = split(seqs, "template", 3, group_of)
    held_names = {group_of[prompt_key(s)] for s in held}
    assert len(held_names) == 1 and not held_names & {group_of[prompt_key(s)] for s in train}
    assert (rep.split, rep.groups, rep.held_out_sequences, rep.train_sequences) == ("template", 3, 10, 20)


def test_held_out_file_wins_and_its_prompts_are_not_trained_on():
    seqs = [_seq([i, i + 1]) for i in range(10)]
    mine = [_seq([3, 4], out=5), _seq([50, 51])]
    train, held, rep = split(seqs, "template", 3, None, mine)
    assert held == mine and len(train) == 9 and rep.dropped_overlap == 1 and rep.split == "file"


def test_bad_splits_are_named():
    seqs = [_seq([i]) for i in range(4)]
    with pytest.raises(ConfigError, match="at least 2 groups; the data has 1"):
        split(seqs, "source", 3, {prompt_key(s): "robot" for s in seqs})
    with pytest.raises(ConfigError, match="--holdout-every 1"):
        held_groups(["a", "b", "c"], every=1)
    with pytest.raises(ConfigError, match="prompt the prompt set does not hold"):
        split(seqs, "template", 3, {prompt_key(seqs[0]): "a"})
    with pytest.raises(ConfigError, match="--holdout-by 'words'"):
        split(seqs, "words", 3)
    with pytest.raises(ConfigError, match="--held-out holds no sequence"):
        split(seqs, "prompt", 3, None, [])
    with pytest.raises(ConfigError, match="nothing left to train on"):
        split(seqs, "prompt", 3, None, seqs)


def test_distill_holds_out_templates_and_writes_the_al(target, tmp_path):
    prompts = tmp_path / "p.yaml"
    items = [{"user": f"move box {i} to shelf {i % 3}", "template": "move"} for i in range(4)]
    items += [{"user": f"report the state of arm {i}", "template": "report"} for i in range(4)]
    prompts.write_text(json.dumps(items))                          # JSON is YAML
    out = tmp_path / "drafter"
    r = _distill(*_common(target, out, prompts), "--steps", "2", "--holdout-by", "template",
                 "--samples-per-prompt", "0")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    written = json.loads((out / "held_out.json").read_text())
    assert written["split"] == "template" and written["groups"] == 2 and len(written["held_out_groups"]) == 1
    assert written["held_out_sequences"] == 4 and written["train_sequences"] == 4
    assert written["held_out_al"] == res["held_out_al"] >= 1.0
    assert "held-out AL" in r.stdout and "split by template" in r.stdout
    # the user's own held-out file: answered by the target, never trained on
    mine = tmp_path / "mine.txt"
    mine.write_text("move box 1 to shelf 1\ncount the screws in bin 4\n")
    r = _distill(*_common(target, tmp_path / "d2", prompts), "--steps", "2", "--held-out", str(mine),
                 "--samples-per-prompt", "0", "--data", str(out / "data"))
    assert r.returncode == 0, r.stderr
    written = json.loads((tmp_path / "d2" / "held_out.json").read_text())
    assert (written["split"], written["dropped_overlap"], written["train_sequences"]) == ("file", 1, 7)
    # a request log has no prompt texts: a template split is refused, naming the way out
    from edgespec.distill.request_log import RequestLog
    RequestLog(tmp_path / "log.jsonl").log_completion([1, 2, 3], [4, 5, 6], "x", "stop", "ngram", 1.0)
    r = _distill(*_common(target, tmp_path / "d3", prompts), "--steps", "1", "--from-log",
                 str(tmp_path / "log.jsonl"), "--holdout-by", "template")
    assert r.returncode == 2 and "--holdout-by template needs prompt texts" in r.stderr
