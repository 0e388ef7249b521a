"""Discrete-GPU hooks (RTX / datacenter cards with their own VRAM)."""

from __future__ import annotations

from edgespec.arch.base import ArchDefaults, ArchHooks


class RtxHooks(ArchHooks):
    """Discrete GPU: verify over model-dtype (bf16) KV, large prefill chunks (VRAM bandwidth is plentiful), CUDA
    graphs on. Rollback defaults to per-step checkpoints: a replay re-runs the accepted rows as an eager forward,
    which on a launch-bound discrete GPU costs more than the verify graph itself. ``rollback: replay`` (no
    per-row state slots: K+1 fewer state copies of memory) stays available where memory is tight."""

    name = "rtx"

    def make_defaults(self) -> ArchDefaults:
        return ArchDefaults(kv_fp8=False, rollback="checkpoint", prefill_chunk=2048, window_size=128,
                            window_seed=True, cuda_graphs=True, adaptive_k=False)
