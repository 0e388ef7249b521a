"""The DFlash drafter network and its config (public z-lab checkpoint format): parameter names, shapes and the
``config.json`` rules. The proposer (:mod:`edgespec.drafters.dflash_proposer`) runs it at inference; the loader
(:mod:`edgespec.drafters.dflash_loader`) fills it from a checkpoint; ``edgespec distill`` trains it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edgespec.errors import CheckpointError, UnsupportedModelError
from edgespec.kernels.attention.block_attention import block_attention
from edgespec.kernels.attention.rope import head_norm_rope
from edgespec.kernels.quant.linear import linear
from edgespec.models.config import ModelConfig
from edgespec.models.layers import MLP, Linear, RMSNorm, merge_linears
from edgespec.weights.base import is_packed

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
    max_position_embeddings: int | None = None   # YaRN without a factor derives it from this

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
            max_position_embeddings=self.max_position_embeddings or max_positions,
            attention_bias=self.attention_bias)


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
        target_layer_ids_from_config=from_config,
        max_position_embeddings=int(value("max_position_embeddings")) if value("max_position_embeddings") else None)


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
        and k norm weights stacked per head, so one :func:`~edgespec.kernels.attention.rope.head_norm_rope` norms and
        rotates every q and k head of the merged output."""
        self.qkv_proj = merge_linears(self, ["q_proj", "k_proj", "v_proj"])
        w = self.q_norm.weight.detach()
        qk = torch.cat([w.expand(self.n_heads, self.hd), self.k_norm.weight.detach().expand(self.n_kv, self.hd)])
        self.register_buffer("qk_norm_weight", qk, persistent=False)

    def context_kv(self, x: torch.Tensor) -> torch.Tensor:
        """Raw ``k | v`` projections ``[T, 2*Hkv*hd]`` of context rows ``x [T, H]``: the merged weight's last rows
        (a view: context and block share one copy of the weights). A packed (quantized) weight has no row view:
        the whole product runs and its k | v columns are kept."""
        q_out = self.n_heads * self.hd
        if is_packed(self.qkv_proj.weight):
            return self.qkv_proj(x)[:, q_out:]
        bias = self.qkv_proj.bias
        return linear(x, self.qkv_proj.weight[q_out:], None if bias is None else bias[q_out:])

    def forward(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x [bs, H]`` with the rotary angles ``cs`` of its positions; ``keys``/``values [W+bs, Hkv, hd]`` (fp32)
        whose last ``bs`` rows are scratch for this block's own K/V; ``bias``: see
        :mod:`edgespec.kernels.attention.block_attention`."""
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

    def context_k_norm(self) -> torch.Tensor:
        """Every layer's context-key norm weight stacked ``[layers, 1, 1, hd]``, so one :func:`head_norm_rope`
        normalises and rotates the context keys of all layers (callers that run it per cycle keep this)."""
        return torch.stack([layer.self_attn.k_norm.weight for layer in self.layers])[:, None, None]

    def context_kv(self, taps: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor], k_norm: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tap rows ``[T, n_taps, H_target]`` (config order, model dtype) -> context features ``[T, H]`` and every
        layer's keys and values ``[layers, T, Hkv, hd]``, the keys normed (``k_norm``, :meth:`context_k_norm`) and
        rotated by ``cs`` (the rows' angles). Context K/V skip the residual stream, so they depend only on the
        feature: one k|v GEMM per layer, then the norms and the rotation once over all layers' stacked keys."""
        feats = self.context_features(taps)
        T, nkv = feats.shape[0], self.cfg.num_key_value_heads
        kv = torch.stack([layer.self_attn.context_kv(feats) for layer in self.layers])
        kv = kv.view(len(self.layers), T, 2 * nkv, self.cfg.head_dim)
        keys = head_norm_rope(kv, nkv, k_norm, *cs, self.cfg.rms_norm_eps)
        return feats, keys, kv[:, :, nkv:]

    def attn_biases(self, q_pos: torch.Tensor, key_pos: torch.Tensor) -> dict[tuple[bool, int | None], torch.Tensor]:
        """One additive fp32 mask ``[rep*bs, keys]`` (0 = attend, -inf = not) per distinct layer kind, from the
        block's absolute query positions ``q_pos`` and the keys' ``key_pos`` (the reference's rule: causal -> key
        <= query; sliding window -> query - key < window, and key - query < window when not causal). Keys at a
        negative position (empty window slots) are never visible. Rows repeat per query head of a KV group, the
        layout :func:`~edgespec.kernels.attention.block_attention.block_attention` takes."""
        valid = (key_pos >= 0)[None, :].expand(q_pos.shape[0], -1)       # block positions are never negative
        dist = q_pos[:, None] - key_pos[None, :]
        rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        out: dict[tuple[bool, int | None], torch.Tensor] = {}
        for layer in self.layers:
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

    def block_forward(self, h: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                      biases: dict[tuple[bool, int | None], torch.Tensor], cs: tuple[torch.Tensor, torch.Tensor]
                      ) -> torch.Tensor:
        """The layer stack over the block's input embeddings ``h [bs, H]``: each layer's queries attend to its
        context ``keys[i]`` / ``values[i]`` and the block's own keys under ``biases`` (:meth:`attn_biases`), with
        the block rows' rotary angles ``cs``. Returns the final-normed hidden states ``[bs, H]``. The residual
        stream is carried as ``(h, delta)`` with each add fused into the next norm (see ``DecoderLayer``). On the
        CPU the whole stack is one compiled call (:func:`edgespec.models.cpu_stack.drafter_block_forward`)."""
        if h.device.type == "cpu":
            from edgespec.models.cpu_stack import drafter_block_forward
            out = drafter_block_forward(self, h, keys, values,
                                        [biases[(layer.causal, layer.sliding_window)] for layer in self.layers], cs)
            if out is not None:
                return out
        delta = None
        for i, layer in enumerate(self.layers):
            if delta is None:
                x = layer.input_layernorm(h)
            else:
                h, x = layer.input_layernorm.add_forward(delta, h)
            attn = layer.self_attn(x, keys[i], values[i], biases[(layer.causal, layer.sliding_window)], cs)
            h, y = layer.post_attention_layernorm.add_forward(attn, h)
            delta = layer.mlp(y)
        return self.norm.add_forward(delta, h)[1]


__all__ = ["DFlashAttention", "DFlashConfig", "DFlashDraftModel", "DFlashLayer", "default_target_layer_ids",
           "parse_dflash_config"]
