"""The DFlash training objective: many anchored blocks of one sequence in a single differentiable forward.

For an anchor at position ``a`` (a committed token of the continuation), the drafter sees the block
``[x_a, MASK x (bs-1)]`` at positions ``a .. a+bs-1`` and the context features of tokens ``0 .. a-1`` (exactly
what the proposer's window holds when ``x_a`` is the pending anchor: a token's feature exists only after its
target forward), and row ``k`` learns to predict ``x_{a+k}``. Blocks of different anchors share the context keys
and never see each other (one attention mask; the rule of the reference training code). The cross-entropy of
row ``k`` is weighted by ``exp(-(k-1)/gamma)``: an early miss ends the accepted run, so early rows matter more.

This is a torch reference of :class:`~edgespec.drafters.dflash_proposer.DFlashProposer`'s block forward (the
same parameters under their checkpoint names, unmerged), with autograd; a test checks the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgespec.drafters.dflash_net import DFlashDraftModel
from edgespec.kernels.attention.rope import rope_ref
from edgespec.kernels.pointwise.norm import rms_norm_ref
from edgespec.models.layers import RotaryEmbedding


def _norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return rms_norm_ref(x, module.weight, module.eps, module.zero_centred)


def _lin(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def block_mask(anchors: torch.Tensor, n_ctx: int, bs: int, *, causal: bool = False, sliding: int | None = None,
               window: int | None = None, ctx_pos: torch.Tensor | None = None, ctx_seq: torch.Tensor | None = None,
               anchor_seq: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean ``[N*bs, n_ctx + N*bs]`` (True = attend): block ``j`` (anchor ``a_j``) sees context keys
    ``t < a_j`` (and ``t >= a_j - window`` with a per-token window W, as the proposer keeps) plus its own block
    (causal inside it on causal layers); a sliding layer also drops keys ``sliding`` or more positions away.
    A packed batch of several sequences passes each context row's position and sequence (``ctx_pos``,
    ``ctx_seq``) and each anchor's sequence (``anchor_seq``): a block then sees its own sequence's context only."""
    device = anchors.device
    N = anchors.shape[0]
    q_pos = (anchors[:, None] + torch.arange(bs, device=device)).reshape(-1)           # [N*bs]
    q_blk = torch.arange(N, device=device).repeat_interleave(bs)
    if ctx_pos is None:
        ctx_pos = torch.arange(n_ctx, device=device)
    a = anchors[q_blk]
    ctx = ctx_pos[None, :] < a[:, None]
    if ctx_seq is not None and anchor_seq is not None:
        ctx = ctx & (ctx_seq[None, :] == anchor_seq[q_blk][:, None])
    if window is not None:
        ctx = ctx & (ctx_pos[None, :] >= a[:, None] - window)
    own = q_blk[:, None] == q_blk[None, :]
    if causal:
        own = own & (q_pos[None, :] <= q_pos[:, None])
    if sliding is not None:
        ctx = ctx & (q_pos[:, None] - ctx_pos[None, :] < sliding)
        dist = q_pos[:, None] - q_pos[None, :]
        own = own & (dist < sliding) & (-dist < sliding)
    return torch.cat([ctx, own], dim=1)


@dataclass
class BlockBatch:
    """The blocks of one sequence: ``anchors [N]``, ``block_ids [N, bs]`` (anchor then MASKs), ``labels
    [N, bs-1]`` (token ``a+k`` for row ``k``; -100 where none) and the context taps ``[n_ctx, n_taps, H]``."""

    anchors: torch.Tensor
    block_ids: torch.Tensor
    labels: torch.Tensor
    taps: torch.Tensor
    # Packed batches (pack_blocks): each context row's position in its sequence and the sequence of each context
    # row and anchor. None for one sequence (positions 0 .. n_ctx-1).
    ctx_pos: torch.Tensor | None = None
    ctx_seq: torch.Tensor | None = None
    anchor_seq: torch.Tensor | None = None


def make_blocks(tokens: torch.Tensor, prompt_len: int, taps: torch.Tensor, anchors: torch.Tensor, bs: int,
                mask_id: int) -> BlockBatch:
    """Blocks anchored at ``anchors`` (positions ``>= prompt_len``, ``<= len-2``) of one sequence."""
    T = tokens.shape[0]
    idx = anchors[:, None] + torch.arange(bs, device=anchors.device)
    labels = torch.where(idx < T, tokens[idx.clamp(max=T - 1)], torch.full_like(idx, -100))[:, 1:]
    block_ids = torch.full((anchors.shape[0], bs), mask_id, dtype=torch.long, device=anchors.device)
    block_ids[:, 0] = tokens[anchors]
    n_ctx = int(anchors.max()) if anchors.numel() else 0
    return BlockBatch(anchors, block_ids, labels, taps[:n_ctx])


