"""The captured tree verify (edgespec.arch.tree_graphs): its graph-mode code run eagerly on the CPU equals the eager
tree verify and commit (llama, qwen3, the qwen3.5 hybrid; model-dtype and FP8 KV), its device verdict equals the host
greedy rule, sessions through it equal plain decoding and leave the cache as a plain prefill of what they emitted
(rollback == replay), greedy and sampled; bad budgets, trees and paths are refused by name. On CUDA the captured
graphs equal the same code run eagerly."""

from __future__ import annotations

import random

import pytest
import torch
from test_spec_lossless import _plain, _prompts
from test_tree_lossless import OracleTree

from edgespec.arch.detect import select_hooks
from edgespec.arch.tree_graphs import TREE_GRAPH_BUDGETS, StaticTreeForward, graph_budget, graph_budgets
from edgespec.cache.kv import KVCache
from edgespec.cache.model_cache import state_equal
from edgespec.drafters.ngram import NGramProposer
from edgespec.drafters.tree import DraftTree
from edgespec.errors import ConfigError
from edgespec.kernels.verify.tree import TreeMask
from edgespec.kernels.verify.tree_verdict import greedy_tree_verdict
from edgespec.speculative.acceptance import RejectionSampling, StrictGreedy
from edgespec.speculative.sampling import SamplingParams
from edgespec.speculative.session import SpecSession
from edgespec.speculative.tree_accept import greedy_tree_accept

CPU = torch.device("cpu")


def sibling_tree(model, prompt: torch.Tensor, wrong: int) -> tuple[torch.Tensor, DraftTree]:
    """Rows (root first) and the tree of a verify after ``prompt`` whose greedy path goes through non-first
    siblings: the plain continuation c1 c2 c3, each right token after a wrong sibling, then a wrong leaf."""
    cache = model.new_cache(256)
    logits = model.prefill(prompt, cache).logits[-1]
    cont = []
    for _ in range(4):
        cont.append(int(logits.argmax()))
        logits = model.decode(torch.tensor([cont[-1]], device=prompt.device), cache)
    root = cont[0]
    c1, c2, c3 = cont[1:]
    bad = [(c + wrong) % model.config.vocab_size for c in (c1, c2, c3)]
    # node: token, parent (-1 = root); pre-order
    nodes = [(bad[0], -1), (c1, -1), (bad[1], 1), (c2, 1), (c3, 3), (bad[2], 4), (bad[2], 3)]
    tokens = torch.tensor([t for t, _ in nodes])
    parents = torch.tensor([p for _, p in nodes])
    depths = []
    for _, p in nodes:
        depths.append(1 if p < 0 else depths[p] + 1)
    tree = DraftTree(tokens, parents, torch.tensor(depths), torch.ones(len(nodes)))
    return torch.cat([torch.tensor([root]), tokens]).to(prompt.device), tree


def _prefilled(model, prompt: torch.Tensor, kv_fp8: bool, rows: int):
    cache = model.new_cache(256, kv_fp8=kv_fp8, defer_rows=rows)
    model.prefill(prompt, cache)
    return cache


