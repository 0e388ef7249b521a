"""Discrete-GPU hooks (RTX / datacenter cards with their own VRAM)."""

from __future__ import annotations

from edgespec.arch.base import ArchDefaults, ArchHooks


class RtxHooks(ArchHooks):
    """Discrete GPU: verify over model-dtype (bf16) KV, large prefill chunks (VRAM bandwidth is plentiful), CUDA
    graphs on. Rollback defaults to deferred: the verify graph leaves the GDN state alone and the accept stage
    advances it by the accepted rows in one launch (Qwen3.5-4B on an H200: a 16-row verify went from 1.42x to
    1.28x a decode step against per-step checkpoints, which write the whole state once per row). A replay
    re-runs the accepted rows as an eager forward, which on a launch-bound discrete GPU costs more than the
    verify graph itself; ``checkpoint`` and ``replay`` stay available."""

    name = "rtx"

    @classmethod
    def make_defaults(cls) -> ArchDefaults:
        return ArchDefaults(kv_fp8=False, rollback="deferred", prefill_chunk=2048, window_size=128,
                            window_seed=True, cuda_graphs=True, adaptive_k=False, tree_min_joint=0.0,
                            graph_prefill_max=128)
