"""Jetson AGX Thor hooks: unified 273 GB/s memory, so every byte read per token counts."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from edgespec.arch.base import ArchDefaults, ArchHooks
from edgespec.cache.model_cache import ModelCache
from edgespec.models.decoder import ForwardOutput, TargetModel
from edgespec.models.multimodal import ImageRows
from edgespec.weights.base import PackedWeight

# A prefill chunk's activations may take this share of the memory free now: on Thor the GPU's "free memory" is the
# board's, shared with the CPU side (the robot stack, the server), so a long prompt must not take it all at once.
UNIFIED_PREFILL_SHARE = 1 / 16
# Chunks are multiples of this (a block of the prefill tiles) and never smaller.
PREFILL_CHUNK_ALIGN = 64


def prefill_bytes_per_token(model: TargetModel) -> int:
    """Activation bytes one prefill token holds at once in a layer (hidden states and residual, the widest
    projection's output and its gated half, the logits row of the last token excluded), in the model's dtype."""
    cfg = model.config
    width = max(cfg.intermediate_size or 0, getattr(cfg, "moe_intermediate_size", 0) or 0, cfg.hidden_size)
    elem = torch.finfo(model.dtype).bits // 8
    return (4 * cfg.hidden_size + 3 * width) * elem


def free_memory(device: torch.device) -> int:
    """Bytes free now: the CUDA driver's figure (on Thor, the unified memory's), else the host's available pages."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ThorHooks(ArchHooks):
    """Thor: FP8 KV (halves attention reads), deferred rollback (the verify reads the GDN state once and the
    commit reads and writes it once; per-step checkpoints would write it once per verify row -- 2.4 GB per
    16-row verify of Qwen3.5-27B, ~9 ms at 273 GB/s -- and a replay would read the weights a second time),
    prefill chunked to what unified memory has free, drafter window seeded from the prompt tail, CUDA graphs on.

    Stages it owns: :meth:`packed_kernel` puts NVFP4 and MXFP4 weights on the block-scaled tensor-core MMA
    (``edgespec.kernels.quant.triton_block_scaled``: no per-weight decode on the CUDA cores) for decode and verify;
    :meth:`prefill` sizes its chunks by :func:`free_memory`; int4 and block-FP8 keep the portable products."""

    name = "thor"

    def __init__(self, free: Callable[[torch.device], int] = free_memory) -> None:
        super().__init__()
        self.free = free

    @classmethod
    def make_defaults(cls) -> ArchDefaults:
        return ArchDefaults(kv_fp8=True, rollback="deferred", prefill_chunk=256, window_size=128,
                            window_seed=True, cuda_graphs=True, adaptive_k=False, tree_min_joint=0.0,
                            tree_row_cost=0.0, tree_budget=32,
                            graph_prefill_max=128)

    def packed_kernel(self, packed: PackedWeight, capability: tuple[int, int]) -> Callable | None:
        """NVFP4 / MXFP4 on the block-scaled MMA where the device has it (compute capability 10+: sm_110a on
        Thor), else the portable products."""
        from edgespec.kernels.quant.triton_block_scaled import choose_block_scaled_kernel
        kernel = choose_block_scaled_kernel(packed, native_only=True, capability=capability)
        return kernel if kernel is not None else super().packed_kernel(packed, capability)

    def prefill_chunk(self, model: TargetModel, chunk: int) -> int:
        """``chunk`` (the setting), lowered so one chunk's activations fit :data:`UNIFIED_PREFILL_SHARE` of the
        memory free now; a multiple of :data:`PREFILL_CHUNK_ALIGN`, at least one."""
        fits = int(self.free(model.device) * UNIFIED_PREFILL_SHARE) // prefill_bytes_per_token(model)
        fits = max(PREFILL_CHUNK_ALIGN, fits // PREFILL_CHUNK_ALIGN * PREFILL_CHUNK_ALIGN)
        return min(chunk, fits)

    def prefill(self, model: TargetModel, cache: ModelCache, prompt: torch.Tensor, chunk: int,
                taps: Sequence[int], logits: bool = True, images: ImageRows | None = None) -> ForwardOutput:
        """The portable prefill in chunks of :meth:`prefill_chunk`: a long prompt never holds more activation
        memory than the board has to spare beside the CPU side (a camera frame's rows included)."""
        return super().prefill(model, cache, prompt, self.prefill_chunk(model, chunk), taps, logits, images)
