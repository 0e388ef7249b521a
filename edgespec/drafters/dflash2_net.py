"""The DFlash2 drafter network and its config (z-lab's ``DFlash2DraftModel`` checkpoint format).

A DFlash2 drafter is a DFlash drafter (:mod:`edgespec.drafters.dflash_net`: a block of ``[anchor, MASK x
(bs-1)]`` attending to context features tapped from the target) with two additions, both carried by the
checkpoint:

* a grouped dynamic causal convolution along the block's rows around each attention and MLP sublayer
  (``layers.{i}.attention_conv`` / ``mlp_conv``: ``base_kernel [2, taps, H]`` and ``kernel_projection``, one
  projection of the sublayer's input giving the dynamic coefficients of both sides;
  :mod:`edgespec.kernels.recurrent.dynamic_conv`), so a draft position sees the positions before it;
* a candidate selector (``candidate_selector.hidden_projection [rank, H]``, ``predecessor_codebook`` and
  ``successor_codebook [V, rank]``, stored bare) that keeps the ``selector_top_k`` best tokens of each position
  and drafts the path with the best unary logit plus low-rank predecessor-to-successor score
  (:mod:`edgespec.kernels.draft.selector`).

The head's logits are ``lm_head(h) * output_multiplier``, soft-capped by ``tanh(l / c) * c`` when
``final_logit_softcapping`` (``c``) is set. The proposer (:mod:`edgespec.drafters.dflash2_proposer`) runs it; the
loader (:mod:`edgespec.drafters.dflash2_loader`) fills it from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edgespec.drafters.dflash_net import DFlashConfig, DFlashDraftModel, parse_dflash_config
from edgespec.errors import CheckpointError
from edgespec.kernels.draft.selector import selector_transitions, selector_walk
from edgespec.kernels.recurrent.dynamic_conv import dynamic_conv
from edgespec.models.layers import Linear

ARCHITECTURE = "DFlash2DraftModel"
_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


# ---- config -------------------------------------------------------------------------------------------------
@dataclass
class DFlash2Config(DFlashConfig):
    """A DFlash config plus the convolution and selector sizes and the head's scaling (``dflash_config`` keys,
    also accepted at the top level)."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None


def is_dflash2_config(raw: dict[str, Any]) -> bool:
    """True when a drafter ``config.json`` declares the DFlash2 architecture."""
    return ARCHITECTURE in (raw.get("architectures") or [])


def parse_dflash2_config(raw: dict[str, Any], target_layers: int, source: str = "config.json") -> DFlash2Config:
    """Normalise a DFlash2 config dict (the DFlash rules of :func:`parse_dflash_config`, plus the four sizes the
    convolution and the selector need). ``use_sliding_window: false`` or a null ``sliding_window`` with sliding
    layers means what it means to the reference (transformers' Qwen3 config drops the window then): those layers
    stay causal inside the block, with no window. Errors name ``source`` and the key."""
    nested = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}

    def value(name: str, default: Any = None) -> Any:
        return nested[name] if name in nested else raw.get(name, default)

    missing = [k for k in _REQUIRED if value(k) is None]
    if missing:
        raise CheckpointError(f"{source}: a DFlash2 drafter needs {', '.join(missing)} (in dflash_config)")
    unwindowed = value("use_sliding_window") is False or not value("sliding_window")
    base = parse_dflash_config({**raw, "sliding_window": 1} if unwindowed else raw, target_layers, source)
    try:
        taps, group = int(value("conv_kernel_size")), int(value("conv_group_size"))
        rank, top_k = int(value("selector_rank")), int(value("selector_top_k"))
        multiplier = float(value("output_multiplier", 1.0))
        softcap = value("final_logit_softcapping")
        softcap = float(softcap) if softcap is not None and float(softcap) > 0 else None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: a DFlash2 size is not a number: {e}") from None
    if taps < 1 or group < 1 or rank < 1 or top_k < 1:
        raise CheckpointError(f"{source}: conv_kernel_size {taps}, conv_group_size {group}, selector_rank {rank} "
                              f"and selector_top_k {top_k} must all be >= 1")
    if base.hidden_size % group:
        raise CheckpointError(f"{source}: hidden_size {base.hidden_size} is not a multiple of conv_group_size "
                              f"{group}")
    if base.vocab_size is not None and top_k > base.vocab_size:
        raise CheckpointError(f"{source}: selector_top_k {top_k} exceeds vocab_size {base.vocab_size}")
    if multiplier <= 0:
        # The draft keeps the head's top-k before scaling: a positive multiplier keeps that order.
        raise CheckpointError(f"{source}: output_multiplier {multiplier} must be positive")
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    if unwindowed:
        fields["sliding_window"] = None
    return DFlash2Config(**fields, conv_kernel_size=taps, conv_group_size=group, selector_rank=rank,
                         selector_top_k=top_k, output_multiplier=multiplier, final_logit_softcapping=softcap)


