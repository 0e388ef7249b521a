"""A resumed follow-up turn does work in proportion to its new tokens, not to the conversation before it:
rows through the model and characters through the tokenizer are counted (not timed) for two history lengths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgespec.bench.shapes import tiny_config, write_chat_tokenizer, write_random_checkpoint
from edgespec.config import Settings
from edgespec.engine import Engine, Request
from edgespec.plan import build_plan

FOLLOW_UPS = ["pick the red block and put it in the bin", "now park the arm and say so"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resume_work")
    return {fam: write_chat_tokenizer(write_random_checkpoint(root / fam, tiny_config(fam, vocab_size=272), seed=5))
            for fam in ("llama", "qwen3_5")}


def _follow_up_work(engine: Engine, history_chars: int) -> list[tuple[int, int, int]]:
    """(new prompt tokens, rows forwarded, characters tokenised) of each follow-up turn after a history."""
    rows: list[int] = []
    inner = engine.model.forward

    def counting_forward(tokens: torch.Tensor, *args, **kwargs):
        rows.append(tokens.shape[0])
        return inner(tokens, *args, **kwargs)

    engine.model.forward = counting_forward
    try:
        msgs = [{"role": "system", "content": ("log: moved block to shelf. " * 200)[:history_chars]},
                {"role": "user", "content": "start"}]
        engine.complete(Request(messages=list(msgs), max_tokens=1))
        out = []
        for text in FOLLOW_UPS:
            msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text}]
            rows.clear()
            c = engine.complete(Request(messages=list(msgs), max_tokens=1))
            out.append((c.prompt_tokens - c.cached_tokens, sum(rows), engine.encoder.last_encoded_chars))
        return out
    finally:
        del engine.model.forward


@pytest.mark.parametrize("fam", ["llama", "qwen3_5"])
def test_follow_up_work_scales_with_new_tokens(models, fam):
    engine = Engine.load(build_plan(Settings(model=str(models[fam]), drafter="ngram", max_seq_len=2048)))
    short, long = _follow_up_work(engine, 300), _follow_up_work(engine, 1500)
    assert short == long     # the same follow-ups cost the same whatever came before them
    for new, forwarded, chars in long:
        assert forwarded == new      # exactly the new tokens go through the model
        assert 0 < new < 120 and chars < 200     # a byte-level tokenizer: one token per byte
