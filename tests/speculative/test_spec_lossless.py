"""Losslessness gate: greedy speculative output equals plain greedy output with the same KV format.

Every proposer x arch hook set x rollback strategy x KV dtype, on tiny random models of each architecture and on
the demo model. An "oracle" proposer that knows the plain continuation but corrupts one token at a random
position forces partial accepts of every length, which a random model with an n-gram drafter rarely produces.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest
import torch

from edgespec.arch.detect import select_hooks
from edgespec.arch.rollback import ROLLBACK_STRATEGIES
from edgespec.cache.model_cache import state_equal
from edgespec.cache.state import StateMode
from edgespec.drafters.base import Draft, Proposer
from edgespec.drafters.ngram import NGramProposer
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession

CPU = torch.device("cpu")


class OracleProposer(Proposer):
    """Drafts the known plain continuation, with one token corrupted at a random position (or none)."""

    name = "oracle"
    default_k = 6

    def __init__(self, continuation: Sequence[int], vocab: int, seed: int = 0) -> None:
        self.continuation = list(continuation)
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.emitted = 0

    def begin(self, prompt_ids, prefill) -> None:
        self.emitted = 0

    def propose(self, last_token: int, k: int) -> Draft | None:
        future = self.continuation[self.emitted:self.emitted + k]
        if not future:
            return None
        bad = self.rng.randrange(len(future) + 1)     # == len: all correct
        if bad < len(future):
            future[bad] = (future[bad] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        return Draft(torch.tensor(future, dtype=torch.long))

    def commit(self, tokens, accepted, verify, drafted=0) -> None:
        self.emitted += len(tokens)


def _plain(model, prompt, n, kv_fp8, arch="base"):
    s = SpecSession.with_defaults(model, select_hooks(arch, CPU), None, kv_fp8=kv_fp8, max_len=256)
    return s.generate(prompt, max_tokens=n, policy=StrictGreedy()).token_ids


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(0, vocab, (12,), generator=g).tolist()
    return [motif * 4,                                                  # repetitive: n-gram drafts often
            torch.randint(0, vocab, (37,), generator=g).tolist(),        # random
            motif[:5] + torch.randint(0, vocab, (70,), generator=g).tolist()]  # > 64: chunked prefill


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv-model", "kv-fp8"])
def test_greedy_spec_equals_plain(tiny_models, family, kv_fp8):
    model = tiny_models[family]
    vocab = model.config.vocab_size
    for prompt, n in zip(_prompts(vocab), (40, 24, 33), strict=True):
        plain = _plain(model, prompt, n, kv_fp8)
        for arch, rollback, kind in itertools.product(("base", "rtx", "thor"), ROLLBACK_STRATEGIES,
                                                      ("ngram", "oracle")):
            proposer = NGramProposer() if kind == "ngram" else OracleProposer(plain, vocab, seed=n)
            session = SpecSession.with_defaults(model, select_hooks(arch, CPU), proposer, k=5, kv_fp8=kv_fp8,
                                                rollback=rollback, max_len=256)
            out = session.generate(prompt, max_tokens=n, policy=StrictGreedy())
            assert out.token_ids == plain, (arch, rollback, kind)
            if kind == "oracle":
                tel = out.telemetry
                assert 0 < tel.accepted_tokens < tel.draft_tokens      # partial accepts really happened


def test_rollback_state_equals_plain_replay(tiny_models):
    """After partial accepts, every cache and state equals plain decoding of the committed tokens; the checkpoint,
    replay and deferred strategies agree (checkpoint and deferred bit for bit: same steps, same inputs)."""
    model = tiny_models["qwen3_5"]
    prompt = _prompts(model.config.vocab_size)[1]
    plain_tokens = _plain(model, prompt, 30, False)
    caches = {}
    for rollback in ROLLBACK_STRATEGIES:
        session = SpecSession.with_defaults(model, select_hooks("base", CPU), OracleProposer(plain_tokens, 320,
                                            seed=3), k=6, rollback=rollback, max_len=256)
        out = session.generate(prompt, max_tokens=30, policy=StrictGreedy())
        assert out.token_ids == plain_tokens
        caches[rollback] = session.cache
    # Plain decoding of the same committed tokens: the cache holds prompt + all emitted but the last.
    ref = model.new_cache(256)
    model.prefill(torch.tensor(prompt), ref)
    for t in plain_tokens[:-1]:
        model.decode(torch.tensor([t]), ref)
    # fp32 rounding of a K+1-row forward vs single-row steps grows with depth through random layers (~2e-4 at
    # the last layer); a rollback to the wrong row would differ by O(1).
    for rollback, cache in caches.items():
        assert cache.length == ref.length, rollback
        assert state_equal(cache, ref, atol=1e-3), rollback
    assert state_equal(caches["checkpoint"], caches["replay"], atol=1e-3)
    assert state_equal(caches["checkpoint"], caches["deferred"], atol=0.0)


def test_rollback_to_any_row_restores_that_state(tiny_models):
    """Rolling back to any row of a checkpointed forward restores the state after that row (the state plain prefill
    of those rows reaches). A deferred forward leaves the GDN state untouched; committing any number of its rows
    gives exactly the state the checkpointed forward saved after that row."""
    model = tiny_models["qwen3_5"]
    ids = torch.randint(0, 320, (20,))
    rows = torch.randint(0, 320, (6,))
    for keep in range(0, 7):
        ckpt = model.new_cache(64, checkpoint_rows=6)
        model.prefill(ids, ckpt)
        out_ckpt = model.forward(rows, ckpt, mode=StateMode.CHECKPOINT, chunked=False)
        ckpt.rollback(20 + keep)
        ref = model.new_cache(64)
        model.prefill(torch.cat([ids, rows[:keep]]), ref)
        assert state_equal(ckpt, ref, atol=1e-3), keep
        deferred = model.new_cache(64, defer_rows=6)
        model.prefill(ids, deferred)
        before = [s.recurrent.clone() for s in deferred.state_layers]
        out_def = model.forward(rows, deferred, mode=StateMode.DEFER, chunked=False)
        assert all(torch.equal(b, s.recurrent) for b, s in zip(before, deferred.state_layers, strict=True))
        assert torch.equal(out_def.logits, out_ckpt.logits)
        with pytest.raises(ValueError, match="not committed"):
            model.forward(rows[:1], deferred)                     # the state is stale until the commit
        deferred.rollback(20 + keep)
        assert state_equal(deferred, ckpt, atol=0.0), keep
        assert state_equal(deferred, ref, atol=1e-3), keep


def test_deferred_forward_bad_input(tiny_models):
    """More rows than the cache keeps, or a mode that is not a StateMode, is refused by name."""
    model = tiny_models["qwen3_5"]
    cache = model.new_cache(64, defer_rows=3)
    model.prefill(torch.randint(0, 320, (8,)), cache)
    with pytest.raises(ValueError, match="exceeds the 3 rows kept"):
        model.forward(torch.randint(0, 320, (4,)), cache, mode=StateMode.DEFER, chunked=False)
    with pytest.raises(ValueError, match="mode 'defer' is not a StateMode"):
        model.forward(torch.randint(0, 320, (2,)), cache, mode="defer", chunked=False)
    with pytest.raises(ValueError, match="advance by 5"):
        cache.states.advance(5)


def test_demo_model_greedy_spec_equals_plain(demo_model_dir):
    from edgespec.loading.checkpoint import load_target
    from edgespec.loading.tokenizer import ChatTokenizer

    model = load_target(demo_model_dir, max_positions=512)
    tok = ChatTokenizer.from_folder(demo_model_dir)
    msgs = [{"role": "user", "content": "Repeat the following sentence three times exactly: The quick robot arm "
                                        "moves the blue box to the left shelf."}]
    prompt = tok.encode_chat(msgs)
    stop = tok.stop_token_ids
    for kv_fp8 in (False, True):
        plain = SpecSession.with_defaults(model, select_hooks("base", CPU), None, kv_fp8=kv_fp8, max_len=512).generate(
            prompt, max_tokens=48, policy=StrictGreedy(), stop_ids=stop)
        for arch in ("base", "thor"):
            spec = SpecSession.with_defaults(model, select_hooks(arch, CPU), NGramProposer(), k=6, kv_fp8=kv_fp8,
                                             max_len=512).generate(prompt, max_tokens=48, policy=StrictGreedy(),
                                             stop_ids=stop)
            assert spec.token_ids == plain.token_ids
            assert spec.telemetry.acceptance_length > 1.5     # repeated text: the n-gram drafter pays


def test_eos_stops_early(tiny_models):
    """Generation ends at a stop id (FlashRT always decodes max_tokens)."""
    model = tiny_models["llama"]
    prompt = _prompts(320)[1]
    plain = _plain(model, prompt, 30, False)
    stop = plain[10]
    first = plain.index(stop)
    session = SpecSession.with_defaults(model, select_hooks("base", CPU), OracleProposer(plain, 320), k=5, max_len=256)
    out = session.generate(prompt, max_tokens=30, policy=StrictGreedy(), stop_ids=[stop])
    assert out.finish_reason == "stop" and out.token_ids == plain[:first]


def test_bad_k_and_requests_rejected_before_work(tiny_models):
    from edgespec.errors import ConfigError, PromptTooLongError, RequestError

    model = tiny_models["llama"]
    with pytest.raises(ConfigError, match="num_draft_tokens 40"):
        SpecSession.with_defaults(model, select_hooks("base", CPU), NGramProposer(), k=40)
    with pytest.raises(ConfigError, match="rollback"):
        SpecSession.with_defaults(model, select_hooks("base", CPU), NGramProposer(), rollback="undo")
    s = SpecSession.with_defaults(model, select_hooks("base", CPU), NGramProposer(), k=4, max_len=32)
    with pytest.raises(PromptTooLongError):
        s.generate(list(range(40)), max_tokens=4, policy=StrictGreedy())
    with pytest.raises(RequestError, match="num_draft_tokens 9"):
        s.generate([1, 2, 3], max_tokens=4, policy=StrictGreedy(), k=9)
    with pytest.raises(RequestError, match="empty"):
        s.generate([], max_tokens=4, policy=StrictGreedy())
