"""A tree forward of the whole model equals each branch run as a chain, and committing one path leaves the cache
as the chain forward of that path does (llama, qwen3, the qwen3.5 hybrid; model-dtype and FP8 KV)."""

from __future__ import annotations

import pytest
import torch

from edgespec.cache.model_cache import state_equal
from edgespec.kernels.verify.tree import TreeMask

PARENTS = [-1, 0, 1, 2, 2, 1, 0, 6, 7, 0]


def _path(parents: list[int], row: int) -> list[int]:
    path = [row]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def check_tree_forward(model, prompt: torch.Tensor, rows: torch.Tensor, kv_fp8: bool, tol: float) -> None:
    """Tree forward of ``rows`` (tree PARENTS) after ``prompt`` == each branch as a chain; committing a non-first
    branch (K/V rows really move) leaves every cache and state as the chain of that path, and decoding goes on
    alike."""
    device = prompt.device

    def fresh():
        cache = model.new_cache(256, kv_fp8=kv_fp8, defer_rows=len(PARENTS))
        model.prefill(prompt, cache)
        return cache

    cache = fresh()
    out = model.forward(rows, cache, tree=TreeMask.from_parents(torch.tensor(PARENTS), device), chunked=False)
    for leaf in (3, 4, 5, 8, 9):
        path = _path(PARENTS, leaf)
        ref = model.forward(rows[path], fresh(), chunked=False)
        torch.testing.assert_close(out.logits[path], ref.logits, rtol=tol, atol=tol)
    path = _path(PARENTS, 8)
    cache.commit_path(path)
    ref_cache = fresh()
    model.forward(rows[path], ref_cache, chunked=False)
    assert cache.length == ref_cache.length == prompt.shape[0] + len(path)
    assert state_equal(cache, ref_cache, atol=10 * tol)
    token = torch.tensor([5], device=device)
    torch.testing.assert_close(model.decode(token, cache), model.decode(token, ref_cache), rtol=tol, atol=tol)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv-model", "kv-fp8"])
def test_tree_forward_equals_branch_chains(tiny_models, family, kv_fp8):
    g = torch.Generator().manual_seed(11)
    check_tree_forward(tiny_models[family], torch.randint(0, 320, (23,), generator=g),
                       torch.randint(0, 320, (len(PARENTS),), generator=g), kv_fp8, tol=1e-4)


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


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv-model", "kv-fp8"])
def test_tree_forward_cuda(tmp_path, family, kv_fp8):
    """On CUDA in fp32: the Triton tree attention (model-dtype and FP8 KV) and the GDN tree reference on the device.
    bf16 is left out: on an H200 3 of its 4 cases differed from the chain by more than 2% of the logits' norm (the
    tree runs other kernels than the chain); whether that is rounding alone is not settled yet."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from edgespec.bench.shapes import tiny_config, write_random_checkpoint
    from edgespec.loading.checkpoint import load_target

    model = load_target(write_random_checkpoint(tmp_path / "m", tiny_config(family, head_dim=64), seed=4),
                        device="cuda", max_positions=512)
    g = torch.Generator().manual_seed(11)
    check_tree_forward(model, torch.randint(0, 320, (40,), generator=g).cuda(),
                       torch.randint(0, 320, (len(PARENTS),), generator=g).cuda(), kv_fp8, tol=2e-4)
