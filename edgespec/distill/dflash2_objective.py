"""The DFlash2 training objective: the DFlash block objective with the convolutions, plus the selector's loss.

The blocks, their anchors and the context masks are the DFlash objective's (:class:`~edgespec.distill.objective.
BlockObjective`, :func:`~edgespec.distill.objective.make_blocks`). Inside each layer the attention and the MLP sit
between their grouped dynamic causal convolution's two sides, over the rows of each block (the blocks are the
leading dimension of :func:`~edgespec.kernels.recurrent.dynamic_conv.dynamic_conv_ref`); the head's logits are scaled by
``output_multiplier`` and soft-capped as the drafter's config says. Two losses, summed:

* **the drafter's**: the DFlash decay-weighted cross-entropy of every draft row's logits against the target's
  token (``exp(-k / gamma)`` for row ``k``);
* **the selector's**: with teacher forcing, the cross-entropy of the selector's path scores over row ``k``'s
  candidates -- the head's top-``K`` tokens, the label forced into the last slot when it is not among them --
  given the true predecessor (the anchor for row 0, the label of row ``k - 1`` after), with the same weights.
  A draft at row ``k`` is accepted only when rows ``0 .. k-1`` were, that is when the selector's predecessor is
  the label's: teacher forcing scores exactly the steps that can be accepted. The unary term is the drafter's own
  logit of the candidate, so this loss also reaches the backbone.

The z-lab ``dflash`` package (0.1.0) ships the network, not its training code; this objective is ours, built so
that its greedy drafts (:meth:`DFlash2Objective.drafts`: the selector's path through the head's top-``K``, as
:class:`~edgespec.drafters.dflash2_proposer.DFlash2Proposer` and the package draft) score what verification
accepts. With ``vocab`` (a sampled softmax) the candidates are the top-``K`` of the sampled rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgespec.distill.objective import BlockBatch, BlockObjective, _norm, decay_weighted_ce
from edgespec.drafters.dflash2_net import DFlash2DraftModel
from edgespec.kernels.draft.selector import selector_transitions, selector_walk_ref
from edgespec.kernels.recurrent.dynamic_conv import dynamic_conv_ref


@dataclass
class SelectorRows:
    """What the DFlash2 objective's forward gives its loss: the draft rows' logits ``[N, bs-1, V]`` (or over the
    sampled ``vocab``), the selector's teacher-forced path scores of each row's candidates ``[N, bs-1, K]`` and the
    candidate slot of each row's label ``[N, bs-1]`` (-100 where the row has none)."""

    logits: torch.Tensor
    path_scores: torch.Tensor
    path_labels: torch.Tensor


def _conv(conv: nn.Module, x: torch.Tensor, coef: torch.Tensor, side: int) -> torch.Tensor:
    """Side ``side`` of a sublayer's convolution over blocks ``x [N, bs, H]`` (coefficients ``[N, bs, 2, taps,
    groups]``)."""
    return dynamic_conv_ref(x, coef[:, :, side], conv.base_kernel[side], conv.group_size)


def _around(conv: nn.Module, x: torch.Tensor, bs: int, sublayer) -> torch.Tensor:
    """``sublayer`` of the normed rows ``x [N*bs, H]`` between the two sides of its convolution: the dynamic
    coefficients come from ``x``, side 0 convolves ``x``, side 1 the sublayer's output."""
    xb = x.view(-1, bs, x.shape[-1])
    coef = F.linear(xb, conv.kernel_projection.weight).view(*xb.shape[:2], 2, conv.taps, conv.groups)
    out = sublayer(_conv(conv, xb, coef, 0).reshape_as(x))
    return _conv(conv, out.view_as(xb), coef, 1).reshape_as(x)


class DFlash2Objective(BlockObjective):
    """A :class:`DFlash2DraftModel` with the target's frozen embedding and head: ``forward(batch)`` ->
    :class:`SelectorRows`, :meth:`loss` the sum of the drafter's and the selector's (module docstring)."""

    drafter: DFlash2DraftModel

    def layer_forward(self, layer: nn.Module, h: torch.Tensor, feats: torch.Tensor, cs_q: tuple[torch.Tensor, ...],
                      cs_c: tuple[torch.Tensor, ...], mask: torch.Tensor, bs: int) -> torch.Tensor:
        x = _norm(layer.input_layernorm, h)
        h = h + _around(layer.attention_conv, x, bs, lambda u: self.attention(layer, u, feats, cs_q, cs_c, mask))
        y = _norm(layer.post_attention_layernorm, h)
        return h + _around(layer.mlp_conv, y, bs, lambda u: self.mlp(layer, u))

    def row_logits(self, hid: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """The drafter's logits: the head's, times ``output_multiplier``, soft-capped (``head_scores``)."""
        return self.drafter.head_scores(super().row_logits(hid, vocab))

    def forward(self, b: BlockBatch, vocab: torch.Tensor | None = None) -> SelectorRows:  # type: ignore[override]
        hid = self.hidden(b)[:, 1:]                                                      # [N, D, H]
        logits = self.row_logits(hid, vocab)                                             # [N, D, V']
        sel = self.drafter.candidate_selector
        valid = b.labels >= 0
        # The label's column in the logits (the sampled vocabulary is sorted and holds every label).
        col = b.labels.clamp(min=0) if vocab is None else torch.searchsorted(vocab, b.labels.clamp(min=0))
        top = logits.detach().topk(min(sel.top_k, logits.shape[-1]), dim=-1).indices      # [N, D, K]
        missing = valid & ~(top == col[..., None]).any(-1)
        top[..., -1] = torch.where(missing, col, top[..., -1])
        slot = torch.where(valid, (top == col[..., None]).long().argmax(-1), torch.full_like(col, -100))
        ids = top if vocab is None else vocab[top]                                       # token ids [N, D, K]
        prev = torch.cat([b.block_ids[:, :1], b.labels[:, :-1].clamp(min=0)], dim=1)    # teacher-forced [N, D]
        gate = F.linear(hid, sel.hidden_projection.weight).float()                        # [N, D, r]
        pair = torch.einsum("ndr,ndkr->ndk", sel.predecessor_codebook[prev].float() * gate,
                            sel.successor_codebook[ids].float())
        return SelectorRows(logits, logits.gather(-1, top) + pair, slot)

    def loss(self, out: SelectorRows, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """(the drafter's decay-weighted cross-entropy + the selector's, the drafter's weight sum)."""
        drafter, total = decay_weighted_ce(out.logits, labels, self.gamma)
        selector, _ = decay_weighted_ce(out.path_scores, out.path_labels, self.gamma)
        return drafter + selector, total

    @torch.no_grad()
    def drafts(self, b: BlockBatch) -> torch.Tensor:
        """The proposer's greedy drafts ``[N, bs-1]``: the selector's path from each anchor through the full
        head's top-``K`` of every row."""
        hid = self.hidden(b)[:, 1:]
        sel = self.drafter.candidate_selector
        unary, ids = self.row_logits(hid).topk(sel.top_k, dim=-1)
        trans = selector_transitions(F.linear(hid, sel.hidden_projection.weight), ids, b.block_ids[:, 0],
                                     sel.predecessor_codebook, sel.successor_codebook)
        choice, _ = selector_walk_ref(unary, trans)
        return ids.gather(-1, choice[..., None])[..., 0]


__all__ = ["DFlash2Objective", "SelectorRows"]
