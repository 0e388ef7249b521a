"""Suffix drafter (edgespec.drafters.suffix): drafts from earlier outputs the n-gram lookup cannot see, greedy
output equals plain decoding on attention and hybrid targets (alone and as the lookup in front of DFlash), the
settings build it and name bad values."""

from __future__ import annotations

import itertools

import pytest
import torch
from _plans import proposer_from

from edgespec.arch.detect import select_hooks
from edgespec.arch.rollback import ROLLBACK_STRATEGIES
from edgespec.bench import random_drafter as make_drafter
from edgespec.config import Settings
from edgespec.drafters.lookup import LookupFirstProposer
from edgespec.drafters.ngram import NGramProposer
from edgespec.drafters.suffix import SuffixProposer
from edgespec.drafters.suffix_cache import SuffixCache
from edgespec.errors import ConfigError
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession

CPU = torch.device("cpu")


def _started(prop, history: list[int]):
    prop.begin(history[:-1], None)
    prop.commit([history[-1]], 0, None)
    return prop


def test_drafts_what_an_earlier_output_continued():
    cache = SuffixCache(1 << 20, 16, 100)
    cache.add([40, 41, 42, 43, 44, 45, 46, 47])
    history = [1, 2, 3, 41, 42, 43]
    # the request alone has no earlier 41 42 43: n-gram has nothing, the suffix drafter has the cache
    assert _started(NGramProposer(max_match=3), history).propose(43, 4) is None
    prop = _started(SuffixProposer(cache, max_depth=16, max_match=8, factor=1.0), history)
    assert prop.propose(43, 4).tokens.tolist() == [44, 45, 46]       # budget = 1 x 3 matched tokens
    assert prop.propose(43, 2).tokens.tolist() == [44, 45]
    assert prop.proposals == 2 and prop.propose_s > 0
    assert _started(SuffixProposer(None, max_depth=16, max_match=8), history).propose(43, 4) is None


def test_the_most_frequent_continuation_beats_the_latest():
    cache = SuffixCache(1 << 20, 16, 100)
    for out in ([7, 8, 9, 10, 11], [7, 8, 9, 10, 11], [7, 8, 9, 20, 21]):
        cache.add(out)
    prop = _started(SuffixProposer(cache, max_depth=16, max_match=8, factor=1.0, min_prob=0.1), [5, 7, 8, 9])
    assert prop.propose(9, 8).tokens.tolist() == [10, 11]
    assert prop.branches(8) == [([10, 11], 2), ([20, 21], 1)]
    # the request's own history counts too: after 7 8 9 it wrote 20 21 twice itself
    prop = _started(SuffixProposer(cache, max_depth=16, max_match=8, factor=1.0, min_prob=0.1),
                    [7, 8, 9, 20, 21, 7, 8, 9, 20, 21, 7, 8, 9])
    assert prop.propose(9, 2).tokens.tolist() == [20, 21]


def test_committed_tokens_extend_the_request_trie():
    prop = _started(SuffixProposer(None, max_depth=8, max_match=4, factor=2.0), [1, 2, 3])
    assert prop.propose(3, 4) is None
    prop.commit([4, 1, 2], 0, None)
    assert prop.propose(2, 4).tokens.tolist() == [3, 4, 1, 2]       # 2 matched tokens x factor 2


def _plain(model, prompt, n, arch="base"):
    session = SpecSession.with_defaults(model, select_hooks(arch, CPU), None, max_len=256)
    return session.generate(prompt, max_tokens=n, policy=StrictGreedy(), k=0).token_ids


@pytest.mark.parametrize("family,arch,rollback", [("qwen3", "base", "checkpoint")]
                         + [("qwen3_5", a, r) for a, r in itertools.product(("base", "thor"), ROLLBACK_STRATEGIES)])
def test_greedy_equals_plain_with_accepts_and_rejects(tiny_models, family, arch, rollback):
    model = tiny_models[family]
    gen = torch.Generator().manual_seed(len(arch) + len(rollback))
    prompt = torch.randint(0, model.config.vocab_size, (40,), generator=gen).tolist()
    want = _plain(model, prompt, 24, arch)
    # The cache holds the true continuation and, more often, a wrong one after the same context: the drafter
    # proposes the wrong one first (rejections), then its own history and the true output pull it right.
    cache = SuffixCache(1 << 20, 24, model.config.vocab_size)
    cache.add(prompt[-6:] + want)
    wrong = want[:3] + [(t + 1) % model.config.vocab_size for t in want[3:]]   # diverges after 3 tokens
    cache.add(prompt[-6:] + wrong[:12])
    cache.add(prompt[-6:] + wrong[:12])
    prop = SuffixProposer(cache, max_depth=24, max_match=12, factor=2.0, min_prob=0.0)
    session = SpecSession.with_defaults(model, select_hooks(arch, CPU), prop, k=6, rollback=rollback, max_len=256)
    out = session.generate(prompt, max_tokens=24, policy=StrictGreedy())
    assert out.token_ids == want
    tel = out.telemetry
    assert tel.accepted_tokens > 0 and tel.draft_tokens > tel.accepted_tokens


