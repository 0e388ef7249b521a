"""DFlash block-diffusion drafter with a per-token context window (public z-lab checkpoint format).

A DFlash drafter is a small transformer that drafts a whole block in one forward: the block is
``[anchor, MASK x (bs-1)]`` at positions ``p .. p+bs-1`` (``p`` = position of the anchor = the last emitted
token), and every block query also attends to *context* keys computed from the target's tapped hidden states.

Which token each context feature belongs to
-------------------------------------------
Tap row ``i`` of a target forward is the tapped hidden state *of the token at that row*, computed at that token's
position. Position ``t`` therefore gets exactly one feature, ``hidden_norm(fc(cat(taps of token t)))``, and
the feature exists only once token ``t`` has been through a target forward:

* prefill runs prompt tokens ``x_0 .. x_{n-1}``: features of positions ``0 .. n-1`` (the window is seeded from
  the last ``min(W, n)`` of them, or only the last one with seeding off). The first emitted token ``x_n`` has
  no feature yet: it is the first anchor.
* a verify runs ``rows = [last, d_1 .. d_K]`` at positions ``p .. p+K`` where ``last`` (position ``p``) is the
  previous cycle's bonus token. With ``a`` drafts accepted, rows ``0 .. a`` (``last, d_1 .. d_a``) are
  committed to the target cache, so their features are appended at positions ``p .. p+a``. The new bonus token
  (position ``p+a+1``) is the next anchor and gets its feature in the next cycle, as row 0.
* a plain decode step (no draft) runs ``[last]`` alone: one feature, position ``p``.

So after every commit the window holds the features of the committed tokens ``end-W .. end-1`` in order, where
``end`` = the target cache length = the position of the pending anchor. A replay rollback returns a forward over
exactly the accepted rows; a checkpoint rollback returns the full verify -- both ways rows ``0 .. accepted`` are
the committed ones.

Context K/V depend only on the feature (they skip the residual stream), so each drafter layer's context key
(k_norm + RoPE at the token's absolute position) and value are computed once, when the feature is appended, and
kept in the ring buffer of :class:`~edgespec.drafters.window.FeatureWindow`. A draft is then one block of ``bs``
queries against ``W + bs`` keys per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from edgespec.arch.graphs import capture_graph
from edgespec.config import Settings
from edgespec.drafters.base import Draft, Proposer
from edgespec.drafters.window import FeatureWindow
from edgespec.errors import CheckpointError, ConfigError, UnsupportedModelError
from edgespec.kernels.argmax import row_argmax
from edgespec.kernels.block_attention import block_attention
from edgespec.kernels.linear import linear
from edgespec.kernels.rope import head_norm_rope
from edgespec.loading.hf_config import read_json
from edgespec.loading.weights import load_parameters, weight_files
from edgespec.models.config import ModelConfig
from edgespec.models.decoder import ForwardOutput, TargetModel
from edgespec.models.layers import (
    MLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    gather_rows,
    merge_all_projections,
    merge_linears,
)

_LAYER_TYPES = ("full_attention", "sliding_attention")


# ---- config -------------------------------------------------------------------------------------------------
@dataclass
class DFlashConfig:
    """What a DFlash ``config.json`` says, normalised (keys accepted at the top level or under ``dflash_config``)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    layer_types: list[str]
    sliding_window: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    vocab_size: int | None = None
    num_target_layers: int | None = None
    tie_word_embeddings: bool = False
    is_causal: bool | None = None           # overrides the per-layer-type default when the config sets it
    input_embedding_scale: float = 1.0
    target_layer_ids_from_config: bool = True

    def layer_causal(self, i: int) -> bool:
        """Reference training code: sliding layers are causal inside the block, full layers bidirectional."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def model_config(self, max_positions: int) -> ModelConfig:
        """A :class:`ModelConfig` view, so the shared RMSNorm / MLP / RotaryEmbedding blocks can be reused."""
        return ModelConfig(
            family="qwen3", model_type="dflash", vocab_size=self.vocab_size or 0, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, partial_rotary_factor=self.partial_rotary_factor,
            max_position_embeddings=max_positions, attention_bias=self.attention_bias)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Tap layers when the config names none (the rule of the reference training code).

    One draft layer taps the middle layer; otherwise ``num_draft_layers`` ids spread evenly from layer 1 to
    layer ``n - 3`` (Qwen3-8B, 36 layers, 5 draft layers: 1, 9, 17, 25, 33).
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def parse_dflash_config(raw: dict[str, Any], target_layers: int, source: str = "config.json") -> DFlashConfig:
    """Normalise a DFlash config dict. ``target_layers`` feeds the tap fallback when ``target_layer_ids`` is absent
    (``num_target_layers`` from the config wins when present). Errors name ``source`` and the key."""
    nested = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}

    def value(name: str, default: Any = None) -> Any:
        # dflash_config wins over the top level, as in the reference loader.
        return nested[name] if name in nested else raw.get(name, default)

    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
               if value(k) is None]
    if value("mask_token_id") is None:
        missing.append("mask_token_id (top level or dflash_config)")
    if missing:
        raise CheckpointError(f"{source}: missing required field(s) {', '.join(missing)}")
    try:
        hidden = int(value("hidden_size"))
        n_layers = int(value("num_hidden_layers"))
        heads = int(value("num_attention_heads"))
        kv_heads = int(value("num_key_value_heads", heads))
        head_dim = int(value("head_dim") or hidden // heads)
        block_size = int(value("block_size", 16))
        mask_id = int(value("mask_token_id"))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: a shape field is not an integer: {e}") from None
    if block_size < 2:
        raise CheckpointError(f"{source}: block_size {block_size} must be >= 2 (anchor + at least one draft)")
    if heads % kv_heads:
        raise CheckpointError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                              f"{kv_heads}")
    act = value("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (silu only)")

    layer_types = value("layer_types") or ["full_attention"] * n_layers
    if len(layer_types) != n_layers:
        raise CheckpointError(f"{source}: layer_types has {len(layer_types)} entries for {n_layers} layers")
    bad = sorted({t for t in layer_types if t not in _LAYER_TYPES})
    if bad:
        raise UnsupportedModelError(f"{source}: unsupported drafter layer type(s) {', '.join(bad)}")
    sliding = value("sliding_window")
    if "sliding_attention" in layer_types and not sliding:
        raise CheckpointError(f"{source}: sliding_attention layers need a positive 'sliding_window'")

    num_target = value("num_target_layers")
    ids = value("target_layer_ids")
    from_config = ids is not None
    if ids is None:
        ids = default_target_layer_ids(int(num_target or target_layers), n_layers)

    rope_params = value("rope_parameters") or {}
    rope_theta = value("rope_theta") or rope_params.get("rope_theta") or 10000.0
    rope_scaling = value("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type") not in (None, "default"):
        rope_scaling = rope_params
    partial = value("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0
    is_causal = value("is_causal")
    return DFlashConfig(
        hidden_size=hidden, intermediate_size=int(value("intermediate_size")), num_hidden_layers=n_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, block_size=block_size,
        mask_token_id=mask_id, target_layer_ids=[int(i) for i in ids], layer_types=list(layer_types),
        sliding_window=int(sliding) if sliding else None, rms_norm_eps=float(value("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta), rope_scaling=rope_scaling, partial_rotary_factor=float(partial),
        attention_bias=bool(value("attention_bias", False)),
        vocab_size=int(value("vocab_size")) if value("vocab_size") is not None else None,
        num_target_layers=int(num_target) if num_target is not None else None,
        tie_word_embeddings=bool(value("tie_word_embeddings", False)),
        is_causal=None if is_causal is None else bool(is_causal),
        input_embedding_scale=float(value("input_embedding_scale", 1.0)),
        target_layer_ids_from_config=from_config)


# ---- modules --------------------------------------------------------------------------------------------------
class DFlashAttention(nn.Module):
    """Block queries over [context keys, block keys]: Qwen3 q/k RMSNorm (``w * x̂``) before RoPE, GQA, no gate.

    The checkpoint's ``q_proj`` / ``k_proj`` / ``v_proj`` load as they are; :meth:`merge_projections` (after
    loading) turns them into one ``qkv_proj``, which the forward needs. Context rows use only its k | v rows.
    """

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = Linear(H, self.n_heads * self.hd, bias=bias)
        self.k_proj = Linear(H, self.n_kv * self.hd, bias=bias)
        self.v_proj = Linear(H, self.n_kv * self.hd, bias=bias)
        self.o_proj = Linear(self.n_heads * self.hd, H, bias=bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, zero_centred=False)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, zero_centred=False)
        self.eps = cfg.rms_norm_eps
        self.scale = self.hd ** -0.5
        self.qkv_proj: Linear | None = None

    def merge_projections(self) -> None:
        """One GEMM for q, k and v (a batch-1 block is weight-read bound: one launch instead of three), plus the q
        and k norm weights stacked per head, so one :func:`~edgespec.kernels.rope.head_norm_rope` norms and
        rotates every q and k head of the merged output."""
        self.qkv_proj = merge_linears(self, ["q_proj", "k_proj", "v_proj"])
        w = self.q_norm.weight.detach()
        qk = torch.cat([w.expand(self.n_heads, self.hd), self.k_norm.weight.detach().expand(self.n_kv, self.hd)])
        self.register_buffer("qk_norm_weight", qk, persistent=False)

    def context_kv(self, x: torch.Tensor) -> torch.Tensor:
        """Raw ``k | v`` projections ``[T, 2*Hkv*hd]`` of context rows ``x [T, H]``: the merged weight's last rows
        (a view: context and block share one copy of the weights)."""
        q_out = self.n_heads * self.hd
        bias = self.qkv_proj.bias
        return linear(x, self.qkv_proj.weight[q_out:], None if bias is None else bias[q_out:])

    def forward(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x [bs, H]`` with the rotary angles ``cs`` of its positions; ``keys``/``values [W+bs, Hkv, hd]`` (fp32)
        whose last ``bs`` rows are scratch for this block's own K/V; ``bias``: see
        :mod:`edgespec.kernels.block_attention`."""
        T, nh, nkv = x.shape[0], self.n_heads, self.n_kv
        heads = self.qkv_proj(x).view(T, nh + 2 * nkv, self.hd)
        # q_norm / k_norm (w * x̂, rounded as RMSNorm rounds) and RoPE of the q and k heads in one launch.
        qk = head_norm_rope(heads, nh + nkv, self.qk_norm_weight, *cs, self.eps)
        attn = block_attention(qk[:, :nh], qk[:, nh:], heads[:, nh + nkv:], keys, values, bias, self.scale)
        return self.o_proj(attn)


