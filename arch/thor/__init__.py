"""Jetson AGX Thor hooks: unified 273 GB/s memory, so every byte read per token counts."""

from __future__ import annotations

from edgespec.arch.base import ArchDefaults, ArchHooks


class ThorHooks(ArchHooks):
    """Thor: FP8 KV (halves attention reads), per-step checkpoint rollback (constant time: a replay would read
    the weights a second time, the dominant cost on a weight-read-bound device), chunked prefill bounded to keep
    activation memory small next to the CPU, drafter window seeded from the prompt tail, CUDA graphs on."""

    name = "thor"

    def make_defaults(self) -> ArchDefaults:
        return ArchDefaults(kv_fp8=True, rollback="checkpoint", prefill_chunk=256, window_size=128,
                            window_seed=True, cuda_graphs=True, adaptive_k=False)