def test_as_the_lookup_in_front_of_dflash(tiny_models, tiny_checkpoints, tmp_path):
    model = tiny_models["qwen3"]
    drafter = make_drafter.write_dflash_drafter(tmp_path / "d", tiny_checkpoints["qwen3"], seed=2, num_layers=1,
                                                block_size=6, target_layer_ids=[0, 2])
    prompt = torch.randint(0, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    want = _plain(model, prompt, 20)
    settings = Settings(drafter="dflash", drafter_path=str(drafter), lookup_drafter="suffix", lookup_min_match=2,
                        window_size=16)
    prop = proposer_from(settings, model)
    assert isinstance(prop, LookupFirstProposer) and prop.name == "dflash+suffix"
    assert isinstance(prop.lookup, SuffixProposer) and prop.suffix_cache is prop.lookup.suffix_cache
    prop.suffix_cache.add(want[:12])            # an earlier answer that matches the first half
    session = SpecSession.with_defaults(model, select_hooks("base", CPU), prop, max_len=256)
    out = session.generate(prompt, max_tokens=20, policy=StrictGreedy())
    assert out.token_ids == want
    assert prop.lookup_cycles > 0 and prop.model_cycles > 0


def test_settings_build_it_and_name_bad_values(tiny_models, tmp_path):
    model = tiny_models["qwen3"]
    prop = proposer_from(Settings(drafter="suffix", suffix_cache_mb=2.0, suffix_max_depth=10, suffix_max_match=4),
                          model)
    assert isinstance(prop, SuffixProposer) and prop.suffix_cache.max_bytes == 2 << 20
    assert (prop.max_depth, prop.max_match, prop.min_match) == (10, 4, 1)
    with pytest.raises(ConfigError, match="needs request_log|set request_log"):
        proposer_from(Settings(drafter="suffix", suffix_persist=True), model)
    log = tmp_path / "req.jsonl"
    prop = proposer_from(Settings(drafter="suffix", suffix_persist=True, request_log=str(log)), model)
    assert prop.suffix_cache.path == tmp_path / "req.jsonl.suffix.jsonl"
    with pytest.raises(ConfigError, match="suffix_max_depth 4 must exceed the longest match 4"):
        SuffixProposer(None, max_depth=4, max_match=4)
    with pytest.raises(ConfigError, match="min_match 5"):
        SuffixProposer(None, max_match=4, min_match=5)
    with pytest.raises(ConfigError, match="min_prob 2"):
        SuffixProposer(None, min_prob=2)
    with pytest.raises(ConfigError, match="suffix_cache_mb.*below the minimum"):
        Settings().with_overrides(suffix_cache_mb=-1)
    with pytest.raises(ConfigError, match="lookup_drafter.*not one of"):
        Settings().with_overrides(lookup_drafter="dflash")


def test_engine_feeds_the_cache_per_client(tmp_path):
    """Through the engine: every completion lands in its client's partition, a repeated request drafts from its
    earlier answer (AL up), another client's request does not, and the answers equal plain decoding."""
    from edgespec.bench.shapes import tiny_config, write_chat_tokenizer, write_random_checkpoint
    from edgespec.engine import Engine, Request
    from edgespec.plan import build_plan

    folder = write_chat_tokenizer(write_random_checkpoint(tmp_path / "m", tiny_config("llama", vocab_size=272),
                                                          seed=3))
    plain = Engine.load(build_plan(Settings(model=str(folder), drafter="none", max_seq_len=512)))
    spec = Engine.load(build_plan(Settings(model=str(folder), drafter="suffix", max_seq_len=512)))
    msgs = [{"role": "user", "content": "Move the red block to the left bin and report."}]
    want = plain.complete(Request(messages=msgs, max_tokens=24)).token_ids
    first = spec.complete(Request(messages=msgs, max_tokens=24, cache_key="robot-a"))
    again = spec.complete(Request(messages=msgs, max_tokens=24, cache_key="robot-a"))
    other = spec.complete(Request(messages=msgs, max_tokens=24, cache_key="robot-b"))
    assert first.token_ids == again.token_ids == other.token_ids == want
    assert again.telemetry.acceptance_length > first.telemetry.acceptance_length
    assert other.telemetry.acceptance_length == first.telemetry.acceptance_length
    assert len(spec.suffix_cache) == 3 and len(spec.suffix_cache.tries) == 2