class DFlashLayer(nn.Module):
    """Pre-norm block: attention over context + block, then SwiGLU MLP."""

    def __init__(self, cfg: DFlashConfig, index: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False)
        self.causal = cfg.layer_causal(index)
        self.sliding_window = cfg.layer_window(index)


class DFlashDraftModel(nn.Module):
    """The drafter's weights under their checkpoint names (``fc``, ``hidden_norm``, ``layers.*``, ``norm`` and
    the optional ``embed_tokens`` / ``lm_head``; without both, the target's are borrowed)."""

    def __init__(self, cfg: DFlashConfig, target_hidden: int, embed_vocab: int | None = None,
                 head_vocab: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = Linear(len(cfg.target_layer_ids) * target_hidden, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps, zero_centred=False)
        self.layers = nn.ModuleList([DFlashLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps, zero_centred=False)
        self.embed_tokens = nn.Embedding(embed_vocab, H) if embed_vocab else None
        self.lm_head = Linear(H, head_vocab, bias=False) if head_vocab else None

    def context_features(self, taps: torch.Tensor) -> torch.Tensor:
        """``taps [T, n_taps, H_target]`` in ``target_layer_ids`` order -> context features ``[T, H]``."""
        return self.hidden_norm(self.fc(taps.reshape(taps.shape[0], -1)))


# ---- proposer -------------------------------------------------------------------------------------------------
class DFlashProposer(Proposer):
    """Drafts ``k <= block_size - 1`` tokens per cycle from one block forward over the cached context window.

    ``window_size`` (W): how many committed tokens' features the block attends to. ``window_seed``: fill the
    window from the last ``min(W, prompt)`` prompt tokens at prefill; when off, only the last prompt token's
    feature is kept (the block always needs the target's view of the position before the anchor), so the
    window fills from generated tokens. ``cuda_graphs``: run the block forward (+ lm_head + argmax) and the
    window append with their positions held on the device, so CUDA graphs captured at first use serve every
    position -- one for the block (every shape is static: bs queries, W + bs keys) and one per appended row
    count (1 .. bs); without CUDA the same path runs eagerly. The module docstring explains which token each
    feature belongs to.
    """

    name = "dflash"

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel, *, window_size: int = 128,
                 window_seed: bool = True, cuda_graphs: bool = False) -> None:
        cfg = drafter.cfg
        if drafter.layers[0].self_attn.qkv_proj is None:
            # The forward below runs on merged projections (q/k/v, gate/up); the loader has loaded the checkpoint
            # under its own names by now, so merging here keeps those names loadable.
            merge_all_projections(drafter)
        self.drafter = drafter.eval().requires_grad_(False)
        self.target = target
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.default_k = self.max_k = cfg.block_size - 1
        self.window_seed = window_seed
        # Unique tap ids for the session (one capture per layer), and how to lay them out in config order.
        self.taps = tuple(dict.fromkeys(cfg.target_layer_ids))
        order = [self.taps.index(i) for i in cfg.target_layer_ids]
        self._tap_order: list[int] | None = None if order == list(range(len(self.taps))) else order
        device, dtype = target.device, drafter.fc.weight.dtype
        self.dtype = dtype
        # Block positions reach past the target's last cache row by up to bs-1.
        max_pos = target.rope.cos.shape[0] + cfg.block_size
        self.rope = RotaryEmbedding(cfg.model_config(max_pos), max_pos).to(device)
        # fp32 window: block attention keeps fp32 scores and probabilities (see edgespec.kernels.block_attention)
        # and reads the cached K/V as they are, with no cast per layer and cycle. Features and K/V are rounded to
        # the drafter dtype before they get here, which is what lets the CUDA kernel narrow them back exactly.
        self.window = FeatureWindow(window_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                    cfg.head_dim, torch.float32, device, scratch_rows=cfg.block_size)
        # Every layer's k_norm weight, so one head_norm_rope serves the context keys of all layers.
        self._context_k_norm = torch.stack([layer.self_attn.k_norm.weight for layer in drafter.layers])[:, None, None]
        self._block_ids = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long, device=device)
        self._block_offsets = torch.arange(cfg.block_size, device=device)
        self._embed_weight = (drafter.embed_tokens if drafter.embed_tokens is not None
                              else target.model.embed_tokens).weight
        if drafter.lm_head is not None:
            self._head_weight = drafter.lm_head.weight
        elif drafter.embed_tokens is not None and cfg.tie_word_embeddings:
            self._head_weight = drafter.embed_tokens.weight
        else:
            self._head_weight = target.lm_head_weight
        self.history: list[int] = []     # prompt + emitted tokens; the window covers history[end-length : end]
        # Head output of the last propose in the head's dtype (see last_logits); in graph mode a view of the static
        # output, valid until the next propose.
        self._last_scores: torch.Tensor | None = None
        # Graph mode: the block start lives on the device; the graph and its output buffers are made lazily.
        self.cuda_graphs = cuda_graphs
        self._pos = torch.zeros(1, dtype=torch.long, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static_out: tuple[torch.Tensor, torch.Tensor] | None = None
        self._append_pos = torch.zeros(1, dtype=torch.long, device=device)
        self._append_in: dict[int, torch.Tensor] = {}                # row count -> static taps input
        self._append_graphs: dict[int, torch.cuda.CUDAGraph] = {}    # row count -> captured append

    @property
    def window_size(self) -> int:
        return self.window.capacity

    @property
    def resume_rows(self) -> int:
        """A resumed prefill must still cover the prompt rows :meth:`begin` seeds the window with."""
        return self.window.capacity if self.window_seed else 1

    @property
    def last_logits(self) -> torch.Tensor | None:
        """Float32 draft logits ``[k, V]`` of the last propose (telemetry, tests), valid until the next propose.
        Converted on access: drafting itself needs only the argmax, which the head's own dtype gives exactly."""
        return None if self._last_scores is None else self._last_scores.float()

    # -- protocol -----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.window.reset()
        self.history = []
        self._last_scores = None

    @torch.inference_mode()
    def begin(self, prompt_ids: Sequence[int], prefill: ForwardOutput) -> None:
        self.reset()
        self.history = list(prompt_ids)
        n = len(self.history)
        keep = min(self.window.capacity, n) if self.window_seed else 1
        # The prefill covers the last ``rows`` prompt positions (all of them unless a cached prefix was resumed).
        taps = self._require_taps(prefill, keep, "prefill")
        rows = taps.shape[0]
        self._append(taps[rows - keep:rows], n - keep)

    @torch.inference_mode()
    def commit(self, tokens: Sequence[int], accepted: int, verify: ForwardOutput | None,
               drafted: int = 0) -> None:
        if verify is not None:
            # Rows 0 .. accepted of the forward are [previous anchor, accepted drafts]: the tokens at positions
            # end .. end+accepted, now in the target cache.
            rows = accepted + 1
            taps = self._require_taps(verify, rows, "verify")
            self._append(taps[:rows], self.window.end)
        self.history.extend(int(t) for t in tokens)

    @torch.inference_mode()
    def propose(self, last_token: int, k: int) -> Draft | None:
        if not self.history or self.history[-1] != last_token or len(self.history) != self.window.end + 1:
            raise RuntimeError("dflash proposer out of step with the session: every emitted token must be "
                               "committed once, in order, before the next propose")
        k = min(k, self.block_size - 1)
        if self.cuda_graphs:
            scores, tokens = self._run_static(last_token)
            # Views of static buffers the next replay overwrites: the session copies the drafts into its verify
            # rows before that, and last_logits is documented as valid until the next propose.
            scores, tokens = scores[:k], tokens[:k]
        else:
            scores = self._head(self.block_hidden(last_token)[1:1 + k])
            tokens = scores.argmax(-1)
        self._last_scores = scores
        return Draft(tokens)

    # -- drafter forward ------------------------------------------------------------------------------------------
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed block rows -> float32 logits with the head in use (own or the target's)."""
        return self._head(hidden).float()

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's output in its own dtype. Drafts are its argmax, the same token as the argmax of the float32
        logits (the conversion is exact and keeps the order), without writing and reading back a float32 copy of
        ``[bs-1, V]`` each cycle (15 MB for a 248k vocabulary)."""
        return linear(hidden.to(self._head_weight.dtype), self._head_weight)

    @torch.inference_mode()
    def block_hidden(self, anchor: int) -> torch.Tensor:
        """Final-normed hidden states ``[bs, H]`` of the block ``[anchor, MASK x (bs-1)]`` at positions
        ``end .. end+bs-1`` attending to the cached window (row 0 is the anchor; rows 1.. give the drafts)."""
        self._block_ids[0] = anchor
        return self._block_forward(self.window.end, None)

    def _block_forward(self, start: int, pos_t: torch.Tensor | None) -> torch.Tensor:
        """The block forward over ``self._block_ids`` at ``start`` (or the device position ``pos_t``)."""
        h = gather_rows(self._embed_weight, self._block_ids).to(self.dtype)
        if self.cfg.input_embedding_scale != 1.0:
            h = h * self.cfg.input_embedding_scale
        biases = self._attn_biases(start, pos_t)
        keys, values = self.window.keys, self.window.values
        delta = None     # the residual stream as (h, delta), adds fused with the next norm (see DecoderLayer)
        cs = self.rope.angles(start, h.shape[0], pos_t, h.dtype)      # block rows: queries and own keys alike
        for i, layer in enumerate(self.drafter.layers):
            if delta is None:
                x = layer.input_layernorm(h)
            else:
                h, x = layer.input_layernorm.add_forward(delta, h)
            bias = biases[(layer.causal, layer.sliding_window)]
            attn = layer.self_attn(x, keys[i], values[i], bias, cs)
            h, y = layer.post_attention_layernorm.add_forward(attn, h)
            delta = layer.mlp(y)
        return self.drafter.norm.add_forward(delta, h)[1]

    # -- graph mode ---------------------------------------------------------------------------------------------
    def _static_draft(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Graph body: all ``bs-1`` draft scores (head dtype) and tokens of the block at the device position."""
        scores = self._head(self._block_forward(0, self._pos)[1:])
        return scores, row_argmax(scores)

    def _run_static(self, anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Host -> device writes, no sync. A fill of a one-element view: item assignment (``ids[0] = anchor``) goes
        # through torch's indexing machinery, tens of microseconds of host time in front of the block's launch.
        self._block_ids[:1].fill_(anchor)
        self._pos.fill_(self.window.end)
        if self.target.device.type != "cuda":
            return self._static_draft()  # CPU: the same device-position path, eagerly (tests cover it)
        if self._graph is None:
            self._capture()
        self._graph.replay()
        return self._static_out

    def _capture(self) -> None:
        # The block forward writes only the scratch K/V rows, so warming up and capturing mid-request leave the
        # window untouched.
        self._graph, self._static_out = capture_graph(self._static_draft)

    def _append_body(self, rows: int) -> None:
        """Graph body of an append of ``rows`` tap rows from the static input at the device position."""
        feats, keys, values = self._context_kv(self._append_in[rows], 0, self._append_pos)
        self.window.write_at(self._append_pos, feats, keys, values)

    def _append_static(self, taps: torch.Tensor, start: int) -> None:
        rows = taps.shape[0]
        self.window.check_next(start)
        buf = self._append_in.get(rows)
        if buf is None:
            buf = self._append_in[rows] = torch.empty_like(taps)
        buf.copy_(taps)
        self._append_pos.fill_(start)
        if self.target.device.type != "cuda":
            self._append_body(rows)
        else:
            graph = self._append_graphs.get(rows)
            if graph is None:
                # Warm-up runs write exactly the rows this append writes (same input, same position), so
                # capturing on first use is harmless; the replay below writes them once more.
                graph = self._append_graphs[rows] = capture_graph(lambda: self._append_body(rows))[0]
            # Replayed at once: the session commits at the start of the draft stage, so the device runs the
            # append while the host prepares the propose.
            graph.replay()
        self.window.advance(start, rows)

    def _attn_biases(self, start: int, pos_t: torch.Tensor | None = None
                     ) -> dict[tuple[bool, int | None], torch.Tensor]:
        """One additive fp32 mask ``[rep*bs, W+bs]`` (0 = attend, -inf = not) per distinct layer kind, built once
        per forward from absolute positions (the reference's rule: causal -> key <= query; sliding window ->
        query - key < window, and key - query < window when not causal). Empty ring slots (position -1) are never
        visible. Rows repeat per query head of a KV group, the layout
        :func:`~edgespec.kernels.block_attention.block_attention` takes."""
        q_pos = (start if pos_t is None else pos_t) + self._block_offsets
        key_pos = torch.cat([self.window.positions, q_pos])
        valid = (key_pos >= 0)[None, :].expand(q_pos.shape[0], -1)       # block positions are never negative
        dist = q_pos[:, None] - key_pos[None, :]
        rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        out: dict[tuple[bool, int | None], torch.Tensor] = {}
        for layer in self.drafter.layers:
            kind = (layer.causal, layer.sliding_window)
            if kind in out:
                continue
            causal, window = kind
            visible = valid
            if causal:
                visible = visible & (dist >= 0)
            if window is not None:
                visible = visible & (dist < window)
                if not causal:
                    visible = visible & (-dist < window)
            out[kind] = torch.where(visible, 0.0, float("-inf")).repeat(rep, 1)
        return out

    def _append(self, taps: torch.Tensor, start: int) -> None:
        """Turn tap rows of positions ``start ..`` into features, their per-layer K/V, and store them."""
        W = self.window.capacity
        if self.cuda_graphs and taps.shape[0] <= min(W, self.block_size):   # a cycle's rows (not the seed)
            self._append_static(taps, start)
            return
        if taps.shape[0] > W:          # only the newest W survive the append: skip computing the rest
            start += taps.shape[0] - W
            taps = taps[-W:]
        self.window.append(start, *self._context_kv(taps, start))

    def _context_kv(self, taps: torch.Tensor, start: int, pos_t: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tap rows of positions ``start ..`` (or ``pos_t[0] ..``) -> context features ``[T, H]`` and every drafter
        layer's keys and values ``[layers, T, Hkv, hd]``. One k|v GEMM per layer; the k norms and the rotation
        then run once over all layers' stacked keys, with one set of rotary angles."""
        if self._tap_order is not None:
            taps = taps[:, self._tap_order]
        feats = self.drafter.context_features(taps.to(self.dtype))
        T, nkv = feats.shape[0], self.cfg.num_key_value_heads
        cs = self.rope.angles(start, T, pos_t, feats.dtype)
        kv = torch.stack([layer.self_attn.context_kv(feats) for layer in self.drafter.layers])
        kv = kv.view(len(self.drafter.layers), T, 2 * nkv, self.cfg.head_dim)
        keys = head_norm_rope(kv, nkv, self._context_k_norm, *cs, self.cfg.rms_norm_eps)
        return feats, keys, kv[:, :, nkv:]

    def _require_taps(self, out: ForwardOutput, rows: int, what: str) -> torch.Tensor:
        if out.taps is None or out.taps.shape[1] != len(self.taps):
            raise RuntimeError(f"dflash needs the {what} forward to capture target layers {self.taps}; got "
                               f"{None if out.taps is None else out.taps.shape[1]} tapped layer(s)")
        if out.taps.shape[0] < rows:
            raise RuntimeError(f"dflash needs {rows} tapped row(s) from the {what} forward, got {out.taps.shape[0]}")
        return out.taps

    # -- inspection (tests, debugging) -------------------------------------------------------------------------------
    def window_tokens(self) -> list[int]:
        """Token ids whose features the window holds, oldest first."""
        return self.history[self.window.end - self.window.length:self.window.end]


# ---- loading --------------------------------------------------------------------------------------------------
def _checkpoint_index(files: list[Path]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Checkpoint key -> (our parameter name with ``model.`` stripped, shape), from the file headers only;
    ``rotary_emb.*`` (derived, not weights) is left out."""
    index: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    name = key[len("model."):] if key.startswith("model.") else key
                    if "rotary_emb." not in name:
                        index[key] = (name, tuple(f.get_slice(key).get_shape()))
        except Exception as e:  # a corrupt header: name the file
            raise CheckpointError(f"cannot read weights from {path}: {e} (truncated or corrupt file?)") from None
    return index


def _check_fit(cfg: DFlashConfig, target: TargetModel, shapes: dict[str, tuple[int, ...]],
               folder: Path) -> tuple[int | None, int | None]:
    """Raise ConfigError when the drafter cannot run with this target; returns (own embed vocab, own head vocab)."""
    tcfg = target.config
    where = f"DFlash drafter {folder}"
    n_target = tcfg.num_hidden_layers
    if cfg.num_target_layers is not None and cfg.num_target_layers != n_target:
        raise ConfigError(f"{where} was trained for a target with {cfg.num_target_layers} layers, but the target "
                          f"({tcfg.model_type}) has {n_target}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < n_target]
    if bad:
        raise ConfigError(f"{where}: target_layer_ids {cfg.target_layer_ids} include {bad}, outside the target's "
                          f"layers 0..{n_target - 1}")
    embed_vocab = shapes["embed_tokens.weight"][0] if "embed_tokens.weight" in shapes else None
    head_vocab = shapes["lm_head.weight"][0] if "lm_head.weight" in shapes else None
    borrows = embed_vocab is None or (head_vocab is None and not cfg.tie_word_embeddings)
    if borrows and cfg.hidden_size != tcfg.hidden_size:
        raise ConfigError(f"{where}: hidden_size {cfg.hidden_size} does not match the target's "
                          f"{tcfg.hidden_size} (the drafter borrows the target's embedding / lm_head)")
    if borrows and cfg.vocab_size is not None and cfg.vocab_size != tcfg.vocab_size:
        raise ConfigError(f"{where}: vocab_size {cfg.vocab_size} does not match the target's {tcfg.vocab_size} "
                          f"(a drafter for another tokenizer?)")
    vocab = embed_vocab if embed_vocab is not None else tcfg.vocab_size
    if not 0 <= cfg.mask_token_id < vocab:
        raise ConfigError(f"{where}: mask_token_id {cfg.mask_token_id} is outside the embedding's vocabulary "
                          f"of {vocab} tokens")
    out_vocab = head_vocab or (embed_vocab if cfg.tie_word_embeddings else None)
    if out_vocab is not None and out_vocab > tcfg.vocab_size:
        raise ConfigError(f"{where}: its lm_head scores {out_vocab} tokens, more than the target's vocabulary "
                          f"of {tcfg.vocab_size}")
    return embed_vocab, head_vocab


def _drafter_dtype(target: TargetModel) -> torch.dtype:
    # fp16 overflows on hidden-state outliers and collapses acceptance: such targets get a bf16 drafter.
    return torch.bfloat16 if target.dtype == torch.float16 else target.dtype


def load_dflash_checkpoint(folder: str | Path, target: TargetModel, *, window_size: int = 128,
                           window_seed: bool = True, cuda_graphs: bool = False) -> DFlashProposer:
    """Load a DFlash drafter folder (``config.json`` + safetensors) for ``target``, checking that they fit.

    Raises :class:`CheckpointError` for missing / unreadable files, missing or unexpected keys and shape
    mismatches, and :class:`ConfigError` when the drafter was made for another target (hidden size,
    vocabulary, mask id, tap layers, layer count).
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"DFlash drafter folder not found: {folder}")
    raw = read_json(folder / "config.json")
    cfg = parse_dflash_config(raw, target.config.num_hidden_layers, source=str(folder / "config.json"))
    files = weight_files(folder)
    index = _checkpoint_index(files)
    key_names = {key: name for key, (name, _) in index.items()}
    embed_vocab, head_vocab = _check_fit(cfg, target, dict(index.values()), folder)

    dtype, device = _drafter_dtype(target), target.device
    with torch.device("meta"):
        drafter = DFlashDraftModel(cfg, target.config.hidden_size, embed_vocab, head_vocab)
    drafter = drafter.to_empty(device=device).to(dtype)
    fc_hint = f" (= {len(cfg.target_layer_ids)} taps x target hidden {target.config.hidden_size})"
    problems = load_parameters(dict(drafter.named_parameters()), files, key_names.get,
                               lambda name: fc_hint if name == "fc.weight" else "")
    if problems:
        raise CheckpointError(f"DFlash drafter {folder} does not fit its config: " + " | ".join(problems))
    # Loaded under the checkpoint's names; the proposer merges q/k/v and gate/up (+ fused SiLU), as in the target.
    return DFlashProposer(drafter, target, window_size=window_size, window_seed=window_seed, cuda_graphs=cuda_graphs)


def load_dflash(settings: Settings, model: TargetModel) -> DFlashProposer:
    """Build the DFlash proposer named by ``settings`` (``drafter_path``, ``window_size``, ``window_seed``,
    ``cuda_graphs``; None takes the arch default of ``settings.arch`` on the model's device)."""
    if not settings.drafter_path:
        raise ConfigError("drafter dflash needs drafter_path (--drafter-path / EDGESPEC_DRAFTER_PATH): the "
                          "DFlash checkpoint folder")
    from edgespec.arch.detect import select_hooks

    defaults = select_hooks(settings.arch, model.device).defaults
    seed = defaults.window_seed if settings.window_seed is None else settings.window_seed
    graphs = defaults.cuda_graphs if settings.cuda_graphs is None else settings.cuda_graphs
    # None: the arch default, like window_seed and cuda_graphs.
    size = defaults.window_size if settings.window_size is None else settings.window_size
    proposer = load_dflash_checkpoint(settings.drafter_path, model, window_size=size, window_seed=seed,
                                      cuda_graphs=graphs)
    k = settings.num_draft_tokens
    if k is not None and k > proposer.max_k:
        raise ConfigError(f"num_draft_tokens {k} exceeds what the DFlash drafter can draft in one block "
                          f"(block_size {proposer.block_size} -> at most {proposer.max_k})")
    return proposer


__all__ = ["DFlashConfig", "DFlashDraftModel", "DFlashProposer", "default_target_layer_ids", "load_dflash",
           "load_dflash_checkpoint", "parse_dflash_config"]
