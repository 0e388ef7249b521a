"""Discrete-GPU hooks (RTX / datacenter cards with their own VRAM)."""

from __future__ import annotations

from edgespec.arch.base import ArchDefaults, ArchHooks


class RtxHooks(ArchHooks):
    """Discrete GPU: verify over model-dtype (bf16) KV, snapshot + replay rollback (no per-row state slots, so
    the least memory), large prefill chunks (VRAM bandwidth is plentiful), CUDA graphs on."""

    name = "rtx"

    def make_defaults(self) -> ArchDefaults:
        return ArchDefaults(kv_fp8=False, rollback="replay", prefill_chunk=2048, window_size=128,
                            window_seed=True, cuda_graphs=True)
