"""Discrete-GPU hooks (RTX / datacenter cards with their own VRAM)."""

from __future__ import annotations

from collections.abc import Callable

from edgespec.arch.base import ArchDefaults, ArchHooks
from edgespec.weights.base import PackedWeight

# Formats on the block-scaled MMA by compute capability major: B200 (10) has tcgen05 block-scaled MMA for both; an
# RTX 50 (12) has NVFP4 x NVFP4 with E4M3 scales as a native mma.sync (OMMA.SF) but MXFP4 with e4m3 activations is
# upcast there, so MXFP4 stays on the base hooks' path.
BLOCK_SCALED = {10: ("nvfp4", "mxfp4"), 12: ("nvfp4",)}


class RtxHooks(ArchHooks):
    """Discrete GPU: verify over model-dtype (bf16) KV, large prefill chunks (VRAM bandwidth is plentiful), CUDA
    graphs on. Rollback defaults to deferred: the verify graph leaves the GDN state alone and the accept stage
    advances it by the accepted rows in one launch, where per-step checkpoints write the whole state once per
    row (docs/benchmarks.md). A replay
    re-runs the accepted rows as an eager forward, which on a launch-bound discrete GPU costs more than the
    verify graph itself; ``checkpoint`` and ``replay`` stay available.

    Products (:meth:`packed_kernel`): bf16-staged, i.e. each packed weight decoded to the activation type in
    registers and multiplied on the bf16 tensor cores, except where the card has the block-scaled MMA for the
    format (:data:`BLOCK_SCALED`: NVFP4 and MXFP4 on a B200, NVFP4 on an RTX 50)."""

    name = "rtx"

    @classmethod
    def make_defaults(cls) -> ArchDefaults:
        return ArchDefaults(kv_fp8=False, rollback="deferred", prefill_chunk=2048, window_size=128,
                            window_seed=True, cuda_graphs=True, adaptive_k=False, tree_min_joint=0.0,
                            tree_row_cost=0.0, tree_budget=32,
                            graph_prefill_max=128)

    def packed_kernel(self, packed: PackedWeight, capability: tuple[int, int]) -> Callable | None:
        if packed.format in BLOCK_SCALED.get(capability[0], ()):
            from edgespec.kernels.quant.triton_block_scaled import choose_block_scaled_kernel
            kernel = choose_block_scaled_kernel(packed, capability=capability)
            if kernel is not None:
                return kernel
        return super().packed_kernel(packed, capability)
