"""Bytes a mixture-of-experts forward reads, from the routing actually seen.

A dense model's forward reads every weight once; an MoE forward reads its dense part (attention, GDN, shared
experts, routers, norms, lm_head) plus, per layer, each *touched* expert once (edgespec.kernels.moe). With the
mean union per layer that a :class:`~edgespec.models.moe.RoutingLog` measured, :class:`ExpertBytes` gives the
bytes of a decode step and of a verify, the figure a byte-limit comparison divides by bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgespec.memory import module_bytes
from edgespec.models.decoder import TargetModel
from edgespec.models.moe import SparseMoE


@dataclass(frozen=True)
class ExpertBytes:
    """Weight bytes of an MoE target split by how a forward reads them: ``dense`` by every forward,
    ``per_expert`` once per touched expert per layer (``layers`` MoE layers, ``top_k`` routed experts a row)."""

    dense: int
    per_expert: int
    layers: int
    top_k: int

    def per_forward(self, mean_union: float) -> float:
        """Bytes one forward reads when each layer touches ``mean_union`` experts on average."""
        return self.dense + self.layers * mean_union * self.per_expert

    @property
    def decode(self) -> int:
        """Bytes of a plain one-row decode step: k experts per layer."""
        return self.dense + self.layers * self.top_k * self.per_expert


def expert_bytes(model: TargetModel, all_weights: int) -> ExpertBytes | None:
    """The :class:`ExpertBytes` of a target whose forward would read ``all_weights`` bytes if every expert were
    touched (``edgespec.bench.gpu.weight_bytes_per_token``: MTP head excluded, one embedding row); None for a dense
    model."""
    blocks = [m for n, m in model.named_modules() if isinstance(m, SparseMoE) and not n.startswith("mtp.")]
    if not blocks:
        return None
    routed = sum(module_bytes(b.experts) for b in blocks)
    return ExpertBytes(all_weights - routed, module_bytes(blocks[0].experts[0]), len(blocks),
                       blocks[0].top_k)
