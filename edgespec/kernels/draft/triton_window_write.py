"""The DFlash window append's stores in one Triton launch (contract: :mod:`edgespec.kernels.draft.window_write`).

Grid ``(r, L + 1)``: program ``(i, 0)`` copies feature row i and its position, program ``(i, 1 + l)`` layer l's
key and value rows of row i. Each reads the start position from the device, so one CUDA graph per row count
serves every position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _window_write_kernel(
    start_ptr, f_ptr, k_ptr, v_ptr, fo_ptr, ko_ptr, vo_ptr, po_ptr,
    capacity, F, KV,
    stride_fr, stride_kl, stride_kr, stride_kh, stride_vl, stride_vr, stride_vh,
    stride_fo, stride_kol, stride_kos,
    HD: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    part = tl.program_id(1)
    pos = tl.load(start_ptr).to(tl.int64) + i
    slot = pos % capacity
    offs = tl.arange(0, BLOCK)
    if part == 0:
        for f0 in range(0, F, BLOCK):
            f = f0 + offs
            x = tl.load(f_ptr + i * stride_fr + f, mask=f < F)
            tl.store(fo_ptr + slot * stride_fo + f, x.to(tl.float32), mask=f < F)
        tl.store(po_ptr + slot, pos)
    else:
        layer = (part - 1).to(tl.int64)
        for e0 in range(0, KV, BLOCK):
            e = e0 + offs
            h = e // HD
            d = e % HD
            ok = e < KV
            k = tl.load(k_ptr + layer * stride_kl + i * stride_kr + h * stride_kh + d, mask=ok)
            v = tl.load(v_ptr + layer * stride_vl + i * stride_vr + h * stride_vh + d, mask=ok)
            # The output rows are contiguous [Hkv, hd] blocks: e indexes them directly.
            dst = layer * stride_kol + slot * stride_kos + e
            tl.store(ko_ptr + dst, k.to(tl.float32), mask=ok)
            tl.store(vo_ptr + dst, v.to(tl.float32), mask=ok)


def window_write_triton(start_t: torch.Tensor, features: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        feats_out: torch.Tensor, keys_out: torch.Tensor, values_out: torch.Tensor,
                        pos_out: torch.Tensor) -> None:
    """One launch; shapes checked by :func:`edgespec.kernels.draft.window_write.window_write`."""
    r, F = features.shape
    L, _, hkv, hd = keys_out.shape
    features, keys, values = (x if x.stride(-1) == 1 else x.contiguous() for x in (features, keys, values))
    _window_write_kernel[(r, L + 1)](
        start_t, features, keys, values, feats_out, keys_out, values_out, pos_out,
        pos_out.shape[0], F, hkv * hd,
        features.stride(0), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        feats_out.stride(0), keys_out.stride(0), keys_out.stride(1),
        HD=hd, BLOCK=1024, num_warps=4,
    )
