"""Store appended rows in the DFlash drafter's context window: features, every layer's K and V, and positions.

:class:`~edgespec.drafters.window.FeatureWindow` keeps a ring of ``capacity`` float32 slots; position ``p`` lives in
slot ``p % capacity``. An append of ``r`` rows at a device-held start position ``start_t[0]`` writes

* ``features [r, F]`` into ``feats_out[slot]`` (widened to float32),
* ``keys / values [L, r, Hkv, hd]`` into ``keys_out / values_out[:, slot]`` (widened to float32),
* the positions themselves into ``pos_out[slot]``.

The reference does it the way the window always did (an ``arange``, a modulo, four ``index_copy_`` and their casts):
about ten launches per one-row append of the drafter, a large share of the append (``tools/step_profile.py
--drafter``; docs/benchmarks.md, "Design figures"). On CUDA one Triton launch does it
(:mod:`edgespec.kernels.draft.triton_window_write`). The writes are exact copies either way (widening is exact).
"""

from __future__ import annotations

import torch

from edgespec.kernels import use_triton


def window_store_ref(positions: torch.Tensor, features: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     feats_out: torch.Tensor, keys_out: torch.Tensor, values_out: torch.Tensor,
                     pos_out: torch.Tensor) -> None:
    """Store rows of the (distinct) ``positions [r]`` in slots modulo the ring: four ``index_copy_`` and their
    casts (:meth:`~edgespec.drafters.window.FeatureWindow.write` and the reference below)."""
    slots = positions % pos_out.shape[0]
    feats_out.index_copy_(0, slots, features.to(feats_out.dtype))
    keys_out.index_copy_(1, slots, keys.to(keys_out.dtype))
    values_out.index_copy_(1, slots, values.to(values_out.dtype))
    pos_out.index_copy_(0, slots, positions)


def window_write_ref(start_t: torch.Tensor, features: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     feats_out: torch.Tensor, keys_out: torch.Tensor, values_out: torch.Tensor,
                     pos_out: torch.Tensor) -> None:
    """The torch reference (CPU path and oracle): positions ``start_t[0] + 0 .. r-1``, stored by
    :func:`window_store_ref`."""
    positions = start_t.view(1).to(torch.int64) + torch.arange(features.shape[0], device=features.device)
    window_store_ref(positions, features, keys, values, feats_out, keys_out, values_out, pos_out)


def window_write(start_t: torch.Tensor, features: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 feats_out: torch.Tensor, keys_out: torch.Tensor, values_out: torch.Tensor,
                 pos_out: torch.Tensor) -> None:
    """Write ``r`` appended rows (at most ``capacity`` of them, so no two share a slot) at positions
    ``start_t[0] ..`` into the ring buffers. Shapes: ``start_t`` one int64 element on the device; ``features [r,
    F]``; ``keys, values [L, r, Hkv, hd]`` (any strides); ``feats_out [capacity, F]``; ``keys_out, values_out [L,
    S, Hkv, hd]`` with ``S >= capacity`` (scratch rows after the ring are not touched); ``pos_out [capacity]``
    int64. Raises ValueError on a shape that does not fit. CUDA-graph safe (the start is read on the device)."""
    r, F = features.shape
    L, _, hkv, hd = keys_out.shape
    capacity = pos_out.shape[0]
    if (start_t.numel() != 1 or keys.shape != (L, r, hkv, hd) or values.shape != keys.shape
            or feats_out.shape != (capacity, F) or values_out.shape != keys_out.shape
            or keys_out.shape[1] < capacity or not 1 <= r <= capacity):
        raise ValueError(f"window write shapes: features{tuple(features.shape)} keys{tuple(keys.shape)} "
                         f"values{tuple(values.shape)} into features{tuple(feats_out.shape)} "
                         f"keys{tuple(keys_out.shape)} positions{tuple(pos_out.shape)}")
    if use_triton(features) and all(t.is_contiguous() for t in (feats_out, keys_out, values_out, pos_out)):
        from edgespec.kernels.draft.triton_window_write import window_write_triton
        window_write_triton(start_t, features, keys, values, feats_out, keys_out, values_out, pos_out)
        return
    window_write_ref(start_t, features, keys, values, feats_out, keys_out, values_out, pos_out)
