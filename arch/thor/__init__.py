"""Jetson AGX Thor hooks: unified 273 GB/s memory, so every byte read per token counts."""

from __future__ import annotations

from edgespec.arch.base import ArchDefaults, ArchHooks


class ThorHooks(ArchHooks):
    """Thor: FP8 KV (halves attention reads), deferred rollback (the verify reads the GDN state once and the
    commit reads and writes it once; per-step checkpoints would write it once per verify row -- 2.4 GB per
    16-row verify of Qwen3.5-27B, ~9 ms at 273 GB/s -- and a replay would read the weights a second time),
    chunked prefill bounded to keep activation memory small next to the CPU, drafter window seeded from the
    prompt tail, CUDA graphs on. Packed weights take the same Triton products as on Hopper
    (:meth:`ArchHooks.weight_kernel`) until native SM110 FP4 paths exist."""

    name = "thor"

    @classmethod
    def make_defaults(cls) -> ArchDefaults:
        return ArchDefaults(kv_fp8=True, rollback="deferred", prefill_chunk=256, window_size=128,
                            window_seed=True, cuda_graphs=True, adaptive_k=False, tree_min_joint=0.0,
                            tree_row_cost=0.0, tree_budget=32,
                            graph_prefill_max=128)
