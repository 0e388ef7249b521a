"""Quantize loaded dense layers into packed formats after loading: the DFlash drafter's linear layers
(``drafter_weights``) and the target's output projection (``lm_head_weights``).

Both are read every speculative cycle on a bandwidth-bound device: the Qwen3.5-27B head is 2.54 GB in bf16 and is
read by every verify and, borrowed by the DFlash drafter, by every draft (5.1 GB a cycle), 0.66 GB in int4. Each
layer is quantized from its dense weight and the dense weight dropped before the next, so nothing is held twice.
"""

from __future__ import annotations

import torch

from edgespec.errors import ConfigError
from edgespec.weights.base import PackedEmbedding, PackedLinear, PackedWeight, is_packed
from edgespec.weights.fp8_block import FP8BlockWeight
from edgespec.weights.int4 import Int4Weight
from edgespec.weights.mxfp4 import MXFP4Weight
from edgespec.weights.nvfp4 import NVFP4Weight

PACKED_CHOICES = ("fp8", "int4", "nvfp4", "mxfp4")
INT4_GROUPS = (128, 64, 32)     # the largest that divides the layer's inputs (the products take 32..256)
# Rows quantized at a time: the format quantizers hold a few fp32 copies of what they are given (a 27B head in one
# piece: ~15 GB of scratch on the serving device), a band of 8192 rows a few hundred MB. A multiple of 128, so FP8
# blocks never straddle two bands.
QUANT_BAND_ROWS = 8192


def quantize_weight(fmt: str, w: torch.Tensor, compute_dtype: torch.dtype = torch.float32,
                    group_size: int | None = None, global_amax: torch.Tensor | None = None) -> PackedWeight | None:
    """``w [out, in]`` in ``fmt``: the one round-to-nearest entry for every format (``edgespec quantize``, the
    format bench, ``drafter_weights``, ``lm_head_weights``). fp8: 128x128 blocks; int4: ``group_size``, or else the
    largest of 128/64/32 dividing ``in``; nvfp4: 16-blocks, ``global_amax`` shared by matrices served merged;
    mxfp4: 32-blocks. None when the format cannot hold this shape (int4: ``in`` not a multiple of the group; nvfp4:
    of 16; mxfp4: of 32)."""
    if w.shape[0] > QUANT_BAND_ROWS and fmt in PACKED_CHOICES:
        # Band by band, stacked by the format's own cat: every row (FP8: every 128-row block) quantizes on its
        # own, and NVFP4's global scale comes from the whole matrix first, so the result is the same bits.
        bands = w.split(QUANT_BAND_ROWS)
        if fmt == "nvfp4" and global_amax is None:
            global_amax = torch.stack([band.abs().amax() for band in bands]).amax().float()
        parts = [quantize_weight(fmt, band, compute_dtype, group_size, global_amax) for band in bands]
        return None if parts[0] is None else type(parts[0]).cat(parts)
    in_f = w.shape[1]
    if fmt == "fp8":
        return FP8BlockWeight.quantize(w, compute_dtype=compute_dtype)
    if fmt == "int4":
        group = group_size or next((g for g in INT4_GROUPS if in_f % g == 0), None)
        return Int4Weight.quantize(w, group, compute_dtype) if group and in_f % group == 0 else None
    if fmt == "nvfp4":
        return NVFP4Weight.quantize(w, compute_dtype, global_amax) if in_f % 16 == 0 else None
    if fmt == "mxfp4":
        return MXFP4Weight.quantize(w, compute_dtype) if in_f % 32 == 0 else None
    raise ConfigError(f"packed format {fmt!r}: choose one of {', '.join(PACKED_CHOICES)}")


def quantize_lm_head(model, fmt: str) -> bool:
    """Serve ``model``'s output projection in ``fmt`` (``lm_head_weights``); ``model`` keeps it as loaded. Returns
    whether the head was packed. A head tied to the embedding table packs the table (lookups included). The logits
    change by the format's rounding; speculative decoding stays equal to plain decoding of the model so served."""
    if fmt == "model":
        return False
    tied = model.lm_head is None
    head = model.lm_head_weight
    if is_packed(head):
        raise ConfigError(f"lm_head_weights {fmt!r}: the checkpoint's {'embedding table' if tied else 'lm_head'} "
                          f"is already packed ({head.format}); set lm_head_weights: model")
    with torch.no_grad():
        packed = quantize_weight(fmt, head.detach(), model.dtype)
        if packed is None:
            raise ConfigError(f"lm_head_weights {fmt!r}: hidden size {model.config.hidden_size} does not fit the "
                              "format's blocks")
        if tied:
            # A tied head is the embedding table: the table itself is packed, its lookups decode the rows asked for.
            model.model.embed_tokens = PackedEmbedding(packed)
        else:
            model.lm_head = PackedLinear(packed)
    return True


__all__ = ["PACKED_CHOICES", "quantize_lm_head", "quantize_weight"]
