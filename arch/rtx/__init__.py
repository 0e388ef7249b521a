"""Discrete-GPU hooks (RTX / datacenter cards with their own VRAM)."""

from __future__ import annotations

from edgespec.arch.base import ArchDefaults, ArchHooks


class RtxHooks(ArchHooks):
    """Discrete GPU: verify over model-dtype (bf16) KV, large prefill chunks (VRAM bandwidth is plentiful), CUDA
    graphs on. Rollback defaults to deferred: the verify graph leaves the GDN state alone and the accept stage
    advances it by the accepted rows in one launch, where per-step checkpoints write the whole state once per
    row (docs/benchmarks.md). A replay
    re-runs the accepted rows as an eager forward, which on a launch-bound discrete GPU costs more than the
    verify graph itself; ``checkpoint`` and ``replay`` stay available."""

    name = "rtx"

    @classmethod
    def make_defaults(cls) -> ArchDefaults:
        return ArchDefaults(kv_fp8=False, rollback="deferred", prefill_chunk=2048, window_size=128,
                            window_seed=True, cuda_graphs=True, adaptive_k=False, tree_min_joint=0.0,
                            tree_row_cost=0.0, tree_budget=32,
                            graph_prefill_max=128)
