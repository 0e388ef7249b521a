"""Prefix reuse across requests (edgespec.cache.prefix): a multi-turn chat resumes from the cached prefix and
answers exactly what a fresh prefill answers, for attention-only and hybrid (GDN) models, with n-gram and DFlash
drafters (whose window must end up the same)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgespec.bench.random_drafter import write_dflash_drafter
from edgespec.bench.shapes import tiny_config, write_chat_tokenizer, write_random_checkpoint
from edgespec.cache.prefix import PrefixCache, common_prefix
from edgespec.config import Settings
from edgespec.engine import Engine, Request
from edgespec.plan import build_plan
from edgespec.speculative.acceptance import StrictGreedy

SYSTEM = {"role": "system", "content": "You drive a robot arm on a kitchen table. Answer briefly. " * 3}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefix")
    out = {}
    for fam in ("llama", "qwen3_5"):
        folder = write_random_checkpoint(root / fam, tiny_config(fam, vocab_size=272), seed=3)
        out[fam] = write_chat_tokenizer(folder)
    out["dflash"] = write_dflash_drafter(
        root / "dflash", out["qwen3_5"], seed=1, num_layers=2, block_size=5, target_layer_ids=[1, 3, 5])
    return out


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _engine(models: dict[str, Path], fam: str, drafter: str, reuse: bool) -> Engine:
    extra = dict(drafter_path=str(models["dflash"]), window_size=24) if drafter == "dflash" else {}
    return Engine.load(build_plan(Settings(model=str(models[fam]), drafter=drafter, max_seq_len=1024,
                                         prefix_reuse=reuse, **extra)))


def _conversation(engine: Engine, turns: int = 4) -> list[tuple[list[int], int, list[int] | None]]:
    """Token ids, cached prompt tokens and (DFlash) window token ids of each turn of a growing chat."""
    msgs = [SYSTEM]
    out = []
    for turn in range(turns):
        msgs.append({"role": "user", "content": f"Turn {turn}: move block {turn} left and say where it is."})
        c = engine.complete(Request(messages=list(msgs), max_tokens=20))
        # the DFlash proposer itself (by default it sits behind the n-gram lookup, edgespec.drafters.lookup)
        dflash = getattr(engine.proposer, "model", engine.proposer)
        window = dflash.window_tokens() if engine.plan.drafter.name == "dflash" else None
        out.append((c.token_ids, c.cached_tokens, window))
        msgs.append({"role": "assistant", "content": c.text})
    return out


@pytest.mark.parametrize("fam,drafter", [("llama", "none"), ("llama", "ngram"), ("qwen3_5", "ngram"),
                                         ("qwen3_5", "dflash")])
def test_reuse_answers_like_a_fresh_prefill(models, fam, drafter):
    fresh = _conversation(_engine(models, fam, drafter, reuse=False))
    reused = _conversation(_engine(models, fam, drafter, reuse=True))
    for turn, ((ids_a, cached_a, win_a), (ids_b, cached_b, win_b)) in enumerate(zip(fresh, reused, strict=True)):
        assert cached_a == 0
        assert ids_b == ids_a, f"turn {turn} differs with prefix reuse"
        assert win_b == win_a, f"turn {turn}: DFlash window differs with prefix reuse"
        if turn:
            assert cached_b > 50, f"turn {turn} reused only {cached_b} tokens"


def test_hybrid_resumes_only_at_snapshots(models):
    engine = _engine(models, "qwen3_5", "none", reuse=True)
    msgs = [SYSTEM, {"role": "user", "content": "Where is the cup?"}]
    first = engine.complete(Request(messages=msgs, max_tokens=8))
    prefix = engine.prefix
    assert prefix is not None and prefix.snapshot_lengths
    ids = engine.prompt_ids(Request(messages=msgs))
    # Same prompt again: the longest snapshot not past len-1 (the last row is always recomputed).
    start = prefix.plan(ids, 0)
    assert start in prefix.snapshot_lengths and start < len(ids)
    again = engine.complete(Request(messages=msgs, max_tokens=8))
    assert again.cached_tokens == start and again.token_ids == first.token_ids


def test_foreign_use_of_the_cache_disables_reuse(models):
    engine = _engine(models, "llama", "ngram", reuse=True)
    msgs = [SYSTEM, {"role": "user", "content": "Where is the cup?"}]
    first = engine.complete(Request(messages=msgs, max_tokens=8))
    # A direct session.generate (bench, profile) resets the cache behind the engine's back.
    other = engine.tokenizer.encode("something else entirely")
    engine.session.generate(other, max_tokens=4, policy=StrictGreedy())
    again = engine.complete(Request(messages=msgs, max_tokens=8))
    assert again.cached_tokens == 0 and again.token_ids == first.token_ids


def test_off_switch_and_common_prefix(models):
    engine = _engine(models, "llama", "none", reuse=False)
    assert engine.prefix is None
    msgs = [SYSTEM, {"role": "user", "content": "Where is the cup?"}]
    engine.complete(Request(messages=msgs, max_tokens=4))
    assert engine.complete(Request(messages=msgs, max_tokens=4)).cached_tokens == 0
    assert common_prefix(list(range(1000)), list(range(700)) + [5]) == 700
    assert common_prefix([], [1]) == 0
    with pytest.raises(ValueError):
        PrefixCache(engine.session.cache, max_snapshots=0)
    # The multi-turn bench compares reuse against no reuse: with reuse off it refuses by name before any work.
    from argparse import Namespace

    from edgespec.bench.multiturn import run_multi_turn
    from edgespec.errors import ConfigError
    with pytest.raises(ConfigError, match="prefix_reuse"):
        run_multi_turn(engine, Namespace(history_tokens=100, prompts=None, turns=1, tokens=4))
