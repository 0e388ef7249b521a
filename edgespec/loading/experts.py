"""Fused expert tensors of MoE checkpoints, seen as the per-expert tensors the model loads.

Releases store routed experts two ways: one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight``,
``up_proj``, ``down_proj``; what transformers 5 writes and the quantized releases use), or fused per layer as
transformers holds them in memory (``mlp.experts.gate_up_proj`` [experts, 2*width, hidden] with the gate rows
first, ``mlp.experts.down_proj`` [experts, hidden, width]; mlx-lm and vLLM load both). A fused tensor is row-major,
so each expert's gate, up and down matrices are contiguous byte ranges of the file: :func:`split_fused_experts`
rewrites the header entries into per-expert entries over those ranges, and the loader streams each straight into
its expert as usual (no copy of the fused tensor is ever held).
"""

from __future__ import annotations

import torch

from edgespec.errors import CheckpointError
from edgespec.loading.safetensors_io import TensorEntry
from edgespec.models.config import ModelConfig

_GATE_UP = ".experts.gate_up_proj"
_DOWN = ".experts.down_proj"
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def _slice(entry: TensorEntry, key: str, index: int, shape: tuple[int, int]) -> TensorEntry:
    nbytes = shape[0] * shape[1] * entry.dtype.itemsize
    start = entry.start + index * nbytes
    return TensorEntry(key, entry.path, entry.dtype, shape, start, start + nbytes)


def split_fused_experts(entries: dict[str, TensorEntry], cfg: ModelConfig) -> dict[str, TensorEntry]:
    """``entries`` with every fused expert tensor replaced by per-expert entries (unchanged for a dense model or a
    per-expert checkpoint). A fused tensor of the wrong shape or a quantized dtype raises, naming the key."""
    if not cfg.is_moe:
        return entries
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    out: dict[str, TensorEntry] = {}
    for key, entry in entries.items():
        if key.endswith(_GATE_UP):
            base, expected = key[:-len(_GATE_UP)], (E, 2 * I, H)
        elif key.endswith(_DOWN):
            base, expected = key[:-len(_DOWN)], (E, H, I)
        else:
            out[key] = entry
            continue
        if entry.shape != expected:
            raise CheckpointError(f"fused expert tensor {key} in {entry.path.name} has shape {list(entry.shape)}, "
                                  f"expected {list(expected)} (num_experts, rows, columns) for num_experts {E}, "
                                  f"moe_intermediate_size {I}, hidden_size {H}")
        if entry.dtype not in _FLOAT:
            raise CheckpointError(f"fused expert tensor {key} in {entry.path.name} is {entry.dtype}: fused experts "
                                  f"load in bf16/fp16/fp32; quantized experts are read from per-expert tensors")
        for e in range(E):
            prefix = f"{base}.experts.{e}"
            if key.endswith(_GATE_UP):
                pair = _slice(entry, "", e, (2 * I, H))
                gate = TensorEntry(f"{prefix}.gate_proj.weight", entry.path, entry.dtype, (I, H), pair.start,
                                   pair.start + (pair.stop - pair.start) // 2)
                up = TensorEntry(f"{prefix}.up_proj.weight", entry.path, entry.dtype, (I, H), gate.stop, pair.stop)
                out[gate.key], out[up.key] = gate, up
            else:
                down = _slice(entry, f"{prefix}.down_proj.weight", e, (H, I))
                out[down.key] = down
    clash = sorted(k for k in out if k in entries and out[k] is not entries[k])
    if clash:
        raise CheckpointError(f"checkpoint holds expert {clash[0]} both fused and as its own tensor")
    return out