def pack_blocks(batches: list[BlockBatch]) -> BlockBatch:
    """Several sequences' blocks as one batch for one forward (on a GPU, one launch sequence for a whole step
    instead of one per sequence): contexts and blocks concatenated, each block masked to its own sequence's
    context, positions kept per sequence. Its logits equal the per-sequence forwards' (tested)."""
    dev = batches[0].anchors.device
    ctx_pos = torch.cat([torch.arange(b.taps.shape[0], device=dev) for b in batches])
    ctx_seq = torch.cat([torch.full((b.taps.shape[0],), i, device=dev) for i, b in enumerate(batches)])
    anchor_seq = torch.cat([torch.full((b.anchors.shape[0],), i, device=dev) for i, b in enumerate(batches)])
    return BlockBatch(torch.cat([b.anchors for b in batches]), torch.cat([b.block_ids for b in batches]),
                      torch.cat([b.labels for b in batches]), torch.cat([b.taps for b in batches]),
                      ctx_pos, ctx_seq, anchor_seq)


class BlockObjective(nn.Module):
    """The drafter plus the target's (frozen) embedding and head: ``forward(batch)`` -> per-row logits.

    Only ``drafter``'s parameters train; ``embed`` and ``head`` are buffers (never in the optimizer, never
    all-reduced by DDP). ``window``: limit each block's context to the last W tokens, as the proposer does
    (None: the whole history, as the reference drafter sees it).
    """

    def __init__(self, drafter: DFlashDraftModel, embed: torch.Tensor, head: torch.Tensor, max_positions: int,
                 window: int | None = None, gamma: float = 7.0) -> None:
        super().__init__()
        self.drafter = drafter
        self.cfg = drafter.cfg
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("head", head.detach(), persistent=False)
        rope = RotaryEmbedding(self.cfg.model_config(max_positions), max_positions)
        self.register_buffer("cos", rope.cos, persistent=False)
        self.register_buffer("sin", rope.sin, persistent=False)
        self.window = window
        self.gamma = gamma

    def hidden(self, b: BlockBatch) -> torch.Tensor:
        """Final-normed block rows ``[N, bs, H]``."""
        d, cfg = self.drafter, self.cfg
        dtype = d.fc.weight.dtype
        N, bs = b.block_ids.shape
        n_ctx = b.taps.shape[0]
        feats = _norm(d.hidden_norm, F.linear(b.taps.reshape(n_ctx, -1).to(dtype), d.fc.weight))
        h = self.embed[b.block_ids.reshape(-1)].to(dtype) * cfg.input_embedding_scale
        q_pos = (b.anchors[:, None] + torch.arange(bs, device=h.device)).reshape(-1)
        ctx_pos = torch.arange(n_ctx, device=h.device) if b.ctx_pos is None else b.ctx_pos
        cs_q = (self.cos[q_pos][:, None].to(dtype), self.sin[q_pos][:, None].to(dtype))
        cs_c = (self.cos[ctx_pos][:, None].to(dtype), self.sin[ctx_pos][:, None].to(dtype))
        masks: dict[tuple[bool, int | None], torch.Tensor] = {}
        for layer in d.layers:
            kind = (layer.causal, layer.sliding_window)
            if kind not in masks:
                masks[kind] = block_mask(b.anchors, n_ctx, bs, causal=kind[0], sliding=kind[1], window=self.window,
                                         ctx_pos=b.ctx_pos, ctx_seq=b.ctx_seq, anchor_seq=b.anchor_seq)
            h = self.layer_forward(layer, h, feats, cs_q, cs_c, masks[kind], bs)
        return _norm(d.norm, h).view(N, bs, -1)

    def layer_forward(self, layer: nn.Module, h: torch.Tensor, feats: torch.Tensor, cs_q: tuple[torch.Tensor, ...],
                      cs_c: tuple[torch.Tensor, ...], mask: torch.Tensor, bs: int) -> torch.Tensor:
        """One pre-norm layer over the residual rows ``h [N*bs, H]`` (``bs`` rows a block): attention, then MLP."""
        h = h + self.attention(layer, _norm(layer.input_layernorm, h), feats, cs_q, cs_c, mask)
        return h + self.mlp(layer, _norm(layer.post_attention_layernorm, h))

    def attention(self, layer: nn.Module, x: torch.Tensor, feats: torch.Tensor, cs_q: tuple[torch.Tensor, ...],
                  cs_c: tuple[torch.Tensor, ...], mask: torch.Tensor) -> torch.Tensor:
        """The attention sublayer's output ``[N*bs, H]`` (after ``o_proj``) of the normed block rows ``x``: block
        queries over the context features' keys and the block's own, under ``mask`` (:func:`block_mask`)."""
        cfg, att = self.cfg, layer.self_attn
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = rope_ref(_norm(att.q_norm, _lin(att.q_proj, x).view(-1, nh, hd)), *cs_q)
        k_blk = rope_ref(_norm(att.k_norm, _lin(att.k_proj, x).view(-1, nkv, hd)), *cs_q)
        k_ctx = rope_ref(_norm(att.k_norm, _lin(att.k_proj, feats).view(-1, nkv, hd)), *cs_c)
        v = torch.cat([_lin(att.v_proj, feats), _lin(att.v_proj, x)]).view(-1, nkv, hd)
        k = torch.cat([k_ctx, k_blk])
        rep = nh // nkv
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(rep, 0), v.transpose(0, 1).repeat_interleave(
                rep, 0), attn_mask=mask, scale=att.scale)
        return _lin(att.o_proj, o.transpose(0, 1).reshape(-1, nh * hd))

    @staticmethod
    def mlp(layer: nn.Module, y: torch.Tensor) -> torch.Tensor:
        """The SwiGLU sublayer's output of the normed rows ``y``."""
        mlp = layer.mlp
        return _lin(mlp.down_proj, F.silu(_lin(mlp.gate_proj, y)) * _lin(mlp.up_proj, y))

    def forward(self, b: BlockBatch, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits ``[N, bs-1, V]`` of the draft rows; with ``vocab`` (token ids) only those head rows,
        ``[N, bs-1, len(vocab)]`` (see :func:`sampled_vocab`)."""
        return self.row_logits(self.hidden(b)[:, 1:], vocab)

    def row_logits(self, hid: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits of final-normed rows ``hid [..., H]`` through the target's head (or its ``vocab`` rows)."""
        head = self.head if vocab is None else self.head[vocab]
        return F.linear(hid, head.to(hid.dtype)).float()

    def drafts(self, b: BlockBatch) -> torch.Tensor:
        """The proposer's greedy drafts ``[N, bs-1]``: every row's argmax over the full vocabulary."""
        return self(b).argmax(-1)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(decay-weighted mean cross-entropy, weight sum) over valid rows."""
        return decay_weighted_ce(logits, labels, self.gamma)


def decay_weighted_ce(logits: torch.Tensor, labels: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy of ``logits [N, D, C]`` against ``labels [N, D]`` (class indices, -100 = none) with row
    ``k`` weighted ``exp(-k / gamma)``, weight sum): an early miss ends the accepted run, so early rows count more."""
    k = torch.arange(labels.shape[1], device=labels.device, dtype=torch.float32)
    weight = torch.exp(-k / gamma)[None, :] * (labels >= 0)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).clamp(min=0),
                         reduction="none").view_as(weight)
    total = weight.sum()
    return (ce * weight).sum() / total.clamp(min=1e-6), total