# ---- modules --------------------------------------------------------------------------------------------------
class GroupedDynamicConv(nn.Module):
    """The convolution around one sublayer: :meth:`coefficients` of the sublayer's input (both sides at once),
    then :meth:`forward` on the input (side 0) and on the sublayer's output (side 1)."""

    def __init__(self, hidden: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.taps, self.group_size = taps, group_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = Linear(hidden, 2 * taps * self.groups, bias=False)

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """Dynamic coefficients ``[T, 2, taps, groups]`` of the sublayer input ``x [T, H]``."""
        return self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.groups)

    def forward(self, x: torch.Tensor, coefficients: torch.Tensor, side: int) -> torch.Tensor:
        return dynamic_conv(x, coefficients[:, side], self.base_kernel[side], self.group_size)


class CandidateSelector(nn.Module):
    """Top-k candidates per draft position and the greedy path through them (:mod:`edgespec.kernels.draft.selector`).
    The codebooks are bare parameters, as the published checkpoints store them."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = Linear(hidden, rank, bias=False)

    def candidates(self, hidden: torch.Tensor, anchor: torch.Tensor, ids: torch.Tensor, unary: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft rows ``hidden [D, H]``, the anchor ``[1]`` and each row's candidates ``ids [D, K]`` with their
        logits ``unary [D, K]`` -> ``(tokens [D], path_scores [D, K], transitions [D, K, K])``: the greedy path's
        tokens, every candidate's score given the path's predecessor, and the bilinear term of every step."""
        gates = self.hidden_projection(hidden)
        trans = selector_transitions(gates, ids, anchor, self.predecessor_codebook, self.successor_codebook)
        choice, scores = selector_walk(unary, trans)
        return ids.gather(1, choice[:, None])[:, 0], scores, trans


class DFlash2DraftModel(DFlashDraftModel):
    """A DFlash drafter (:class:`DFlashDraftModel`, same weight names) with each layer's ``attention_conv`` and
    ``mlp_conv`` and the ``candidate_selector`` over a vocabulary of ``selector_vocab`` tokens."""

    def __init__(self, cfg: DFlash2Config, target_hidden: int, selector_vocab: int, embed_vocab: int | None = None,
                 head_vocab: int | None = None) -> None:
        super().__init__(cfg, target_hidden, embed_vocab, head_vocab)
        H = cfg.hidden_size
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicConv(H, cfg.conv_kernel_size, cfg.conv_group_size)
            layer.mlp_conv = GroupedDynamicConv(H, cfg.conv_kernel_size, cfg.conv_group_size)
        self.candidate_selector = CandidateSelector(selector_vocab, H, cfg.selector_rank, cfg.selector_top_k)

    def head_scores(self, raw: torch.Tensor) -> torch.Tensor:
        """The head's raw logits (any float dtype) -> the drafter's logits in float32: scaled, soft-capped."""
        cfg: DFlash2Config = self.cfg
        scores = raw.float()
        if cfg.output_multiplier != 1.0:
            scores = scores * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            scores = torch.tanh(scores / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return scores

    def block_forward(self, h: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                      biases: dict[tuple[bool, int | None], torch.Tensor], cs: tuple[torch.Tensor, torch.Tensor]
                      ) -> torch.Tensor:
        """:meth:`DFlashDraftModel.block_forward` with each sublayer between its convolution's two sides: the
        coefficients come from the sublayer's normed input, side 0 convolves that input, side 1 the sublayer's
        output before the residual add."""
        delta = None
        for i, layer in enumerate(self.layers):
            if delta is None:
                x = layer.input_layernorm(h)
            else:
                h, x = layer.input_layernorm.add_forward(delta, h)
            conv = layer.attention_conv
            coef = conv.coefficients(x)
            attn = layer.self_attn(conv(x, coef, 0), keys[i], values[i], biases[(layer.causal, layer.sliding_window)],
                                   cs)
            h, y = layer.post_attention_layernorm.add_forward(conv(attn, coef, 1), h)
            conv = layer.mlp_conv
            coef = conv.coefficients(y)
            delta = conv(layer.mlp(conv(y, coef, 0)), coef, 1)
        return self.norm.add_forward(delta, h)[1]


__all__ = ["ARCHITECTURE", "CandidateSelector", "DFlash2Config", "DFlash2DraftModel", "GroupedDynamicConv",
           "is_dflash2_config", "parse_dflash2_config"]
