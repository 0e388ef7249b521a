"""Tree verification kernels (edgespec.kernels.verify.tree) against their oracle: each root-to-leaf branch run as its
own chain through the chain kernels, from the same committed state."""

from __future__ import annotations

import pytest
import torch

from edgespec.cache.kv import KVCache
from edgespec.kernels.attention.attention import attention_ref
from edgespec.kernels.recurrent.conv import causal_conv1d_ref
from edgespec.kernels.recurrent.gdn import gdn_recurrent_ref
from edgespec.kernels.verify.tree import (
    MAX_TREE_ROWS,
    TreeMask,
    gdn_tree_ref,
    tree_attention,
    tree_attention_at,
    tree_attention_ref,
    tree_conv_ref,
)

# Row parents of a tree in pre-order: root 0; 1 -> (2 -> (3, 4), 5); 6 -> 7 -> 8; 9 (a leaf at depth 1).
PARENTS = [-1, 0, 1, 2, 2, 1, 0, 6, 7, 0]


def _branches(parents: list[int]) -> list[list[int]]:
    """Every root-to-leaf path of rows."""
    kids = {p for p in parents if p >= 0}
    out = []
    for leaf in range(len(parents)):
        if leaf in kids:
            continue
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        out.append(path[::-1])
    return out


def test_tree_mask_structure():
    tree = TreeMask.from_parents(torch.tensor(PARENTS), "cpu")
    assert tree.depths.tolist() == [0, 1, 2, 3, 3, 2, 1, 2, 3, 1]
    assert tree.ancestors[4].nonzero().view(-1).tolist() == [0, 1, 2, 4]
    assert [int(b) for b in tree.bits[:3]] == [1, 0b11, 0b111]
    # Row 63's mask sets the sign bit of its int64 and still reads back as its 64 bits.
    chain = TreeMask.from_parents(torch.arange(-1, MAX_TREE_ROWS - 1), "cpu")
    assert int(chain.bits[-1]) == -1


@pytest.mark.parametrize("parents, why", [
    ([0, -1], "row 0 as the only root"),
    ([-1, 0, 3, 1], "parent before its child"),
    ([-1, -1], "only root"),
    (list(range(-1, MAX_TREE_ROWS)), "at most 64 rows"),
])
def test_tree_mask_refuses_bad_parents(parents, why):
    with pytest.raises(ValueError, match=why):
        TreeMask.from_parents(torch.tensor(parents), "cpu")


def test_gdn_tree_equals_each_branch_as_a_chain():
    torch.manual_seed(1)
    T, Hk, Hv, dk, dv = len(PARENTS), 2, 4, 16, 8
    q, k = torch.randn(T, Hk, dk), torch.randn(T, Hk, dk)
    v = torch.randn(T, Hv, dv)
    g = -torch.rand(T, Hv) * 0.5
    beta = torch.rand(T, Hv)
    state = torch.randn(Hv, dk, dv)
    before = state.clone()
    tree = TreeMask.from_parents(torch.tensor(PARENTS), "cpu")
    out = gdn_tree_ref(q, k, v, g, beta, state, tree.ancestors)
    assert torch.equal(state, before)                       # the committed state is read, never written
    covered = set()
    for path in _branches(PARENTS):
        idx = torch.tensor(path)
        chain = gdn_recurrent_ref(q[idx], k[idx], v[idx], g[idx], beta[idx], before.clone())
        torch.testing.assert_close(out[idx], chain, rtol=1e-5, atol=1e-5)
        covered.update(path)
    assert covered == set(range(T))


def test_tree_conv_equals_each_branch_as_a_chain():
    torch.manual_seed(2)
    T, C, K = len(PARENTS), 12, 4
    x = torch.randn(T, C)
    state = torch.randn(C, K - 1)
    before = state.clone()
    weight = torch.randn(C, K)
    tree = TreeMask.from_parents(torch.tensor(PARENTS), "cpu")
    out = tree_conv_ref(x, state, weight, tree)
    assert torch.equal(state, before)
    for path in _branches(PARENTS):
        idx = torch.tensor(path)
        chain = causal_conv1d_ref(x[idx], before.clone(), weight)
        torch.testing.assert_close(out[idx], chain, rtol=1e-6, atol=1e-6)


def _branch_attention(q, k_new, v_new, k_pre, v_pre, path, scale):
    """A branch as a chain: its rows' keys placed right after the prefix, causal attention."""
    idx = torch.tensor(path)
    k = torch.cat([k_pre, k_new[idx]])
    v = torch.cat([v_pre, v_new[idx]])
    return attention_ref(q[idx], k, v, k_pre.shape[0], scale)


