"""The one target-model interface: a decoder-only stack of attention and/or Gated DeltaNet layers.

Callers (generation, the speculative session, drafters) use only :meth:`TargetModel.forward` and its two
conveniences :meth:`prefill` and :meth:`decode`; they never ask which kind a layer is (design invariant 5).
A forward runs T new tokens at positions ``cache.length .. cache.length+T-1``, writes their K/V and state, and
advances ``cache.length`` by T. The speculative session rolls back with :meth:`ModelCache.rollback`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from edgespec.cache.kv import KVCache, lazy_zeros
from edgespec.cache.model_cache import ModelCache
from edgespec.cache.state import GDNState, GDNStateBank, StateMode
from edgespec.kernels.quant.linear import linear
from edgespec.kernels.verify.tree import TreeMask
from edgespec.models.config import ModelConfig
from edgespec.models.gdn import GatedDeltaNet
from edgespec.models.layers import Attention, Linear, RMSNorm, RotaryEmbedding, gather_rows, merge_all_projections
from edgespec.models.moe import feed_forward
from edgespec.models.multimodal import ImageRows
from edgespec.models.vision import VisionTower


@dataclass
class ForwardOutput:
    """What one forward returns. ``logits`` rows follow the ``logits`` argument of the forward."""

    logits: torch.Tensor | None      # [rows, vocab] float32
    hidden: torch.Tensor             # [T, hidden] final post-norm hidden states (MTP input)
    taps: torch.Tensor | None        # [T, n_taps, hidden] outputs of the tapped layers (DFlash context)
    # [rows + 1] int64 from static (graph) forwards: the strict greedy verdict of the input tokens against the
    # logits (leading drafts that equal the argmax of the row before them), then every row's argmax; computed on
    # the device with the forward, so a greedy accept stage is one small host copy (edgespec.kernels.verify.argmax).
    # Padding rows of a shorter draft are counted too: readers cap the count at their own number of drafts.
    greedy: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (attention or GDN) then SwiGLU MLP.

    The residual stream is carried as ``(h, delta)``: the layer adds the previous layer's last update ``delta``
    to ``h`` inside its input RMSNorm, and returns its own MLP output as the next ``delta``, so every residual
    add is fused with the norm that follows it (one kernel instead of two, twice per layer, on CUDA). The values
    are those of ``h = h + x; h = h + mlp(norm(h))``: same additions, same order.
    """

    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "full_attention":
            self.self_attn = Attention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        self.mlp = feed_forward(cfg)     # SwiGLU MLP, or the sparse MoE of qwen3_5_moe (edgespec.models.moe)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norms)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norms)

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, cache: KVCache | GDNState, start: int,
                rope: RotaryEmbedding, chunked: bool, mode: StateMode, pos_t: torch.Tensor | None = None,
                cs: tuple[torch.Tensor, torch.Tensor] | None = None,
                tree: TreeMask | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(h, delta)``: this layer's output is ``h + delta`` (see the class doc). ``cs``: the
        forward's rotary angles, shared by its attention layers."""
        if delta is None:
            x = self.input_layernorm(h)
        else:
            h, x = self.input_layernorm.add_forward(delta, h)
        if self.kind == "full_attention":
            x = self.self_attn(x, cache, start, rope, pos_t, cs, tree=tree)
        else:
            x = self.linear_attn(x, cache, chunked=chunked, mode=mode, tree=tree)
        h, y = self.post_attention_layernorm.add_forward(x, h)
        return h, self.mlp(y)


class MTPHead(nn.Module):
    """Qwen3.5 native multi-token-prediction weights (``mtp.*``), kept for the MTP drafter.

    Step: ``u = fc(cat(norm_e(embed(tok)), norm_h(h)))``, one full-attention decoder layer, final norm; the
    target's embedding and lm_head are shared. The drafter in ``edgespec.drafters.mtp`` runs it.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.fc = Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps, cfg.zero_centred_norms)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps, cfg.zero_centred_norms)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, "full_attention") for _ in range(cfg.mtp_num_hidden_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps, cfg.zero_centred_norms)


class _Backbone(nn.Module):
    """Holds the parameters under the ``model.`` names checkpoints use (embed_tokens, layers, norm)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, kind) for kind in cfg.layer_types])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norms)


