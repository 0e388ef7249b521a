"""MTP drafter: its cached chain equals a naive full recompute (no KV cache) every cycle, its KV cache stays
aligned with the target across partial accepts and rollbacks, greedy speculative output equals plain output,
and targets without MTP weights are refused with a clear error. No HF reference exists for MTP."""

from __future__ import annotations

import itertools

import pytest
import torch
from _plans import proposer_from
from test_dflash import MixedProposer, make_drafter, plain_greedy, prompt_ids

from edgespec.arch.detect import select_hooks
from edgespec.arch.rollback import ROLLBACK_STRATEGIES
from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.cache.kv import KVCache
from edgespec.config import Settings
from edgespec.drafters.mtp import MTPProposer
from edgespec.errors import ConfigError
from edgespec.loading.checkpoint import load_target
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession

CPU = torch.device("cpu")


def naive_mtp_logits(model, history: list[int], drafts: list[int]) -> torch.Tensor:
    """Draft logits recomputed from scratch: a plain target forward over the committed tokens gives h_0..h_{N-1};
    for every chain step the MTP layer re-runs ALL rows (committed pairs, then the chained ones) with a fresh KV
    cache starting at position 0. ``history`` = committed tokens + the pending one (x_0 .. x_N)."""
    head = model.mtp
    N = len(history) - 1
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(history[:N]), model.new_cache(N + 8), logits="none").hidden
        tokens = list(history[1:])                 # row i pairs h_i with x_{i+1}
        out = []
        for j in range(len(drafts)):
            e = head.pre_fc_norm_embedding(model.embed(torch.tensor(tokens)))
            u = head.fc(torch.cat([e, head.pre_fc_norm_hidden(hidden)], dim=-1))
            for layer in head.layers:
                fresh = KVCache(len(tokens) + 1, model.config.num_key_value_heads, model.config.head_dim,
                                model.dtype, CPU)
                u, delta = layer(u, None, fresh, 0, model.rope, False, False)
                u = u + delta                      # the layer's output (it returns the residual as (h, delta))
            m = head.norm(u)
            out.append(model.logits(m[-1:])[0])
            tokens.append(drafts[j])               # the next chained row: (m, previous draft)
            hidden = torch.cat([hidden, m[-1:]])
        return torch.stack(out)


def test_from_target_errors(tiny_models, tiny_checkpoints, tmp_path):
    with pytest.raises(ConfigError, match="'qwen3'.*dflash or ngram"):
        MTPProposer.from_target(tiny_models["qwen3"], max_seq_len=Settings().max_seq_len)
    no_mtp = load_target(write_random_checkpoint(tmp_path / "nomtp", tiny_config("qwen3_5"), seed=7))
    assert no_mtp.mtp is None
    with pytest.raises(ConfigError, match="no mtp.\\* weights"):
        proposer_from(Settings(drafter="mtp"), no_mtp)
    prop = proposer_from(Settings(drafter="mtp", max_seq_len=64, lookup_min_match=0), tiny_models["qwen3_5"])
    assert isinstance(prop, MTPProposer) and prop.caches[0].max_len >= 64


def test_add_mtp_weights_tool(tmp_path):
    folder = write_random_checkpoint(tmp_path / "t", tiny_config("qwen3_5", mtp_num_hidden_layers=0), seed=3,
                                     shards=2)
    assert make_drafter.main(["mtp", "--target", str(folder), "--dtype", "float32"]) == 0
    model = load_target(folder)
    assert model.mtp is not None and len(model.mtp.layers) == 1
    prompt = prompt_ids(320, n=9)
    plain = plain_greedy(model, prompt, 8)
    session = SpecSession.with_defaults(model, select_hooks("base", CPU), MTPProposer(model, max_len=64), k=2,
                                        max_len=64)
    assert session.generate(prompt, max_tokens=8, policy=StrictGreedy()).token_ids == plain


@pytest.mark.parametrize("rollback", ROLLBACK_STRATEGIES)
def test_cached_chain_equals_full_recompute(tiny_models, rollback):
    model = tiny_models["qwen3_5"]
    prompt = prompt_ids(320, n=15)
    plain = plain_greedy(model, prompt, 26)
    seen = {"proposes": 0}

    def check(stage, prop: MTPProposer, history):
        if stage != "propose":
            return
        seen["proposes"] += 1
        # Catch-up done: the MTP holds one row per committed target position (the target cache length).
        assert prop.length == len(history) - 1 == session.cache.length
        drafts = prop.last_logits.argmax(-1).tolist()
        want = naive_mtp_logits(model, history, drafts)
        assert torch.allclose(prop.last_logits, want, atol=2e-4), (prop.last_logits - want).abs().max()

    mtp = MTPProposer(model, max_len=24)          # too small on purpose: the cache must grow
    mixed = MixedProposer(mtp, plain, 320, seed=4, check=check)
    session = SpecSession.with_defaults(model, select_hooks("base", CPU), mixed, k=4, rollback=rollback, max_len=128)
    out = session.generate(prompt, max_tokens=26, policy=StrictGreedy())
    assert out.token_ids == plain
    assert 0 < out.telemetry.accepted_tokens < out.telemetry.draft_tokens and seen["proposes"] >= 5
    assert mtp.caches[0].max_len > 24


@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv-model", "kv-fp8"])
def test_greedy_mtp_equals_plain(tiny_models, kv_fp8):
    model = tiny_models["qwen3_5"]
    prompt = prompt_ids(320, n=19, seed=9)
    n = 18
    plain = plain_greedy(model, prompt, n, kv_fp8)
    for arch, rollback in itertools.product(("base", "rtx", "thor"), ROLLBACK_STRATEGIES):
        mtp = MTPProposer(model, max_len=128)
        mixed = MixedProposer(mtp, plain, 320, seed=len(arch) * 3 + len(rollback))
        session = SpecSession.with_defaults(model, select_hooks(arch, CPU), mixed, k=3, kv_fp8=kv_fp8,
                                            rollback=rollback, max_len=128)
        out = session.generate(prompt, max_tokens=n, policy=StrictGreedy())
        assert out.token_ids == plain, (arch, rollback)
        assert 0 < out.telemetry.accepted_tokens < out.telemetry.draft_tokens
    for arch in ("base", "thor"):      # the head's own drafts
        session = SpecSession.with_defaults(model, select_hooks(arch, CPU), MTPProposer(model, max_len=128),
                                            kv_fp8=kv_fp8, max_len=128)
        assert session.generate(prompt, max_tokens=n, policy=StrictGreedy()).token_ids == plain