def check_static_equals_eager(model, prompt: torch.Tensor, kv_fp8: bool, capture: bool, tol: float) -> None:
    """The static tree verify (padded to 17 rows) and its greedy commit == the eager tree forward, the host rule and
    ``commit_path``; a host-chosen path through ``commit_rows`` == ``commit_path`` of it."""
    rows, tree = sibling_tree(model, prompt, wrong=7)
    n = rows.shape[0]
    eager_cache = _prefilled(model, prompt, kv_fp8, 17)
    eager = model.forward(rows, eager_cache, chunked=False,
                          tree=TreeMask.from_parents(tree.row_parents(), prompt.device))
    want = greedy_tree_accept(eager.logits, tree)
    assert want.rows == [0, 2, 4, 5] and want.sibling          # through siblings, K/V rows really move
    eager_cache.commit_path(want.rows)

    static_cache = _prefilled(model, prompt, kv_fp8, 17)
    # Paths of at most 5 rows (a session drafting 4 per cycle): the commit moves and advances 5 rows, not 17.
    static = StaticTreeForward(model, static_cache, 16, (), capture=capture, max_path=5)
    static_cache.reset()
    model.prefill(prompt, static_cache)
    step = static.verify(rows, tree.row_parents())
    torch.testing.assert_close(step.logits, eager.logits, rtol=tol, atol=tol)
    torch.testing.assert_close(step.hidden, eager.hidden, rtol=tol, atol=tol)
    path, next_token = static.commit_greedy()
    assert (path, next_token) == (want.rows, want.tokens[-1])
    assert static_cache.length == eager_cache.length == prompt.shape[0] + len(path)
    assert state_equal(static_cache, eager_cache, atol=10 * tol)
    torch.testing.assert_close(static.kept(len(path)).hidden, eager.hidden[path], rtol=tol, atol=tol)
    token = torch.tensor([5], device=prompt.device)
    torch.testing.assert_close(model.decode(token, static_cache), model.decode(token, eager_cache),
                               rtol=tol, atol=tol)

    # A path chosen on the host (sampling): the same commit graph keeps it.
    other = [0, 2, 3]
    eager_cache = _prefilled(model, prompt, kv_fp8, 17)
    model.forward(rows, eager_cache, chunked=False, tree=TreeMask.from_parents(tree.row_parents(), prompt.device))
    eager_cache.commit_path(other)
    static_cache.reset()
    model.prefill(prompt, static_cache)
    static.verify(rows, tree.row_parents())
    static.commit_rows(other)
    assert static_cache.length == eager_cache.length and n > len(other)
    assert state_equal(static_cache, eager_cache, atol=10 * tol)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv-model", "kv-fp8"])
def test_static_tree_verify_equals_eager(tiny_models, family, kv_fp8):
    g = torch.Generator().manual_seed(3)
    check_static_equals_eager(tiny_models[family], torch.randint(0, 320, (23,), generator=g), kv_fp8,
                              capture=True, tol=1e-4)     # capture=True: no CUDA, so the same code runs eagerly


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    """A random pre-order tree of ``n`` nodes with distinct sibling tokens."""
    parents, depths, tokens = [], [], []
    for i in range(n):
        p = rng.randrange(-1, i)
        taken = {tokens[j] for j in range(i) if parents[j] == p}
        t = rng.choice([x for x in range(vocab) if x not in taken])
        parents.append(p)
        depths.append(1 if p < 0 else depths[p] + 1)
        tokens.append(t)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.ones(n))


