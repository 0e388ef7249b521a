"""Replay of recorded greedy outputs through a token-id drafter (edgespec.bench.replay): the same drafts and
acceptances the engine counts, request for request, for n-gram and suffix; bad recorded streams named."""

from __future__ import annotations

import doctest

import pytest

from edgespec.bench import replay as rp
from edgespec.bench.replay import Recorded, collect, load_stream, replay, save_stream, token_proposer
from edgespec.bench.shapes import tiny_config, write_chat_tokenizer, write_random_checkpoint
from edgespec.config import Settings
from edgespec.drafters.ngram import NGramProposer
from edgespec.drafters.suffix import SuffixProposer
from edgespec.engine import Engine, Request
from edgespec.errors import ConfigError
from edgespec.plan import build_plan
from edgespec.speculative.session import adapts

TEXTS = ["move box 1 to shelf 2", "move box 3 to shelf 1", "report arm 4", "move box 1 to shelf 2 and report"]


def test_docstring_examples():
    assert doctest.testmod(rp)[0] == 0


def test_suffix_sizes_its_own_drafts():
    assert not adapts(SuffixProposer(), True) and adapts(NGramProposer(), True) and not adapts(None, False)


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_replay_counts_what_the_engine_counts(tmp_path, drafter):
    """The oracle: each request's drafting cycles and accepted drafts from the replay equal the engine's
    telemetry on the same stream (same client, so the suffix cache learns the same outputs in the same order)."""
    folder = write_chat_tokenizer(write_random_checkpoint(tmp_path / "m", tiny_config("llama", vocab_size=272),
                                                          seed=3))
    settings = Settings(model=str(folder), max_seq_len=512, max_tokens=40)
    plain = Engine.load(build_plan(settings.with_overrides(drafter="none")))
    stream = collect(plain, TEXTS, 40)
    path = tmp_path / "stream.json"
    save_stream(path, stream, {"texts": TEXTS})
    assert load_stream(path) == stream
    spec = Engine.around(build_plan(settings.with_overrides(drafter=drafter), plain.device), plain.model,
                         plain.tokenizer, plain.model_dir)
    proposer, k = token_proposer(settings.with_overrides(drafter=drafter), plain.model.config.vocab_size)
    replayed = replay(proposer, stream, k, spec.session.adaptive_k)
    drafted = 0
    for text, rec, rep in zip(TEXTS, stream, replayed, strict=True):
        c = spec.complete(Request(messages=[{"role": "user", "content": text}], max_tokens=40, cache_key="replay"))
        assert c.token_ids == rec.output                                   # lossless, so the replay's premise
        tel = c.telemetry
        assert (rep.drafts, rep.accepted) == (tel.drafts, tel.accepted_tokens)
        drafted += rep.drafts
    assert drafted > 0                                                     # the comparison saw drafts


def test_bad_streams_are_named(tmp_path):
    with pytest.raises(ConfigError, match="recorded stream not found"):
        load_stream(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"requests": [{"prompt": [1]}]}')
    with pytest.raises(ConfigError, match="is not a recorded stream"):
        load_stream(bad)
    with pytest.raises(ConfigError, match="ngram or suffix, not 'dflash'"):
        token_proposer(Settings(model="demo", drafter="dflash"), 100)
    assert replay(NGramProposer(), [Recorded([1, 2], [], None, 8)], 4, True)[0].cycles == []
