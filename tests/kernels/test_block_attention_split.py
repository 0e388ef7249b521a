"""Block attention split over the keys (:mod:`edgespec.kernels.attention.triton_block_attention`): every split count
against the float32 reference on the masks a drafter builds (GPU), a CUDA-graph replay of the split form (GPU), and the
validation of the launch overrides (CPU, pure Python)."""

from __future__ import annotations

import pytest
import torch

from edgespec.arch.graphs import capture_graph
from edgespec.kernels.attention.block_attention import block_attention_ref

triton = pytest.importorskip("triton")
from edgespec.kernels.attention.triton_block_attention import (  # noqa: E402
    block_attention_launch,
    block_attention_triton,
    default_block_splits,
)

# (T, Hq, Hkv, hd, W, sliding window): the Qwen3.5-27B drafter heads, Qwen3-8B-like heads, a tiny odd case.
SHAPES = {
    "27b-drafter": (16, 24, 4, 256, 128, 32),
    "hq32-hd128": (16, 32, 8, 128, 128, 32),
    "tiny-odd": (6, 8, 2, 32, 5, 4),
}


def _drafter_biases(T: int, W: int, rep: int, window: int, device: str):
    """The masks of tests/drafters/test_dflash.py::test_block_attention_triton_equals_reference_on_drafter_masks:
    causal, bidirectional, causal sliding window; the oldest ring slots are empty (position -1, never visible), so the
    first key splits see only masked keys."""
    empty = min(40, W // 2)
    key_pos = torch.cat([torch.arange(-empty, W - empty, device=device),
                         torch.arange(W - empty, W - empty + T, device=device)])
    key_pos[:empty] = -1
    dist = key_pos[W:][:, None] - key_pos[None, :]
    for causal, win in ((True, None), (False, None), (True, window)):
        visible = (key_pos >= 0)[None, :].expand(T, -1)
        if causal:
            visible = visible & (dist >= 0)
        if win is not None:
            visible = visible & (dist < win)
        yield (causal, win), torch.where(visible, 0.0, float("-inf")).repeat(rep, 1)


def _split_counts(T: int, W: int, hd: int, config: dict[str, int] | None) -> list[int | None]:
    """1, 2, 3 and one tile per split where the tiles allow them, and the default (None)."""
    n_tiles = triton.cdiv(W + T, block_attention_launch(T, W + T, hd, 1, 1, config=config)["BLOCK_N"])
    return sorted({1, 2, 3, n_tiles} & set(range(1, n_tiles + 1))) + [None]


def _inputs(T: int, Hq: int, Hkv: int, hd: int, W: int):
    """bf16 queries and block K/V; a float32 window holding bf16 values whose scratch rows are NaN (the kernel must
    never read them)."""
    S = W + T
    q = torch.randn(T, Hq, hd, device="cuda").bfloat16()
    keys, values = torch.randn(2, S, Hkv, hd, device="cuda").bfloat16().float()
    k_block, v_block = torch.randn(2, T, Hkv, hd, device="cuda").bfloat16()
    keys[W:], values[W:] = float("nan"), float("nan")
    return q, k_block, v_block, keys, values


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", [None, {"BLOCK_N": 16}], ids=["default-tiles", "16-key-tiles"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_split_block_attention_equals_reference_on_drafter_masks(shape, config):
    """Every split count (1, 2, 3, one tile per split where the tiles allow, the default) against the float32
    reference, bf16 queries and K/V values; no NaN where a split sees only masked keys. 16-key tiles give the
    27B shape nine splits, with a last split shorter than the others."""
    T, Hq, Hkv, hd, W, window = shape
    torch.manual_seed(0)
    q, k_block, v_block, keys, values = _inputs(T, Hq, Hkv, hd, W)
    for tag, bias in _drafter_biases(T, W, Hq // Hkv, window, "cuda"):
        want = block_attention_ref(q, k_block, v_block, keys.clone(), values.clone(), bias, hd ** -0.5).float()
        for n_splits in _split_counts(T, W, hd, config):
            got = block_attention_triton(q, k_block, v_block, keys, values, bias, hd ** -0.5,
                                         n_splits=n_splits, config=config).float()
            # Same tolerance as the single-launch test: both round float32 results to bf16.
            assert not got.isnan().any(), (tag, n_splits)
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2,
                                       msg=lambda m, t=tag, n=n_splits: f"{t}, n_splits={n}: {m}")
            assert ((got - want).norm() / want.norm()).item() < 5e-3, (tag, n_splits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_block_attention_replays_in_a_cuda_graph():
    """The split form (two launches, per-call scratch) captured in a CUDA graph replays what it computes eagerly,
    also after the inputs change in place."""
    T, Hq, Hkv, hd, W, window = SHAPES["27b-drafter"]
    q, k_block, v_block, keys, values = _inputs(T, Hq, Hkv, hd, W)
    bias = next(_drafter_biases(T, W, Hq // Hkv, window, "cuda"))[1]
    run = lambda: block_attention_triton(q, k_block, v_block, keys, values, bias, hd ** -0.5)  # noqa: E731
    graph, out = capture_graph(run, warmups=1)                  # compile outside the capture
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, run(), atol=0, rtol=0)


# ---- launch validation (CPU) ------------------------------------------------------------------------------------
def test_default_split_rule_covers_the_sms_once():
    # 27B drafter: 144 keys in five 32-key tiles, 24 heads on 132 SMs -> cdiv(132, 24) = 6, capped at 5 tiles.
    cfg = block_attention_launch(16, 144, 256, 24, 132)
    assert (cfg["BLOCK_N"], cfg["n_splits"], cfg["CHUNK"]) == (32, 5, 32)
    assert default_block_splits(5, 24, 132) == 5 and default_block_splits(5, 64, 132) == 3
    assert default_block_splits(5, 200, 132) == 1
    # hd 128: 64-key tiles, three of them.
    assert block_attention_launch(16, 144, 128, 32, 132)["n_splits"] == 3


def test_split_counts_round_to_whole_tiles_and_launch_no_empty_split():
    assert block_attention_launch(16, 144, 256, 24, 132, n_splits=1)["CHUNK"] == 160
    cfg = block_attention_launch(16, 144, 256, 24, 132, n_splits=4)          # 5 tiles: 2 + 2 + 1
    assert (cfg["n_splits"], cfg["CHUNK"]) == (3, 64)
    cfg = block_attention_launch(16, 144, 256, 24, 132, n_splits=9, config={"BLOCK_N": 16, "num_warps": 8})
    assert (cfg["BLOCK_N"], cfg["num_warps"], cfg["n_splits"], cfg["CHUNK"]) == (16, 8, 9, 16)


@pytest.mark.parametrize("n_splits", [0, -1, 6, 2.0, True])
def test_bad_split_count_raises(n_splits):
    with pytest.raises(ValueError, match="n_splits"):
        block_attention_launch(16, 144, 256, 24, 132, n_splits=n_splits)


@pytest.mark.parametrize("config,key", [({"BLOCK_M": 16}, "BLOCK_M"), ({"n_splits": 2}, "n_splits"),
                                        ({"BLOCK_N": 48}, "BLOCK_N"), ({"BLOCK_N": 8}, "BLOCK_N"),
                                        ({"num_warps": 3}, "num_warps"), ({"num_stages": 0}, "num_stages")])
def test_bad_config_raises_naming_the_key(config, key):
    with pytest.raises(ValueError, match=key):
        block_attention_launch(16, 144, 256, 24, 132, config=config)


def test_block_attention_triton_validates_before_launching():
    """The wrapper checks its overrides before any launch, so bad ones fail the same way on any device."""
    T, Hq, Hkv, hd, W = 6, 8, 2, 32, 5
    q = torch.zeros(T, Hq, hd, dtype=torch.bfloat16)
    kb = torch.zeros(T, Hkv, hd, dtype=torch.bfloat16)
    keys = torch.zeros(W + T, Hkv, hd)
    bias = torch.zeros(Hq // Hkv * T, W + T)
    with pytest.raises(ValueError, match="n_splits"):
        block_attention_triton(q, kb, kb, keys, keys, bias, 0.25, n_splits=2)           # one tile only
    with pytest.raises(ValueError, match="'bogus'"):
        block_attention_triton(q, kb, kb, keys, keys, bias, 0.25, config={"bogus": 1})
