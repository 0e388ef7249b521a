"""A short resumed prefill through the static verify forward, in chunks of its rows, writes what one eager forward
writes: last-row logits no further from the eager resume than the eager resume already is from a fresh one-shot
prefill (products over other row counts round differently), the same hidden rows, KV rows and GDN state to float
tolerance, and the same greedy answers over a multi-turn chat, for the rollback strategies that keep per-row
state. On CPU the static forward runs eagerly, the code a CUDA graph captures; on CUDA (bf16, skipped without a
GPU) the same tests replay the captured graphs.
"""

from __future__ import annotations

import pytest
import torch
from _devices import DEVICES

from edgespec.arch.base import ArchHooks
from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.cache.prefix import PrefixCache
from edgespec.drafters.ngram import NGramProposer
from edgespec.loading.checkpoint import load_target
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession


def _model(tmp_path, fam: str, seed: int, device: str, dtype: torch.dtype | None = None):
    """A tiny random target: fp32 on CPU, bf16 (as served) on CUDA unless ``dtype`` says otherwise."""
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    # the Triton attention takes head_dim 64/128/256: the CUDA run widens the tiny heads
    cfg = tiny_config(fam) if device == "cpu" else tiny_config(fam, head_dim=64, num_attention_heads=4,
                                                                 num_key_value_heads=2)
    return load_target(write_random_checkpoint(tmp_path / fam, cfg, seed=seed), dtype=dtype, device=device,
                       max_positions=512)


def _session(model, rollback: str, graph_max: int) -> SpecSession:
    return SpecSession.with_defaults(model, ArchHooks(), NGramProposer(), k=4, rollback=rollback, max_len=512,
                                     cuda_graphs=True, graph_prefill_max=graph_max)


# Attention-only and deferred rollback prefill through the wide (32-row) forward, checkpoint rollback on a hybrid
# through its 5-row verify forward; 23 and 45 rows: one and several chunks, each with a padded last chunk.
@pytest.mark.parametrize("fam,rollback,width", [("llama", "checkpoint", 32), ("qwen3_5", "checkpoint", 5),
                                                ("qwen3_5", "deferred", 32)])
@pytest.mark.parametrize("n", [23, 45])
@pytest.mark.parametrize("device", DEVICES)
def test_graph_prefill_equals_eager(tmp_path, fam, rollback, width, n, device):
    model = _model(tmp_path, fam, 7, device)
    history = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(1)).to(device)
    turn = torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(2)).to(device)
    one_shot = _session(model, rollback, 0)
    one_shot.cache.reset()
    ref = one_shot.hooks.prefill(model, one_shot.cache, torch.cat([history, turn]), 512, ()).logits
    outs = {}
    for name, graph_max in (("eager", 0), ("graph", 64)):
        s = _session(model, rollback, graph_max)
        s.cache.reset()
        s.hooks.prefill(model, s.cache, history, 512, ())           # a fresh prefill: eager in both
        static = s.hooks.static[max(s.hooks.static)]
        assert static.rows == (width if name == "graph" else 5)
        rows = static.tokens.clone()
        out = s.hooks.prefill(model, s.cache, turn, 512, ())
        # The graph path replayed the widest static forward (its token buffer holds the padded last chunk), eager
        # did not.
        last = (n - 1) // width * width
        padded = torch.cat([turn[last:], turn[-1:].expand(width - (n - last))])
        assert name == "eager" or torch.equal(static.tokens, padded)
        assert name == "graph" or torch.equal(static.tokens, rows)
        states = None if s.cache.states is None else s.cache.states.recurrent.clone()
        kv = [layer.k[:s.cache.length].clone() for layer in s.cache.kv_layers]
        outs[name] = (out, s.cache.length, states, kv)
    (a, la, sa, kva), (b, lb, sb, kvb) = outs["eager"], outs["graph"]
    assert la == lb == 30 + n
    assert a.logits.shape == b.logits.shape == (1, 320)
    resume_error = float((a.logits - ref).abs().max())
    # CPU: the graph path may differ from the eager resume by what the eager resume differs from a one-shot
    # prefill. CUDA (bf16): one-shot and eager resume both run the SDPA kernel (often the same bits), the graph
    # path the Triton attention over 32-row chunks: a few bf16 steps of the logits' scale apart.
    floor = 1e-5 if device == "cpu" else 3e-2 * float(a.logits.abs().max())
    assert float((b.logits - a.logits).abs().max()) <= max(2 * resume_error, floor)
    tol = 1e-3 if device == "cpu" else 3e-2         # bf16 on CUDA: products over other row counts round apart
    torch.testing.assert_close(b.hidden, a.hidden, rtol=tol, atol=tol)
    for x, y in zip(kvb, kva, strict=True):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)
    if sa is not None:
        torch.testing.assert_close(sb, sa, rtol=tol, atol=tol)
    assert int(a.logits.argmax()) == int(b.logits.argmax())


