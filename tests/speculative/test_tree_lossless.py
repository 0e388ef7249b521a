"""Losslessness gate of tree verification: greedy output with ``draft_tree`` equals plain greedy output, for llama,
qwen3 and the qwen3.5 hybrid x (n-gram, DFlash) x KV formats, exactly, in fp32.

Random targets accept almost nothing from a real drafter, so a wrapper runs the real drafter's tree every cycle
(its window, its branches) but hands the session a tree whose branches are the known plain continuation, a corrupted
copy of it weighted above it (so the right path is often a non-first sibling) and a cut of it: accepts of every depth
and through siblings really happen, and the telemetry says so.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from test_dflash import drafters, prompt_ids  # noqa: F401  (module fixture)
from test_spec_lossless import OracleProposer, _plain, _prompts

from edgespec.arch.detect import select_hooks
from edgespec.drafters.base import Draft, Proposer
from edgespec.drafters.dflash import load_dflash_checkpoint
from edgespec.drafters.mtp import MTPProposer
from edgespec.drafters.ngram import NGramProposer
from edgespec.drafters.tree import Branch, DraftTree, tree_from_branches
from edgespec.errors import ConfigError
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession

CPU = torch.device("cpu")


class OracleTree(Proposer):
    """Runs ``inner.propose_tree`` every cycle, then proposes branches of the plain continuation (see module doc)."""

    def __init__(self, inner: Proposer, continuation: Sequence[int], vocab: int, seed: int = 0) -> None:
        self.inner, self.continuation, self.vocab = inner, list(continuation), vocab
        self.name, self.taps, self.default_k, self.max_k = inner.name, inner.taps, inner.default_k, inner.max_k
        self.rng = random.Random(seed)
        self.emitted = 0
        self.trees = 0

    def begin(self, prompt_ids, prefill) -> None:
        self.inner.begin(prompt_ids, prefill)
        self.emitted = 0

    def propose(self, last_token: int, k: int) -> Draft | None:
        raise AssertionError("a tree session asks for trees")

    def propose_tree(self, last_token: int, k: int, budget: int, chain_first: bool = False) -> DraftTree | None:
        real = self.inner.propose_tree(last_token, k, budget, chain_first)
        if real is not None:
            assert real.size <= budget and real.max_depth <= k
            self.trees += 1
        future = self.continuation[self.emitted:self.emitted + k]
        if not future:
            return None
        wrong = list(future)
        bad = self.rng.randrange(len(future))
        wrong[bad] = (wrong[bad] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        cut = future[:self.rng.randrange(1, len(future) + 1)]
        right = Branch(tuple(cut), 1.0)
        branches = [Branch(tuple(wrong), 2.0), right] if self.rng.random() < 0.7 else [right, Branch(tuple(wrong))]
        return tree_from_branches(branches, budget)

    def commit(self, tokens, accepted, verify, drafted=0) -> None:
        self.inner.commit(tokens, accepted, verify, drafted)
        self.emitted += len(tokens)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv-model", "kv-fp8"])
def test_greedy_tree_equals_plain_ngram(tiny_models, family, kv_fp8):
    model = tiny_models[family]
    vocab = model.config.vocab_size
    for prompt, n in zip(_prompts(vocab)[:2], (40, 24), strict=True):
        plain = _plain(model, prompt, n, kv_fp8)
        for arch in ("base", "thor"):
            oracle = OracleTree(NGramProposer(), plain, vocab, seed=n)
            session = SpecSession.with_defaults(model, select_hooks(arch, CPU), oracle, k=6, kv_fp8=kv_fp8,
                                                max_len=256, draft_tree=8)
            out = session.generate(prompt, max_tokens=n, policy=StrictGreedy())
            assert out.token_ids == plain, arch
            tel = out.telemetry
            assert tel.tree_cycles > 0 and tel.tree_sibling_accepts > 0 and 0 < tel.accepted_tokens
        # The real n-gram trees alone (nearly all rejected on a random target), once per prompt.
        session = SpecSession.with_defaults(model, select_hooks("base", CPU), NGramProposer(), k=6, kv_fp8=kv_fp8,
                                            max_len=256, draft_tree=8)
        out = session.generate(prompt, max_tokens=n, policy=StrictGreedy())
        assert out.token_ids == plain


class ChainsOrTrees(OracleTree):
    """:class:`OracleTree` that also drafts chains: the known plain continuation, one token corrupted or none."""

    def propose(self, last_token: int, k: int) -> Draft | None:
        return self.inner.propose(last_token, k)


def test_tree_session_switched_to_its_chains_between_requests(tiny_models):
    """``bench prompts`` runs a tree session's drafter as chains by setting ``cycles`` to ``cycles.chain`` between
    requests: those requests verify chains (no tree cycle), the next tree request real trees again, all lossless."""
    model = tiny_models["qwen3_5"]
    vocab = model.config.vocab_size
    prompt = _prompts(vocab)[1]
    plain = _plain(model, prompt, 32, False)
    proposer = ChainsOrTrees(OracleProposer(plain, vocab, seed=2), plain, vocab, seed=3)
    session = SpecSession.with_defaults(model, select_hooks("base", CPU), proposer, k=6, max_len=256, draft_tree=8)
    trees = session.cycles
    assert trees.label == "tree8" and trees.chain.label == "chain" and trees.chain.chain is trees.chain
    for cycles, tree_run in ((trees.chain, False), (trees, True), (trees.chain, False)):
        session.cycles = cycles
        out = session.generate(prompt, max_tokens=32, policy=StrictGreedy())
        tel = out.telemetry
        assert out.token_ids == plain, tree_run
        assert tel.accepted_tokens > 0 and (tel.tree_nodes > tel.tree_cycles > 0) == tree_run, tree_run


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv-model", "kv-fp8"])
def test_greedy_tree_equals_plain_dflash(tiny_models, drafters, family, kv_fp8):  # noqa: F811
    model = tiny_models[family]
    vocab = model.config.vocab_size
    prompt = prompt_ids(vocab, n=21, seed=3 if family == "qwen3" else 5)
    n = 18
    plain = _plain(model, prompt, n, kv_fp8)
    for arch in ("base", "thor"):
        graphs = select_hooks(arch, CPU).defaults.cuda_graphs
        prop = load_dflash_checkpoint(drafters[family], model, window_size=8, cuda_graphs=graphs)
        oracle = OracleTree(prop, plain, vocab, seed=len(arch))
        session = SpecSession.with_defaults(model, select_hooks(arch, CPU), oracle, kv_fp8=kv_fp8, max_len=128,
                                            draft_tree=12)
        out = session.generate(prompt, max_tokens=n, policy=StrictGreedy())
        assert out.token_ids == plain, arch
        assert out.telemetry.tree_sibling_accepts > 0 and oracle.trees > 0
        assert prop.window.end == session.cache.length           # the window was fed the accepted paths
        prop = load_dflash_checkpoint(drafters[family], model, window_size=8, cuda_graphs=graphs)
        session = SpecSession.with_defaults(model, select_hooks(arch, CPU), prop, kv_fp8=kv_fp8, max_len=128,
                                            draft_tree=12)
        out = session.generate(prompt, max_tokens=n, policy=StrictGreedy())
        assert out.token_ids == plain, arch
        assert out.telemetry.tree_nodes > out.telemetry.tree_cycles      # real trees, wider than one node


@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv-model", "kv-fp8"])
def test_greedy_tree_equals_plain_mtp(tiny_models, kv_fp8):
    """The hybrid's own MTP head: its chain with next-best leaves beside it, and the oracle's trees over it."""
    model = tiny_models["qwen3_5"]
    prompt = _prompts(320)[1]
    plain = _plain(model, prompt, 24, kv_fp8)
    for proposer in (MTPProposer(model, max_len=256), OracleTree(MTPProposer(model, max_len=256), plain, 320)):
        session = SpecSession.with_defaults(model, select_hooks("base", CPU), proposer, k=4, kv_fp8=kv_fp8,
                                            max_len=256, draft_tree=10)
        out = session.generate(prompt, max_tokens=24, policy=StrictGreedy())
        assert out.token_ids == plain
        assert out.telemetry.tree_nodes > out.telemetry.tree_cycles


def test_trees_sized_down_to_their_chain_verify_as_chains(tiny_models, drafters):  # noqa: F811
    """Rows dearer than any node's chance: every DFlash tree is its chain, verified by the chain's forward (never
    the tree forward), and the output is still plain decoding's."""
    from edgespec.speculative.tree_cost import LineCost

    model = tiny_models["qwen3_5"]
    prompt = prompt_ids(model.config.vocab_size, n=21, seed=5)
    plain = _plain(model, prompt, 18, False)
    prop = load_dflash_checkpoint(drafters["qwen3_5"], model, window_size=8)
    session = SpecSession.with_defaults(model, select_hooks("base", CPU), prop, max_len=128, draft_tree="auto")
    session.cycles.cost = LineCost(prior=1.0, min_cycles=10**9)
    tree_forwards = []
    verify_tree = session.rollback.verify_tree
    session.rollback.verify_tree = lambda *a, **kw: tree_forwards.append(1) or verify_tree(*a, **kw)
    out = session.generate(prompt, max_tokens=18, policy=StrictGreedy())
    assert out.token_ids == plain
    assert out.telemetry.tree_cycles > 0 and not tree_forwards
    assert out.telemetry.tree_nodes == out.telemetry.draft_tokens     # chains: every node drafted once


