"""A tree forward of the whole model equals each branch run as a chain, and committing one path leaves the cache
as the chain forward of that path does (llama, qwen3, the qwen3.5 hybrid; model-dtype and FP8 KV)."""

from __future__ import annotations

import pytest
import torch

from edgespec.cache.model_cache import state_equal
from edgespec.kernels.tree import TreeMask

PARENTS = [-1, 0, 1, 2, 2, 1, 0, 6, 7, 0]


def _path(parents: list[int], row: int) -> list[int]:
    path = [row]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv-model", "kv-fp8"])
def test_tree_forward_equals_branch_chains(tiny_models, family, kv_fp8):
    model = tiny_models[family]
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, vocab, (23,), generator=g)
    rows = torch.randint(0, vocab, (len(PARENTS),), generator=g)
    tree = TreeMask.from_parents(torch.tensor(PARENTS), "cpu")

    def fresh():
        cache = model.new_cache(128, kv_fp8=kv_fp8, defer_rows=len(PARENTS))
        model.prefill(prompt, cache)
        return cache

    cache = fresh()
    out = model.forward(rows, cache, tree=tree, chunked=False)
    for leaf in (3, 4, 5, 8, 9):
        path = _path(PARENTS, leaf)
        ref_cache = fresh()
        ref = model.forward(rows[path], ref_cache, chunked=False)
        torch.testing.assert_close(out.logits[path], ref.logits, rtol=1e-4, atol=1e-4)
    # Commit one path (a non-first branch, so K/V rows really move) and compare every cache and state.
    path = _path(PARENTS, 8)
    cache.commit_path(path)
    ref_cache = fresh()
    model.forward(rows[path], ref_cache, chunked=False)
    assert cache.length == ref_cache.length == 23 + len(path)
    assert state_equal(cache, ref_cache, atol=1e-4)
    # The cache goes on as usual: a decode after the commit equals a decode after the chain.
    a = model.decode(torch.tensor([5]), cache)
    b = model.decode(torch.tensor([5]), ref_cache)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_tree_forward_must_be_committed(tiny_models):
    model = tiny_models["qwen3_5"]
    cache = model.new_cache(64, defer_rows=4)
    model.prefill(torch.tensor([1, 2, 3]), cache)
    model.forward(torch.tensor([4, 5, 6]), cache, tree=TreeMask.from_parents(torch.tensor([-1, 0, 0]), "cpu"))
    with pytest.raises(ValueError, match="commit_path first"):
        model.decode(torch.tensor([1]), cache)
    with pytest.raises(ValueError, match="starts at row 0"):
        cache.commit_path([0, 2, 1])
    cache.commit_path([0, 2])
    assert cache.length == 5
    with pytest.raises(ValueError, match="without a tree forward"):
        cache.commit_path([0])
