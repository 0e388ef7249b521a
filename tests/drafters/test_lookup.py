"""Lookup first (edgespec.drafters.lookup): an n-gram draft where the request repeats itself, the model drafter
elsewhere; both see every committed token and the output equals plain decoding."""

from __future__ import annotations

import itertools

import pytest
import torch
from _plans import proposer_from

from edgespec.arch.detect import select_hooks
from edgespec.arch.rollback import ROLLBACK_STRATEGIES
from edgespec.bench import random_drafter as make_drafter
from edgespec.config import Settings
from edgespec.drafters.dflash import DFlashProposer, load_dflash_checkpoint
from edgespec.drafters.lookup import LookupFirstProposer
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def drafter(tiny_checkpoints, tmp_path_factory):
    return make_drafter.write_dflash_drafter(tmp_path_factory.mktemp("lookup") / "d", tiny_checkpoints["qwen3"],
                                             seed=2, num_layers=1, block_size=6, target_layer_ids=[0, 2])


def _plain(model, prompt, n, arch="base"):
    """Plain greedy decoding with the same hooks (thor defaults to an FP8 KV cache, which rounds differently)."""
    session = SpecSession.with_defaults(model, select_hooks(arch, CPU), None, max_len=256)
    return session.generate(prompt, max_tokens=n, policy=StrictGreedy(), k=0).token_ids


def test_lookup_where_the_history_repeats_the_model_elsewhere(tiny_models, drafter):
    model = tiny_models["qwen3"]

    def started(prompt: list[int], first: int) -> LookupFirstProposer:
        prop = LookupFirstProposer(load_dflash_checkpoint(drafter, model, window_size=16), min_match=3)
        prefill = model.prefill(torch.tensor(prompt), model.new_cache(64), taps=prop.taps)
        prop.begin(prompt, prefill)
        prop.commit([first], 0, None)
        return prop

    # History ... 11 12 13 14 15 16 5 11 12 | 13: the suffix 11 12 13 recurs, followed by 14 15 16 5.
    prop = started([3, 4, 11, 12, 13, 14, 15, 16, 5, 11, 12], 13)
    assert prop.propose(13, 4).tokens.tolist() == [14, 15, 16, 5]
    assert (prop.lookup_cycles, prop.model_cycles) == (1, 0)
    # No recurring suffix of 3 tokens: the DFlash block drafts (k tokens of its head's argmax).
    prop = started([3, 4, 11, 12, 13, 14, 15, 16, 5, 17, 18], 19)
    draft = prop.propose(19, 4)
    assert draft is not None and draft.tokens.shape == (4,)
    assert (prop.lookup_cycles, prop.model_cycles) == (0, 1)


@pytest.mark.parametrize("arch,rollback", list(itertools.product(("base", "thor"), ROLLBACK_STRATEGIES)))
def test_greedy_equals_plain(tiny_models, drafter, arch, rollback):
    model = tiny_models["qwen3"]
    gen = torch.Generator().manual_seed(len(arch) + len(rollback))
    # A third of the vocabulary in the prompt: most generated tokens recur, so both drafters take turns.
    prompt = torch.randperm(model.config.vocab_size, generator=gen)[:110].tolist()
    graphs = select_hooks(arch, CPU).defaults.cuda_graphs
    prop = LookupFirstProposer(load_dflash_checkpoint(drafter, model, window_size=8, cuda_graphs=graphs),
                               min_match=1)
    session = SpecSession.with_defaults(model, select_hooks(arch, CPU), prop, rollback=rollback, max_len=256)
    out = session.generate(prompt, max_tokens=18, policy=StrictGreedy())
    assert out.token_ids == _plain(model, prompt, 18, arch)
    assert prop.lookup_cycles > 0 and prop.model_cycles > 0 and prop.model.window.end == session.cache.length


def test_setting_wraps_the_model_drafter(tiny_models, drafter):
    """0 turns the lookup off, N sets it; the default is 3."""
    model = tiny_models["qwen3"]
    plain = proposer_from(Settings(drafter="dflash", drafter_path=str(drafter), lookup_min_match=0), model)
    assert isinstance(plain, DFlashProposer)
    wrapped = proposer_from(Settings(drafter="dflash", drafter_path=str(drafter), lookup_min_match=2), model)
    assert isinstance(wrapped, LookupFirstProposer) and wrapped.name == "dflash+lookup"
    assert wrapped.lookup.min_match == 2 and wrapped.taps == plain.taps and wrapped.max_k == plain.max_k
    default = proposer_from(Settings(drafter="dflash", drafter_path=str(drafter)), model)
    assert isinstance(default, LookupFirstProposer) and default.lookup.min_match == 3


def test_mtp_behind_the_lookup_catches_up_and_equals_plain(tiny_models):
    """MTP keeps the committed rows of the cycles the lookup drafted and catches up at its next propose."""
    from edgespec.drafters.mtp import MTPProposer

    model = tiny_models["qwen3_5"]
    prompt = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(4))[:110].tolist()
    for arch in ("base", "thor"):
        prop = LookupFirstProposer(MTPProposer(model, max_len=256), min_match=1)
        session = SpecSession.with_defaults(model, select_hooks(arch, CPU), prop, k=3, max_len=256)
        out = session.generate(prompt, max_tokens=18, policy=StrictGreedy())
        assert out.token_ids == _plain(model, prompt, 18, arch), arch
        assert prop.lookup_cycles > 0 and prop.model_cycles > 0