def test_tree_attention_ref_equals_each_branch_as_a_chain():
    torch.manual_seed(3)
    start, T, Hq, Hkv, hd = 11, len(PARENTS), 4, 2, 16
    q = torch.randn(T, Hq, hd)
    k_pre, v_pre = torch.randn(start, Hkv, hd), torch.randn(start, Hkv, hd)
    k_new, v_new = torch.randn(T, Hkv, hd), torch.randn(T, Hkv, hd)
    tree = TreeMask.from_parents(torch.tensor(PARENTS), "cpu")
    out = tree_attention_ref(q, torch.cat([k_pre, k_new]), torch.cat([v_pre, v_new]), start, hd ** -0.5,
                             tree.ancestors)
    for path in _branches(PARENTS):
        ref = _branch_attention(q, k_new, v_new, k_pre, v_pre, path, hd ** -0.5)
        torch.testing.assert_close(out[torch.tensor(path)], ref, rtol=1e-5, atol=1e-5)


def test_tree_attention_at_a_device_start_equals_the_reference():
    """The captured verify's form (start as a tensor, the whole cache read, rows past the tree holding stale values)
    equals the reference over the prefix and the tree rows."""
    torch.manual_seed(4)
    start, T, Hq, Hkv, hd, L = 11, len(PARENTS), 4, 2, 16, 40
    q = torch.randn(T, Hq, hd)
    k, v = torch.randn(L, Hkv, hd), torch.randn(L, Hkv, hd)
    tree = TreeMask.from_parents(torch.tensor(PARENTS), "cpu")
    ref = tree_attention_ref(q, k, v, start, hd ** -0.5, tree.ancestors)
    out = tree_attention_at(q, k, v, torch.tensor([start]), hd ** -0.5, tree.ancestors)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_kv_move_rows_keeps_bytes_and_scales():
    """Moving rows (the commit of an accepted path) copies stored bytes and scales exactly, also when the source and
    destination ranges overlap, for every V layout."""
    torch.manual_seed(4)
    for fp8, v_block in ((False, None), (True, 0), (True, 32)):
        cache = KVCache(80, 2, 16, torch.float32, "cpu", fp8=fp8, v_block=v_block)
        cache.write(0, torch.randn(70, 2, 16), torch.randn(70, 2, 16))
        k0, v0 = (t.clone() for t in cache.read(70))
        src, dst = torch.tensor([40, 43, 47, 52]), torch.tensor([40, 41, 42, 43])
        cache.move_rows(src, dst)
        k1, v1 = cache.read(70)
        assert torch.equal(k1[dst], k0[src]) and torch.equal(v1[dst], v0[src]), (fp8, v_block)
        assert torch.equal(k1[:40], k0[:40]) and torch.equal(v1[:40], v0[:40])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["kv-bf16", "kv-fp8"])
def test_tree_attention_triton_matches_reference(fp8):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(5)
    dev = torch.device("cuda")
    # Up to 64 rows (every tree: the 33-64-row ones went to the reference before the captured tree verify).
    for parents in (PARENTS, list(range(-1, 31)), [-1] + [0] * 31, list(range(-1, 63)), [-1] + [0] * 40 + [1] * 23):
        T = len(parents)
        start, Hq, Hkv, hd = 300, 8, 2, 128
        cache = KVCache(512, Hkv, hd, torch.bfloat16, dev, fp8=fp8)
        cache.write(0, torch.randn(start + T, Hkv, hd, device=dev, dtype=torch.bfloat16),
                    torch.randn(start + T, Hkv, hd, device=dev, dtype=torch.bfloat16))
        q = torch.randn(T, Hq, hd, device=dev, dtype=torch.bfloat16)
        tree = TreeMask.from_parents(torch.tensor(parents), dev)
        out = tree_attention(q, cache, start, hd ** -0.5, tree)
        k, v = cache.read(start + T)
        ref = tree_attention_ref(q.float(), k.float(), v.float(), start, hd ** -0.5, tree.ancestors)
        torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
        # The start as a device tensor (a captured tree verify): the same rows, and the whole-cache reference.
        pos = torch.tensor([start], device=dev)
        torch.testing.assert_close(tree_attention(q, cache, 0, hd ** -0.5, tree, pos).float(), ref,
                                   rtol=3e-2, atol=3e-2)
        kk, vv = cache.read(cache.max_len)
        torch.testing.assert_close(tree_attention_at(q.float(), kk.float(), vv.float(), pos, hd ** -0.5,
                                                     tree.ancestors), ref, rtol=1e-4, atol=1e-4)