class TargetModel(nn.Module):
    """A causal LM (Llama, Qwen3, Qwen3.5 hybrid) with static caches and optional hidden-state taps."""

    # Prefill longer than this many rows uses the chunked GDN form; shorter multi-row forwards (verify) use
    # the recurrent form, which can also write per-step checkpoints.
    CHUNKED_MIN_ROWS = 32
    # The loader's MemoryBudget (edgespec.memory) of serving this model; None for a model built by hand.
    memory_budget = None

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, with_mtp: bool = False,
                 with_vision: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPHead(cfg) if with_mtp and cfg.mtp_num_hidden_layers > 0 else None
        # The vision tower (checkpoint keys model.visual.*), for prompts with images (edgespec.models.multimodal).
        self.visual = VisionTower(cfg.vision) if with_vision and cfg.vision is not None else None
        self.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings)

    # -- properties ---------------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype   # a packed table reports its compute dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ``tokens`` (see :func:`gather_rows`; a packed table decodes just those rows)."""
        return gather_rows(self.model.embed_tokens.weight, tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project final post-norm hidden states ``[T, H]`` to float32 logits ``[T, V]``."""
        return linear(hidden, self.lm_head_weight).float()

    def merge_projections(self) -> TargetModel:
        """Merge q/k/v, gate/up and the four GDN input projections into one GEMV each (after loading)."""
        merge_all_projections(self)
        return self

    # -- caches -------------------------------------------------------------------------------------------------
    def new_cache(self, max_len: int, kv_fp8: bool = False, checkpoint_rows: int = 0,
                  defer_rows: int = 0) -> ModelCache:
        """Allocate every layer's cache once. ``checkpoint_rows``: largest verify that keeps per-step states;
        ``defer_rows``: largest verify that defers its GDN state update (keeps per-row inputs instead)."""
        cfg = self.config
        if max_len > self.rope.cos.shape[0]:
            raise ValueError(f"max_len {max_len} exceeds the rotary table ({self.rope.cos.shape[0]} positions)")
        n_gdn = sum(kind != "full_attention" for kind in cfg.layer_types)
        bank = GDNStateBank(n_gdn, cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads,
                            cfg.linear_key_head_dim, cfg.linear_value_head_dim, self.dtype, self.device,
                            checkpoint_slots=checkpoint_rows + 1, defer_rows=defer_rows) if n_gdn else None
        states = iter(bank.layers if bank is not None else [])
        layers: list[KVCache | GDNState] = []
        shape = (max_len, cfg.num_key_value_heads, cfg.head_dim)
        blocks = iter(())
        if self.device.type == "cpu" and not kv_fp8:
            # one lazily zeroed block for every layer's K and V: resident only as rows are written
            n_kv = 2 * sum(kind == "full_attention" for kind in cfg.layer_types)
            blocks = iter(lazy_zeros(n_kv * math.prod(shape), self.dtype).view(n_kv, *shape))
        for kind in cfg.layer_types:
            if kind == "full_attention":
                storage = (next(blocks), next(blocks)) if self.device.type == "cpu" and not kv_fp8 else None
                layers.append(KVCache(max_len, cfg.num_key_value_heads, cfg.head_dim, self.dtype, self.device,
                                      fp8=kv_fp8, storage=storage))
            else:
                layers.append(next(states))
        cache = ModelCache(layers, max_len, bank)
        if self.visual is not None:
            # Positions after an image are cache index + a delta; graph replays read it on the device.
            cache.rope_delta_t = torch.zeros(1, dtype=torch.long, device=self.device)
        return cache

    # -- forwards -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: ModelCache, *, taps: Sequence[int] = (),
                mode: StateMode = StateMode.ADVANCE, chunked: bool | None = None,
                logits: Literal["all", "last", "none"] = "all",
                pos_t: torch.Tensor | None = None, tree: TreeMask | None = None,
                images: ImageRows | None = None) -> ForwardOutput:
        """Run ``tokens [T]`` at positions ``cache.length ..``; returns logits, final hidden and taps.

        ``taps``: layer ids whose OUTPUT is captured (id L = HF ``hidden_states[L+1]``).
        ``mode`` (what the GDN states do; the rollback strategies of ``edgespec.arch.rollback`` pick it):
        CHECKPOINT saves the state after every row so :meth:`ModelCache.rollback` is constant time; DEFER leaves
        the states untouched and keeps each row's inputs, and :meth:`ModelCache.rollback` (which must follow
        before the next forward) then advances them by the kept rows; ADVANCE just updates them.
        ``pos_t``: graph mode -- the start position as a one-element device tensor. Nothing then depends on
        host values, so the forward can be captured once per T and replayed at any position; the caller (see
        ``edgespec.arch.graphs``) does the host bookkeeping (``cache.length``, checkpoint marks).
        ``tree``: verify a draft tree (:mod:`edgespec.kernels.verify.tree`): row t at position ``start + depth``, seeing
        the prefix and its ancestors; GDN layers defer. Rows are written at ``start ..`` in row order, and
        :meth:`ModelCache.commit_path` (which must follow) keeps one root-to-node path. With ``pos_t`` too (a
        captured tree verify, ``edgespec.arch.tree_graphs``) the caller does the host bookkeeping and the commit.
        ``images``: prompt rows holding image tokens (a prefill): their embeddings are the vision tower's tokens and
        every row takes its multimodal RoPE position from it. Otherwise rows sit at cache index + the cache's rope
        delta (:meth:`ModelCache.set_rope_delta`; 0 without images).
        """
        T = tokens.shape[0]
        start = cache.length
        if pos_t is None:
            cache.check_room(start, T)
        if chunked is None:
            chunked = T >= self.CHUNKED_MIN_ROWS
        if not isinstance(mode, StateMode):
            raise ValueError(f"forward mode {mode!r} is not a StateMode ({', '.join(m.name for m in StateMode)})")
        if tree is not None:
            if mode is StateMode.CHECKPOINT or tree.rows != T:
                raise ValueError(f"a tree forward of {tree.rows} rows takes {T} tokens and no checkpoints")
            mode = StateMode.DEFER          # GDN layers keep each row's inputs; commit_path advances the path
        if not cache.has_state:
            mode = StateMode.ADVANCE        # attention-only: nothing to checkpoint or defer
        checkpoint, defer = mode is StateMode.CHECKPOINT, mode is StateMode.DEFER
        if checkpoint:
            if pos_t is None:
                cache.begin_checkpointed_forward(start, T)
            else:
                cache.save_states()
        elif tree is not None and pos_t is None:
            cache.begin_tree_forward(start, T)
        elif defer and pos_t is None:
            cache.begin_deferred_forward(start, T)
        h = self.embed(tokens)
        if images is not None:
            h[images.rows] = images.embeds.to(h.dtype)
        cs = self._angles(cache, start, T, pos_t, tree, images, h.dtype) if cache.kv_layers else None
        stacked = None
        if tree is None and pos_t is None and images is None and cs is not None and h.device.type == "cpu":
            # The whole stack in one compiled call where it applies (edgespec.models.cpu_stack).
            from edgespec.models.cpu_stack import stack_forward
            stacked = stack_forward(self, h, cache, start, cs, taps)
        if stacked is None:
            hidden, tap_out = self._layer_loop(h, cache, start, taps, chunked, mode, pos_t, cs, tree, images)
        else:
            hidden, tap_out = stacked
        if pos_t is None:
            cache.length = start + T
        if logits == "all":
            out_logits = self.logits(hidden)
        elif logits == "last":
            out_logits = self.logits(hidden[-1:])
        else:
            out_logits = None
        return ForwardOutput(out_logits, hidden, tap_out)

    def _angles(self, cache: ModelCache, start: int, T: int, pos_t: torch.Tensor | None, tree: TreeMask | None,
                images: ImageRows | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's rotary angles: the images' multimodal positions, or cache index + the rope delta (on the
        device under graphs), at each tree row's depth for a tree."""
        if images is not None:
            if tree is not None:
                raise ValueError("a tree verify carries no image rows")
            return self.rope.angles_mrope(images.positions, dtype)
        delta_t = cache.rope_delta_t
        if tree is None:
            return self.rope.angles(start + cache.rope_delta, T, pos_t, dtype, delta_t)
        if pos_t is None:
            return self.rope.angles_at(start + cache.rope_delta + tree.depths, dtype)
        base = pos_t if delta_t is None else pos_t + delta_t
        return self.rope.angles_at(base + tree.depths, dtype)

    def _layer_loop(self, h: torch.Tensor, cache: ModelCache, start: int, taps: Sequence[int], chunked: bool,
                    mode: StateMode, pos_t: torch.Tensor | None, cs: tuple[torch.Tensor, torch.Tensor] | None,
                    tree: TreeMask | None, images: ImageRows | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers one by one from the embedding rows ``h``: ``(final-normed rows, taps or None)``."""
        T = h.shape[0]
        tap_out = torch.empty(T, len(taps), h.shape[-1], dtype=h.dtype, device=h.device) if taps else None
        tap_index = {layer: i for i, layer in enumerate(taps)}
        deepstack = images.deepstack if images is not None else []
        delta = None
        for i, (layer, layer_cache) in enumerate(zip(self.model.layers, cache.layers, strict=True)):
            h, delta = layer(h, delta, layer_cache, start, self.rope, chunked, mode, pos_t, cs, tree=tree)
            if i < len(deepstack):
                # Qwen3-VL: the tower's deepstack features join the image rows after the first decoder layers.
                h[images.rows] += deepstack[i].to(h.dtype)
            if tap_out is not None and i in tap_index:
                tap_out[:, tap_index[i]] = h + delta
        return self.model.norm.add_forward(delta, h)[1], tap_out

    def prefill(self, tokens: torch.Tensor, cache: ModelCache, chunk: int | None = None,
                taps: Sequence[int] = (), logits: bool = True, images: ImageRows | None = None) -> ForwardOutput:
        """Process a prompt in chunks of ``chunk`` tokens (bounded activation memory).

        Returns logits of the last row only (none with ``logits=False``: the first piece of a prefill paused for a
        snapshot, whose last row is not the prompt's); ``hidden`` and ``taps`` cover every prompt row. ``images``:
        the image rows among ``tokens`` and every row's M-RoPE position (see :meth:`forward`).
        """
        T = tokens.shape[0]
        cache.check_room(cache.length, T)
        chunk = chunk or T
        outs = []
        for s in range(0, T, chunk):
            piece = tokens[s:s + chunk]
            outs.append(self.forward(piece, cache, taps=taps, chunked=piece.shape[0] >= self.CHUNKED_MIN_ROWS,
                                     logits="last" if logits and s + chunk >= T else "none",
                                     images=None if images is None else images.piece(s, s + piece.shape[0])))
        hidden = torch.cat([o.hidden for o in outs]) if len(outs) > 1 else outs[0].hidden
        tap_all = None
        if taps:
            tap_all = torch.cat([o.taps for o in outs]) if len(outs) > 1 else outs[0].taps
        return ForwardOutput(outs[-1].logits, hidden, tap_all)

    def decode(self, token: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        """One step: ``token [1]`` -> logits ``[V]``."""
        return self.forward(token.view(1), cache, logits="all").logits[0]