def test_device_verdict_equals_the_host_rule():
    """Random trees, padded to the captured rows, with logits whose argmax often continues some branch (so paths of
    every depth are accepted): the device verdict's path and next token are the host rule's."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    depths_seen = set()
    for trial in range(200):
        vocab, n = 6, rng.randrange(1, 17)
        tree = random_tree(rng, n, vocab)
        P = graph_budget(n) + 1
        logits = torch.randn(P, vocab, generator=g)
        kids = tree.children()
        for row in range(n + 1):           # steer most rows' argmax to one of their children
            if kids[row] and rng.random() < 0.8:
                logits[row, int(tree.tokens[rng.choice(kids[row]) - 1])] += 10.0
        logits[n + 1:, int(tree.tokens[0])] += 20.0     # padding rows: their argmax must not matter
        want = greedy_tree_accept(logits[:n + 1], tree)
        padded = tree.row_parents().tolist() + [0] * (P - n - 1)
        mask = TreeMask.from_parents(torch.tensor(padded), CPU)
        tokens = torch.cat([torch.tensor([0]), tree.tokens, torch.full((P - n - 1,), int(tree.tokens[0]))])
        out = greedy_tree_verdict(logits, tokens, mask.parents, mask.depths, mask.ancestors,
                                  torch.tensor([n + 1])).tolist()
        assert out[0] == want.accepted and out[1] == want.tokens[-1], trial
        assert out[2:3 + out[0]] == want.rows, trial
        assert out[3 + out[0]:] == list(range(out[0] + 1, P)), trial      # past the path: rows stay put
        depths_seen.add(want.accepted)
    assert len(depths_seen) >= 4


def test_device_verdict_refuses_bad_shapes():
    mask = TreeMask.from_parents(torch.tensor([-1, 0, 0]), CPU)
    logits, tokens, real = torch.randn(3, 5), torch.tensor([1, 2, 3]), torch.tensor([3])
    with pytest.raises(ValueError, match="tokens must have shape"):
        greedy_tree_verdict(logits, tokens[:2], mask.parents, mask.depths, mask.ancestors, real)
    with pytest.raises(ValueError, match="ancestors must be bool"):
        greedy_tree_verdict(logits, tokens, mask.parents, mask.depths, mask.ancestors.long(), real)
    with pytest.raises(ValueError, match="out must be int64"):
        greedy_tree_verdict(logits, tokens, mask.parents, mask.depths, mask.ancestors, real,
                            out=torch.zeros(4, dtype=torch.long))


def test_graph_budgets_pad_up_and_refuse_above_the_set():
    assert graph_budget(1) == graph_budget(16) == 16 and graph_budget(17) == 32 and graph_budget(63) == 63
    assert graph_budgets(20) == (16, 32)
    with pytest.raises(ConfigError, match="above the captured tree forwards"):
        graph_budget(TREE_GRAPH_BUDGETS[-1] + 1)


def test_static_tree_refuses_bad_trees_and_paths(tiny_models):
    model = tiny_models["qwen3_5"]
    cache = model.new_cache(64, defer_rows=17)
    static = StaticTreeForward(model, cache, 16, (), capture=False)
    cache.reset()
    model.prefill(torch.tensor([1, 2, 3]), cache)
    with pytest.raises(ValueError, match="does not fit the captured 17-row tree forward"):
        static.verify(torch.zeros(18, dtype=torch.long), torch.arange(-1, 17))
    with pytest.raises(ValueError, match="parents of shape"):
        static.verify(torch.zeros(3, dtype=torch.long), torch.tensor([-1, 0]))
    short = StaticTreeForward(model, cache, 16, (), capture=False, max_path=3)
    cache.reset()
    model.prefill(torch.tensor([1, 2, 3]), cache)
    with pytest.raises(ValueError, match="paths longer than the 3 rows this tree forward commits"):
        short.verify(torch.zeros(4, dtype=torch.long), torch.tensor([-1, 0, 1, 2]))
    with pytest.raises(ValueError, match="without a tree verify"):
        static.commit_greedy()
    static.verify(torch.tensor([4, 5, 6]), torch.tensor([-1, 0, 0]))
    with pytest.raises(ValueError, match="commit_path first"):
        model.decode(torch.tensor([1]), cache)
    for bad in ([1], [0, 1, 2], [0, 3]):          # not from the root; 2 is 1's sibling; 3 is padding
        with pytest.raises(ValueError, match="is not a path of the verified tree"):
            static.commit_rows(bad)
    static.commit_rows([0, 2])
    assert cache.length == 5
    with pytest.raises(ValueError, match="settle_tree at 5"):
        cache.settle_tree(5, 1)


class _Counting(StaticTreeForward):
    """Counts the verifies and the accepted paths that went through the static tree verify."""

    verifies = 0
    deep = 0
    sampled_deep = 0

    def verify(self, tokens, parents):
        type(self).verifies += 1
        return super().verify(tokens, parents)

    def commit_greedy(self):
        rows, token = super().commit_greedy()
        type(self).deep += len(rows) > 2
        return rows, token

    def commit_rows(self, rows):
        type(self).sampled_deep += len(rows) > 2
        return super().commit_rows(rows)


@pytest.fixture
def counting(monkeypatch):
    import edgespec.arch.base as base

    monkeypatch.setattr(base, "StaticTreeForward", _Counting)
    _Counting.verifies = _Counting.deep = _Counting.sampled_deep = 0
    return _Counting


def _replayed(model, session: SpecSession, prompt: list[int], out: list[int], kv_fp8: bool):
    """A plain prefill of what ``session``'s cache should hold: the prompt and the emitted tokens in it. Compared at
    1e-3 (values of order 1-5): fp32 rounding of other kernels reached 1.1e-4 in the last GDN layer's conv state; a
    wrong row kept differs by the values themselves."""
    n = session.cache.length
    ref = model.new_cache(256, kv_fp8=kv_fp8)
    model.prefill(torch.tensor((list(prompt) + out)[:n]), ref, chunk=16)
    return ref


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_session_through_the_static_tree_equals_plain(tiny_models, counting, family):
    """Greedy through the static tree verify (the GPU hooks on CPU: graphs on, run eagerly) == plain decoding, with
    deep and sibling accepts, and the cache ends as a plain prefill of the output (rollback == replay)."""
    model = tiny_models[family]
    prompt = _prompts(320)[1]
    plain = _plain(model, prompt, 30, False)
    session = SpecSession.with_defaults(model, select_hooks("rtx", CPU), OracleTree(NGramProposer(), plain, 320),
                                        k=6, max_len=256, draft_tree=20)
    assert sorted(session.hooks.static_trees) == [17, 33]          # budget 20: graphs for 16 and 32 nodes
    out = session.generate(prompt, max_tokens=30, policy=StrictGreedy())
    assert out.token_ids == plain
    assert counting.verifies > 0 and counting.deep > 0 and out.telemetry.tree_sibling_accepts > 0
    assert state_equal(session.cache, _replayed(model, session, prompt, out.token_ids, False), atol=1e-3)


def caches_close(a, b, fp8: bool) -> bool:
    """``state_equal`` at 1e-3 (see :func:`_replayed`); an FP8 cache's K/V compared dequantised within one e4m3 step
    (2^-3 of the value): the same row computed by two forwards of other shapes may round to the neighbouring code."""
    if not fp8:
        return state_equal(a, b, atol=1e-3)
    if a.length != b.length:
        return False
    for x, y in zip(a.layers, b.layers, strict=True):
        if isinstance(x, KVCache):
            pairs = list(zip(x.read(a.length), y.read(b.length), strict=True))
            ok = all(torch.allclose(p.float(), q.float(), rtol=0.13, atol=1e-3) for p, q in pairs)
        else:
            # The GDN states downstream of a neighbouring FP8 code move by its share of the attention output.
            ok = torch.allclose(x.conv, y.conv, atol=2e-2) and torch.allclose(x.recurrent, y.recurrent, atol=2e-2)
        if not ok:
            return False
    return True


@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv-model", "kv-fp8"])
def test_sampled_session_through_the_static_tree_keeps_its_cache_exact(tiny_models, counting, kv_fp8):
    """Sampling picks the path on the host and the static commit keeps it (``commit_rows``): the cache still ends as
    a plain prefill of the sampled output. With ``top_k=1`` the sampler's target is one-hot on the argmax, so the
    oracle's branches (the greedy continuation) are accepted through the tree, deep and through siblings, and the
    output is plain greedy decoding's."""
    model = tiny_models["qwen3_5"]
    prompt = _prompts(320)[1]
    plain = _plain(model, prompt, 30, kv_fp8)
    session = SpecSession.with_defaults(model, select_hooks("rtx", CPU), OracleTree(NGramProposer(), plain, 320),
                                        k=6, max_len=256, kv_fp8=kv_fp8, draft_tree=12)
    policy = RejectionSampling(SamplingParams(temperature=1.0, top_k=1), torch.Generator().manual_seed(4))
    out = session.generate(prompt, max_tokens=30, policy=policy)
    assert out.token_ids == plain
    assert counting.sampled_deep > 0 and out.telemetry.tree_sibling_accepts > 0
    assert caches_close(session.cache, _replayed(model, session, prompt, out.token_ids, kv_fp8), kv_fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv-model", "kv-fp8"])
def test_captured_tree_verify_equals_eager_cuda(tmp_path, family, kv_fp8):
    """On CUDA in fp32: the captured verify and commit graphs == the eager tree forward, host rule and commit."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from edgespec.bench.shapes import tiny_config, write_random_checkpoint
    from edgespec.loading.checkpoint import load_target

    model = load_target(write_random_checkpoint(tmp_path / "m", tiny_config(family, head_dim=64), seed=4),
                        device="cuda", max_positions=512)
    g = torch.Generator().manual_seed(3)
    check_static_equals_eager(model, torch.randint(0, 320, (40,), generator=g).cuda(), kv_fp8, capture=True,
                              tol=2e-4)
