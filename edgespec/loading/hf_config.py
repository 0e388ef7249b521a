"""Parse a Hugging Face ``config.json`` (and ``generation_config.json``) into a :class:`ModelConfig`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgespec.errors import CheckpointError, UnsupportedModelError
from edgespec.models.config import ModelConfig, VisionConfig

# model_type -> implementation family
_FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "qwen3",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
}
# Mixture-of-experts model types edgespec runs (edgespec.models.moe); other MoE types are refused by name.
_MOE_SUPPORTED = {"qwen3_5_moe", "qwen3_5_moe_text"}
_MOE_TYPES = {"qwen3_moe", "qwen3_next", "mixtral", "deepseek_v3"}
_MOE_REQUIRED = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object; errors name the file."""
    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Map a HF config dict (text part possibly under ``text_config``) to a ModelConfig."""
    model_type = raw.get("model_type")
    if model_type is None:
        raise CheckpointError(f"{source}: missing required field 'model_type'")
    has_experts = raw.get("num_experts") or (raw.get("text_config") or {}).get("num_experts")
    if model_type in _MOE_TYPES or (has_experts and model_type not in _MOE_SUPPORTED):
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is a mixture-of-experts model; of those edgespec runs "
            f"{', '.join(sorted(_MOE_SUPPORTED))} only")
    if model_type not in _FAMILIES:
        raise UnsupportedModelError(
            f"{source}: unknown model_type {model_type!r}; supported: {', '.join(sorted(_FAMILIES))}")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    moe = model_type in _MOE_SUPPORTED
    # An MoE config has no dense intermediate_size: the shared expert's width stands for it (workspace sizing).
    required = [k for k in _REQUIRED if k != "intermediate_size"] + list(_MOE_REQUIRED) if moe else _REQUIRED
    missing = [k for k in required if k not in text]
    if missing:
        raise CheckpointError(f"{source}: missing required field(s) {', '.join(missing)}")
    family = _FAMILIES[model_type]
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    n_layers = int(text["num_hidden_layers"])
    rope = text.get("rope_parameters") or {}
    rope_scaling = text.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    layer_types = _layer_types(text, family, n_layers, source)
    # The VLM wrapper of Qwen3.5 keeps tie_word_embeddings at the top level; text-only configs keep it inside.
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    cfg = ModelConfig(
        family=family,
        model_type=model_type,
        vocab_size=int(text["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(text["shared_expert_intermediate_size" if moe else "intermediate_size"]),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        rope_scaling=rope_scaling,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(tie),
        attention_bias=bool(text.get("attention_bias", False)),
        mlp_bias=bool(text.get("mlp_bias", False)),
        layer_types=list(layer_types or []),
        linear_num_key_heads=int(text.get("linear_num_key_heads", 0)),
        linear_num_value_heads=int(text.get("linear_num_value_heads", 0)),
        linear_key_head_dim=int(text.get("linear_key_head_dim", 0)),
        linear_value_head_dim=int(text.get("linear_value_head_dim", 0)),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        linear_value_head_order=text.get("linear_value_head_order", "grouped"),
        mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0)),
        num_experts=int(text["num_experts"]) if moe else 0,
        num_experts_per_tok=int(text["num_experts_per_tok"]) if moe else 0,
        moe_intermediate_size=int(text["moe_intermediate_size"]) if moe else 0,
        shared_expert_intermediate_size=int(text["shared_expert_intermediate_size"]) if moe else 0,
        # Qwen3.5 MoE always renormalises the top-k weights (transformers has no flag for it); honour one if set.
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
        eos_token_ids=_as_id_list(text.get("eos_token_id", raw.get("eos_token_id"))),
        torch_dtype=text.get("dtype") or text.get("torch_dtype") or raw.get("torch_dtype"),
    )
    cfg.mrope_section, cfg.mrope_interleaved = _mrope(rope or text.get("rope_scaling") or {}, cfg, source)
    cfg.vision = _vision_config(raw, source)
    if heads % cfg.num_key_value_heads:
        raise CheckpointError(f"{source}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {cfg.num_key_value_heads}")
    if family == "qwen3_5":
        _check_hybrid(cfg, source)
    if moe:
        _check_moe(cfg, source)
    return cfg


def _mrope(rope: dict[str, Any], cfg: ModelConfig, source: str) -> tuple[list[int] | None, bool]:
    """The multimodal RoPE sections (frequency pairs per t/h/w axis), checked against the rotary width."""
    section = rope.get("mrope_section")
    if section is None:
        return None, True
    section = [int(s) for s in section]
    if len(section) != 3 or any(s < 0 for s in section) or 2 * sum(section) != cfg.rotary_dim:
        raise CheckpointError(f"{source}: mrope_section {section} must be three sizes summing to half the rotary "
                              f"dimension ({cfg.rotary_dim // 2})")
    return section, bool(rope.get("mrope_interleaved", True))


_VISION_REQUIRED = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")


def _vision_config(raw: dict[str, Any], source: str) -> VisionConfig | None:
    """The ``vision_config`` of a vision-language checkpoint (None for a text-only one)."""
    vis = raw.get("vision_config")
    if not isinstance(vis, dict):
        return None
    missing = [k for k in _VISION_REQUIRED if k not in vis]
    if missing or "image_token_id" not in raw:
        raise CheckpointError(f"{source}: vision_config lacks {', '.join(missing or ['image_token_id'])}")
    rope = vis.get("rope_parameters") or {}
    out = VisionConfig(
        depth=int(vis["depth"]), hidden_size=int(vis["hidden_size"]), intermediate_size=int(vis["intermediate_size"]),
        num_heads=int(vis["num_heads"]), out_hidden_size=int(vis["out_hidden_size"]),
        patch_size=int(vis.get("patch_size", 16)), temporal_patch_size=int(vis.get("temporal_patch_size", 2)),
        spatial_merge_size=int(vis.get("spatial_merge_size", 2)), in_channels=int(vis.get("in_channels", 3)),
        num_position_embeddings=int(vis.get("num_position_embeddings", 2304)),
        hidden_act=str(vis.get("hidden_act", "gelu_pytorch_tanh")),
        rope_theta=float(rope.get("rope_theta", vis.get("rope_theta", 10000.0))),
        deepstack_visual_indexes=[int(i) for i in vis.get("deepstack_visual_indexes") or []],
        image_token_id=int(raw["image_token_id"]),
        vision_start_token_id=int(raw.get("vision_start_token_id", -1)),
        vision_end_token_id=int(raw.get("vision_end_token_id", -1)))
    if out.hidden_size % out.num_heads or (out.head_dim // 2) % 2:
        raise CheckpointError(f"{source}: vision hidden_size {out.hidden_size} over {out.num_heads} heads must give "
                              "a head dimension divisible by 4 (2-D rotary positions)")
    if int(out.num_position_embeddings ** 0.5) ** 2 != out.num_position_embeddings:
        raise CheckpointError(f"{source}: vision num_position_embeddings {out.num_position_embeddings} is not a "
                              "square grid")
    if out.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
        raise UnsupportedModelError(f"{source}: vision hidden_act {out.hidden_act!r} is not supported")
    return out


def _layer_types(text: dict[str, Any], family: str, n_layers: int, source: str) -> list[str] | None:
    """The config's ``layer_types`` (a hybrid without them: every ``full_attention_interval``-th layer attends),
    checked against the layer count and the family."""
    layer_types = text.get("layer_types")
    if family == "qwen3_5" and not layer_types:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if layer_types is not None:
        if len(layer_types) != n_layers:
            raise CheckpointError(f"{source}: layer_types has {len(layer_types)} entries for {n_layers} layers")
        bad = sorted({t for t in layer_types if t not in ("full_attention", "linear_attention")})
        if bad:
            raise UnsupportedModelError(f"{source}: unsupported layer type(s) {', '.join(bad)}")
        if family != "qwen3_5" and "linear_attention" in layer_types:
            raise UnsupportedModelError(f"{source}: linear_attention layers need model_type qwen3_5")
    return layer_types


def _check_hybrid(cfg: ModelConfig, source: str) -> None:
    """A Gated DeltaNet hybrid names its linear-attention head counts and sizes."""
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
        if getattr(cfg, key) <= 0:
            raise CheckpointError(f"{source}: missing required field {key!r} for a qwen3_5 model")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise CheckpointError(f"{source}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    if cfg.linear_value_head_order not in ("grouped", "tiled"):
        raise CheckpointError(f"{source}: linear_value_head_order {cfg.linear_value_head_order!r} must be "
                              "'grouped' or 'tiled'")


def _check_moe(cfg: ModelConfig, source: str) -> None:
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(cfg, key) <= 0:
            raise CheckpointError(f"{source}: {key} must be positive, got {getattr(cfg, key)}")
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise CheckpointError(f"{source}: num_experts_per_tok {cfg.num_experts_per_tok} exceeds num_experts "
                              f"{cfg.num_experts}")


def load_config(folder: Path) -> ModelConfig:
    """Read ``folder/config.json`` and merge stop ids from ``generation_config.json`` when present."""
    path = folder / "config.json"
    cfg = parse_config(read_json(path), source=str(path))
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        gen = read_json(gen_path)
        ids = _as_id_list(gen.get("eos_token_id"))
        cfg.eos_token_ids = list(dict.fromkeys(ids + cfg.eos_token_ids))
    return cfg
