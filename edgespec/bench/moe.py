"""Bytes a mixture-of-experts forward reads, from the routing actually seen.

A dense model's forward reads every weight once; an MoE forward reads its dense part (attention, GDN, shared
experts, routers, norms, lm_head) plus, per layer, each *touched* expert once (edgespec.kernels.moe.moe). With the
mean union per layer that a :class:`~edgespec.models.moe.RoutingLog` measured, :class:`ExpertBytes` gives the
bytes of a decode step and of a verify, the figure a byte-limit comparison divides by bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgespec.kernels.quant.quant_ref import E2M1_VALUES
from edgespec.memory import module_bytes
from edgespec.models.decoder import TargetModel
from edgespec.models.moe import SparseMoE
from edgespec.weights.fp8_block import FP8BlockWeight
from edgespec.weights.int4 import Int4Weight
from edgespec.weights.nvfp4 import NVFP4Weight

# Random codes of the packed formats, scaled so the weights have the served N(0, 0.02) size (the rms of uniformly
# drawn codes: int4 q - z with z in {7, 8}; the 16 e2m1 values; e4m3 bytes with bit 6 clear)
WEIGHT_RMS = 0.02
INT4_RMS = 4.6
E2M1_RMS = (sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES)) ** 0.5
# bit 6 clear: exponent field 0..7, |value| <= 1.875, never the NaN bytes 0x7F / 0xFF
FP8_BYTE_MASK = 0xBF


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


def _fp8_rms() -> float:
    """The rms of e4m3 values of uniformly drawn bytes under :data:`FP8_BYTE_MASK`."""
    values = (torch.arange(256, dtype=torch.int32) & FP8_BYTE_MASK).to(torch.uint8).view(torch.float8_e4m3fn)
    return values.float().pow(2).mean().sqrt().item()


def fill_random_codes_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Random codes in every int4, NVFP4 and block-FP8 weight of ``model`` (on its device; speed does not depend
    on the values), scaled to N(0, 0.02)-sized weights of mean 0: a constant int4 zero point of 8 gave every
    matrix a mean of -0.5 scale, a shared direction in every hidden state, and rows routed alike."""
    fp8_scale = WEIGHT_RMS / _fp8_rms()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Int4Weight):
                m.qweight.random_(0, 256, generator=gen)
                m.scales.fill_(WEIGHT_RMS / INT4_RMS)
                m.zeros.random_(7, 9, generator=gen)
            elif isinstance(m, NVFP4Weight):
                m.weight.random_(0, 256, generator=gen)
                m.weight_scale.view(torch.uint8).fill_(0x38)            # e4m3 1.0
                m.weight_scale_2.fill_(WEIGHT_RMS / E2M1_RMS)
            elif isinstance(m, FP8BlockWeight):
                codes = m.weight.view(torch.uint8)
                codes.random_(0, 256, generator=gen)
                codes.bitwise_and_(FP8_BYTE_MASK)
                m.weight_scale_inv.fill_(fp8_scale)