@pytest.mark.parametrize("fam,rollback", [("llama", "checkpoint"), ("qwen3_5", "checkpoint"),
                                          ("qwen3_5", "deferred")])
@pytest.mark.parametrize("device", DEVICES)
def test_multi_turn_answers_equal_with_graph_prefill(tmp_path, fam, rollback, device):
    """Prefix reuse over a growing conversation: resumed turns (short prefills) graphed or eager, same answers.
    In fp32 on CUDA too: a tiny random model's logits sit close together, so bf16 rounding differences between
    the two kernel paths would flip near-ties that have nothing to do with the prefill logic under test."""
    model = _model(tmp_path, fam, 9, device, torch.float32)
    gen = torch.Generator().manual_seed(3)
    answers = {}
    for name, graph_max in (("eager", 0), ("graph", 64)):
        s = _session(model, rollback, graph_max)
        prefix = PrefixCache(s.cache, turn_ids=[1])
        convo: list[int] = torch.randint(2, 320, (80,), generator=torch.Generator().manual_seed(4)).tolist()
        got = []
        for turn in range(4):
            res = s.generate(convo + [1, 5, 6], max_tokens=12, policy=StrictGreedy(), prefix=prefix)
            got.append(res.token_ids)
            assert turn == 0 or 0 < len(convo) + 3 - prefix.last_reused <= 64    # a resumed, short prefill
            convo = convo + [1, 5, 6] + res.token_ids + torch.randint(2, 320, (15,), generator=gen).tolist()
        answers[name] = got
        gen = torch.Generator().manual_seed(3)
    assert answers["graph"] == answers["eager"]


def test_graph_prefill_stays_eager_where_it_cannot_run(tmp_path):
    """Near the end of the cache (padding would not fit), with a replay-strategy hybrid (no per-row state to drop
    padding rows from) and for a fresh prompt: the eager prefill, with the same result."""
    model = load_target(write_random_checkpoint(tmp_path / "q", tiny_config("qwen3_5"), seed=7),
                        dtype=torch.float32, device="cpu", max_positions=512)
    turn = torch.randint(0, 320, (8,), generator=torch.Generator().manual_seed(2))
    for rollback, history, max_len in (("checkpoint", 500, 509), ("replay", 30, 512), ("checkpoint", 0, 512)):
        hooks = ArchHooks()
        s = SpecSession.with_defaults(model, hooks, NGramProposer(), k=4, rollback=rollback, max_len=max_len,
                                      cuda_graphs=True)
        s.cache.reset()
        if history:
            s.hooks.prefill(model, s.cache, torch.randint(0, 320, (history,)), 512, ())
        static = s.hooks.static[5]
        before = static.tokens.clone()
        out = s.hooks.prefill(model, s.cache, turn, 512, ())
        assert torch.equal(static.tokens, before), rollback      # never replayed
        assert s.cache.length == history + 8 and out.logits.shape == (1, 320)


def test_setting_turns_the_graph_prefill_on(tiny_checkpoints, tmp_path):
    """Off on CPU (the base hooks), 128 on the GPU hooks; the `graph_prefill_max` setting reaches the hooks."""
    import shutil

    from edgespec.bench.shapes import write_chat_tokenizer
    from edgespec.config import load_settings
    from edgespec.engine import Engine
    from edgespec.plan import build_plan

    folder = shutil.copytree(tiny_checkpoints["llama"], tmp_path / "llama")
    write_chat_tokenizer(folder)
    base = load_settings(cli=None).with_overrides(model=str(folder), cpu_blas=False, device="cpu")
    assert Engine.load(build_plan(base)).hooks.graph_prefill_max == 0
    assert Engine.load(build_plan(base.with_overrides(graph_prefill_max=64))).hooks.graph_prefill_max == 64
    for arch in ("rtx", "thor"):          # what an engine on those hooks resolves, unset and set
        on = base.with_overrides(arch=arch)
        assert build_plan(on, torch.device("cpu")).session.graph_prefill_max == 128
        plan = build_plan(on.with_overrides(graph_prefill_max=0), torch.device("cpu"))
        assert plan.session.graph_prefill_max == 0 and plan.arch == arch
