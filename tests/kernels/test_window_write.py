"""The DFlash window append's stores (edgespec.kernels.draft.window_write): reference = the window's own write path,
Triton = reference bit for bit, bad shapes refused."""

from __future__ import annotations

import pytest
import torch
from _devices import CUDA

from edgespec.drafters.window import FeatureWindow
from edgespec.kernels.draft.window_write import window_write, window_write_ref

# (capacity, scratch rows, feature dim, layers, KV heads, head dim, rows, start): one row deep in the ring, a full
# wrap-around append, the 27B drafter's widths.
CASES = [(8, 4, 64, 3, 2, 16, 8, 13), (128, 16, 640, 5, 4, 32, 1, 300), (128, 16, 5120, 5, 4, 256, 16, 250)]


def _rows(r: int, F: int, L: int, hkv: int, hd: int, device: str):
    feats = torch.randn(r, F, device=device).bfloat16()
    kv = torch.randn(L, r, 2 * hkv, hd, device=device).bfloat16()
    return feats, kv[:, :, :hkv].contiguous(), kv[:, :, hkv:]          # values: a strided view, as the drafter has


@pytest.mark.parametrize("case", CASES)
def test_reference_is_the_window_write(case):
    """window_write_ref stores exactly what FeatureWindow.write stored from host-built positions."""
    cap, scratch, F, L, hkv, hd, r, start = case
    feats, keys, values = _rows(r, F, L, hkv, hd, "cpu")
    old, new = (FeatureWindow(cap, F, L, hkv, hd, torch.float32, "cpu", scratch_rows=scratch) for _ in range(2))
    old.write(start + torch.arange(r), feats, keys, values)
    window_write_ref(torch.tensor([start]), feats, keys, values, new.features, new.keys, new.values, new.positions)
    for a, b in ((old.features, new.features), (old.keys, new.keys), (old.values, new.values),
                 (old.positions, new.positions)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("case", CASES)
def test_triton_equals_reference(device, case):
    """The one-launch Triton store = the reference, bit for bit, also replayed from a CUDA graph at a new start."""
    cap, scratch, F, L, hkv, hd, r, start = case
    feats, keys, values = _rows(r, F, L, hkv, hd, device)
    start_t = torch.tensor([start], device=device)
    want, got = (FeatureWindow(cap, F, L, hkv, hd, torch.float32, device, scratch_rows=scratch) for _ in range(2))
    for w in (want, got):
        w.keys.fill_(float("nan"))                      # untouched slots and scratch rows must stay as they were
        w.values.fill_(float("nan"))
    window_write_ref(start_t, feats, keys, values, want.features, want.keys, want.values, want.positions)
    window_write(start_t, feats, keys, values, got.features, got.keys, got.values, got.positions)
    for a, b in ((want.features, got.features), (want.keys, got.keys), (want.values, got.values),
                 (want.positions, got.positions)):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        window_write(start_t, feats, keys, values, got.features, got.keys, got.values, got.positions)
    start_t.fill_(start + 3)
    graph.replay()
    window_write_ref(start_t, feats, keys, values, want.features, want.keys, want.values, want.positions)
    assert torch.equal(want.keys.nan_to_num(7.0), got.keys.nan_to_num(7.0))
    assert torch.equal(want.positions, got.positions)


def test_bad_shapes_are_refused():
    w = FeatureWindow(4, 8, 2, 1, 4, torch.float32, "cpu", scratch_rows=2)
    feats, keys, values = _rows(2, 8, 2, 1, 4, "cpu")
    start = torch.tensor([0])
    bad = [(feats[:, :6], keys, values), (feats, keys[:1], values), (feats, keys, values[..., :2]),
           (*_rows(5, 8, 2, 1, 4, "cpu"),)]                              # more rows than the ring holds
    for f, k, v in bad:
        with pytest.raises(ValueError, match="window write shapes"):
            window_write(start, f, k, v, w.features, w.keys, w.values, w.positions)