@pytest.mark.parametrize("setting, match", [
    (0, "must be a whole number >= 1"),
    (64, "above the largest tree forward"),
    ("wide", "must be off, auto or a node budget"),
])
def test_bad_draft_tree_refused_by_name(tiny_models, setting, match):
    with pytest.raises(ConfigError, match=match):
        SpecSession.with_defaults(tiny_models["qwen3"], select_hooks("base", CPU), NGramProposer(), max_len=64,
                                  draft_tree=setting)


def test_tree_needs_the_deferred_rollback(tiny_models):
    with pytest.raises(ConfigError, match="draft_tree needs rollback 'deferred'"):
        SpecSession.with_defaults(tiny_models["qwen3_5"], select_hooks("base", CPU), NGramProposer(), max_len=64,
                    rollback="checkpoint", draft_tree=8)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv-model", "kv-fp8"])
def test_greedy_tree_equals_plain_cuda(tmp_path, kv_fp8):
    """The hybrid on CUDA in fp32 with the GPU hooks (graph-captured decode, chain verify and tree verify + commit,
    edgespec.arch.tree_graphs): greedy tree output equals plain output, through sibling accepts."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from edgespec.bench.shapes import tiny_config, write_random_checkpoint
    from edgespec.loading.checkpoint import load_target

    model = load_target(write_random_checkpoint(tmp_path / "m", tiny_config("qwen3_5", head_dim=64), seed=4),
                        device="cuda", max_positions=512)
    dev = torch.device("cuda")
    prompt = _prompts(320)[0]
    plain = SpecSession.with_defaults(model, select_hooks("rtx", dev), None, kv_fp8=kv_fp8, max_len=256).generate(
        prompt, max_tokens=40, policy=StrictGreedy()).token_ids
    oracle = OracleTree(NGramProposer(), plain, 320, seed=1)
    session = SpecSession.with_defaults(model, select_hooks("rtx", dev), oracle, k=6, kv_fp8=kv_fp8, max_len=256,
                                        draft_tree=8)
    assert sorted(session.hooks.static_trees) == [17]
    assert all(s.verify_graph is not None and s.commit_graph is not None for s in session.hooks.static_trees.values())
    out = session.generate(prompt, max_tokens=40, policy=StrictGreedy())
    assert out.token_ids == plain
    assert out.telemetry.tree_sibling_accepts > 0