def sampled_vocab(labels: torch.Tensor, vocab_size: int, n_random: int, gen: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled softmax for CPU budgets: the head rows of every label token plus ``n_random`` random others.

    The head matmul over a 49k-152k vocabulary is most of a small drafter's training FLOPs; scoring the labels
    against a random sample of the rest keeps the gradient's direction (the negatives the drafter confuses most
    often are the domain's own tokens, which are all in). Returns ``(vocab ids, labels remapped into them)``.
    """
    present = labels[labels >= 0].unique()
    others = torch.randint(0, vocab_size, (n_random,), generator=gen).to(labels.device)
    vocab = torch.cat([present, others]).unique()
    lookup = torch.full((vocab_size,), -100, dtype=torch.long, device=labels.device)
    lookup[vocab] = torch.arange(vocab.shape[0], device=labels.device)
    return vocab, torch.where(labels >= 0, lookup[labels.clamp(min=0)], labels)


def accepted_lengths(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Acceptance length per block under greedy verification of the rows' argmax drafts
    (:func:`accepted_drafts`)."""
    return accepted_drafts(logits.argmax(-1), labels)


def accepted_drafts(drafts: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Acceptance length per block under greedy verification: 1 (the bonus token) + the leading drafts
    ``[N, bs-1]`` that equal the label. Rows without a label end the run (the sequence ended there)."""
    hit = (drafts == labels) & (labels >= 0)
    return 1 + hit.long().cumprod(dim=1).sum(dim=1)
