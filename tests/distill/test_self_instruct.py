"""Self-instructed prompts (edgespec.distill.self_instruct): the user-turn prefix of the chat template, sampled
turns of a real (tiny random) target, the request filter, mixing of --prompts sources, and distill end to end."""

from __future__ import annotations

import doctest
import json

import pytest
import torch
from test_distill import _common, _distill

from edgespec.bench.shapes import tiny_config, write_chat_tokenizer, write_random_checkpoint
from edgespec.distill import self_instruct as si
from edgespec.distill.batched import generate_batch
from edgespec.distill.self_instruct import parse_sources, query_prefix, self_instruct
from edgespec.errors import ConfigError
from edgespec.loading.checkpoint import load_target
from edgespec.loading.tokenizer import ChatTokenizer


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_chat_tokenizer(write_random_checkpoint(tmp_path_factory.mktemp("t") / "llama", tiny_config("llama"),
                                                        seed=3))


def _anything(turn: str) -> str | None:
    """A permissive filter: a random tiny target writes bytes, not words, so the real filter keeps none."""
    return turn.strip() if si.normalized(turn) else None


def test_docstring_examples():
    assert doctest.testmod(si)[0] == 0


def test_query_prefix_with_a_system_turn(target):
    tok = ChatTokenizer.from_folder(target)
    prefix, ends = query_prefix(tok, "be a robot")
    want = "<|im_start|>system\nbe a robot<|im_end|>\n<|im_start|>user\n"
    assert tok.decode(prefix, skip_special_tokens=False) == want
    assert ends[0] == tok.token_id("<|im_end|>")


def test_requests_are_the_targets_own_sampled_turns(target):
    """Every request is the text the target sampled after the prefix up to an end-of-turn id (the same seed
    gives the same requests), distinct, never one of the excluded."""
    model = load_target(target, merge=False, max_positions=256)
    tok = ChatTokenizer.from_folder(target)
    got = self_instruct(model, tok, 5, batch=32, seed=1, keep=_anything)
    assert len(got) == 5 and len({si.normalized(t) for t in got}) == 5
    assert self_instruct(model, tok, 5, batch=32, seed=1, keep=_anything) == got
    assert self_instruct(model, tok, 5, batch=32, seed=2, keep=_anything) != got
    # the same sampling by hand: rounds of min(batch, 2 * missing + 8) rows from the prefix, one generator
    prefix, ends = query_prefix(tok)
    gen = torch.Generator().manual_seed(1 * 1_000_003 + sum(map(ord, "self")))
    by_key: dict[str, str] = {}
    while len(by_key) < 5:
        runs = generate_batch(model, [prefix] * min(32, 2 * (5 - len(by_key)) + 8), max_new_tokens=64,
                              stop_ids=ends, taps=[], temperature=1.0, generator=gen)
        for r in runs:
            turn = _anything(tok.decode(r.tokens[r.prompt_len:-1], skip_special_tokens=False))
            if r.tokens[-1] in ends and turn is not None and len(by_key) < 5:
                by_key.setdefault(si.normalized(turn), turn)
    assert got == list(by_key.values())
    fewer = self_instruct(model, tok, 4, batch=32, seed=1, keep=_anything, exclude=got[:2])
    assert not set(fewer) & set(got[:2])
    # a topic with openers: each request is an opener the target went on from
    robot = self_instruct(model, tok, 4, topic="self-robot", batch=32, seed=1, keep=_anything)
    assert len(robot) == 4 and all(any(t.startswith(o) for o in si.TOPICS["self-robot"][1]) for t in robot)
    opener = si.TOPICS["self-robot"][1][0]
    assert tok.decode(query_prefix(tok, None, opener)[0], skip_special_tokens=False) == f"<|im_start|>user\n{opener}"


def test_bad_inputs_are_named(target):
    model = load_target(target, merge=False, max_positions=256)
    tok = ChatTokenizer.from_folder(target)
    with pytest.raises(ConfigError, match="topic 'poems' is not one of self, self-robot"):
        self_instruct(model, tok, 2, topic="poems")
    with pytest.raises(ConfigError, match="n=0"):
        self_instruct(model, tok, 0)
    with pytest.raises(ConfigError, match=r"0 usable of the 3 asked after 2 batches"):
        self_instruct(model, tok, 3, batch=8, max_rounds=2, keep=lambda t: None)
    with pytest.raises(ConfigError, match="expected self:N with an integer N >= 1"):
        parse_sources("robot:10+self:lots")
    with pytest.raises(ConfigError, match="an empty part"):
        parse_sources("robot:10++self:3")


def test_distill_mixes_cached_self_instructed_prompts_and_holds_out_a_source(target, tmp_path):
    """--prompts self:N+FILE: the self-instructed part comes from the data folder's prompt cache (what an earlier
    run sampled), interleaved with the file's prompts; --holdout-by source holds out one whole source."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"move box {i} to shelf {i % 3}" for i in range(4)))
    out = tmp_path / "drafter"
    (out / "data").mkdir(parents=True)
    mine = [f"please tell me about topic number {i}" for i in range(4)]
    (out / "data" / "prompts-self-4-seed0.json").write_text(json.dumps(mine))
    args = _common(target, out, prompts)
    args[args.index("--prompts") + 1] = f"self:4+{prompts}"
    r = _distill(*args, "--steps", "4", "--samples-per-prompt", "0", "--holdout-by", "source",
                 "--holdout-every", "2", "--eval-every", "100", "--eval-each-epoch", "--keep-best")
    assert r.returncode == 0, r.stderr
    assert f"data: 8 prompts (self 4, {prompts} 4)" in r.stdout
    held = json.loads((out / "held_out.json").read_text())
    assert held["split"] == "source" and held["groups"] == 2 and len(held["held_out_groups"]) == 1
    info = json.loads((out / "distill.json").read_text())
    # evaluations: at the start, at the end of each epoch (4 training sequences: 2 steps of 2) and the last step
    assert [h[:2] for h in info["held_out_history"]] == [[0, 0], [2, 1], [4, 2]]
    assert (out / "best" / "config.json").is_file()
    best = json.loads((out / "best" / "distill.json").read_text())
    assert best["held_out_al"] == max(h[2] for h in info["held_out_history"])
    # a cache that is not what the run asks for is refused by name
    (out / "data" / "prompts-self-4-seed0.json").write_text(json.dumps(mine[:3]))
    r = _distill(*args, "--steps", "2", "--samples-per-prompt", "0")
    assert r.returncode == 2 and "is not a list of 4 prompt strings" in r.stderr


def test_distill_says_when_the_target_writes_no_usable_request(target, tmp_path):
    args = _common(target, tmp_path / "d", tmp_path / "unused")
    args[args.index("--prompts") + 1] = "self:3"
    r = _distill(*args, "--steps", "1")
    assert r.returncode == 2 and "self-instructed prompts (self): 0 usable of the 3 asked" in r.stderr
