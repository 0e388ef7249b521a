"""Random-weight checkpoints in the Hugging Face layout, for tests and for benchmarks of real model shapes.

No hub access is possible at run time, so tests write tiny checkpoints themselves and ``edgespec bench`` builds
full-size random models (the speed of a batch-1 decode does not depend on the weight values).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from edgespec.loading.hf_config import parse_config
from edgespec.models.decoder import TargetModel

# Published shapes (see shared/reference/qwen35.md and the Qwen3 / SmolLM2 configs).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3.5-0.8b": dict(model_type="qwen3_5_text", hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
                         num_key_value_heads=2, intermediate_size=3584, linear_num_key_heads=16,
                         linear_num_value_heads=16, tie_word_embeddings=True),
    "qwen3.5-4b": dict(model_type="qwen3_5_text", hidden_size=2560, num_hidden_layers=32, num_attention_heads=16,
                       num_key_value_heads=4, intermediate_size=9216, linear_num_key_heads=16,
                       linear_num_value_heads=32, tie_word_embeddings=True),
    "qwen3.5-9b": dict(model_type="qwen3_5_text", hidden_size=4096, num_hidden_layers=32, num_attention_heads=16,
                       num_key_value_heads=4, intermediate_size=12288, linear_num_key_heads=16,
                       linear_num_value_heads=32, tie_word_embeddings=False),
    "qwen3.5-27b": dict(model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
                        num_key_value_heads=4, intermediate_size=17408, linear_num_key_heads=16,
                        linear_num_value_heads=48, tie_word_embeddings=False),
    # Qwen3.8-27B: Qwen3.5/3.6-27B's text model (Qwen3_5ForConditionalGeneration, model_type qwen3_5, 64 layers
    # 3:1 Gated DeltaNet to gated attention, one MTP layer, 262k positions), served text-only.
    "qwen3.8-27b": dict(model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
                        num_key_value_heads=4, intermediate_size=17408, linear_num_key_heads=16,
                        linear_num_value_heads=48, tie_word_embeddings=False, mtp_num_hidden_layers=1),
    # The MoE hybrid (Qwen3.5/3.6-35B-A3B): 256 experts, 8 routed + 1 shared, expert width 512.
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, linear_num_key_heads=16,
                            linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512,
                            tie_word_embeddings=False),
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936,
                     tie_word_embeddings=True, rope_theta=1e6),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                     tie_word_embeddings=False, rope_theta=1e6),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5),
    # The llama shape of the llama.cpp peer run (tools/peer_llamacpp.sh, tools/peer_gguf.py): Llama-3.2-3B's
    # layers with SmolLM2's vocabulary, untied head.
    "peer-llama": dict(model_type="llama", hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                       num_key_value_heads=8, intermediate_size=8192, vocab_size=49152,
                       tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5),
}

# Published drafters, for memory budgets and projections without weights (``edgespec doctor --shape --drafter``):
# the target shape each one drafts for and the keywords of ``edgespec.bench.random_drafter``'s config writers.
# z-lab/Qwen3.8-27B-DFlash2 (config.json and safetensors header: 1.924 G parameters in bf16): 5 sliding-window
# layers (2048) of hidden 5120, 32/8 heads of 128, MLP 17408, taps 5/19/33/47/61, block 8, two-tap convolutions
# in groups of 16, a rank-256 selector over the top 16.
DRAFTER_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3.8-27b-dflash2": dict(kind="dflash2", target="qwen3.8-27b", num_layers=5, block_size=8,
                                mask_token_id=248070, target_layer_ids=[5, 19, 33, 47, 61], sliding_layers=5,
                                sliding_window=2048, intermediate_size=17408, num_heads=32, num_kv_heads=8,
                                head_dim=128, rope_theta=1e7, conv_taps=2, conv_group=16, selector_rank=256,
                                selector_top_k=16, published_al=5.47,
                                al_source="published: Qwen3.8-27B EXL3 4.0 bpw, RTX 3090, exllamav3 PR 379"),
}

# Tiny shapes for tests: small enough for CPU golden checks, but every mechanism present (GQA, q/k norm,
# both Qwen3.5 layer kinds -- GDN at 0,1,2,4,5 and full attention at 3 -- and an MTP layer).
TINY_SHAPES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=1024),
    "qwen3": dict(model_type="qwen3", vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
                  max_position_embeddings=1024),
    # 6 layers: GDN at 0,1,2,4,5 and full attention at 3 (interval 4) -- both kinds, GQA on both.
    "qwen3_5": dict(model_type="qwen3_5_text", vocab_size=320, hidden_size=64, intermediate_size=160,
                    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, max_position_embeddings=1024, mtp_num_hidden_layers=1),
    # The qwen3_5 hybrid with a sparse MoE in every layer: 8 experts, 2 routed + 1 gated shared (widths differ so
    # a routed/shared mix-up fails on shapes).
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", vocab_size=320, hidden_size=64, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        max_position_embeddings=1024, mtp_num_hidden_layers=1, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=48),
}

_QWEN35_DEFAULTS = dict(vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, full_attention_interval=4,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                        hidden_act="silu", max_position_embeddings=262144)


def config_dict(**fields: Any) -> dict[str, Any]:
    """A complete HF-style config dict from a few shape fields (fills the family's usual defaults)."""
    cfg: dict[str, Any] = {"hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
                           "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2}
    if fields.get("model_type", "").startswith("qwen3_5"):
        cfg.update(_QWEN35_DEFAULTS)
        n = fields.get("num_hidden_layers", 4)
        interval = fields.pop("full_attention_interval", 4)
        cfg["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    cfg.update(fields)
    cfg.setdefault("architectures", [_ARCH.get(cfg["model_type"], "LlamaForCausalLM")])
    return cfg


def tiny_config(family: str, **overrides: Any) -> dict[str, Any]:
    """The full config dict of a :data:`TINY_SHAPES` family, with ``overrides`` applied."""
    return config_dict(**{**TINY_SHAPES[family], **overrides})


_ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
         "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
         "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def qwen38_config(text: dict[str, Any], *, mrope_section: list[int] | None = None) -> dict[str, Any]:
    """The ``config.json`` layout Qwen3.8-27B ships (as Qwen3.6-27B: ``Qwen3_5ForConditionalGeneration``,
    ``model_type`` ``qwen3_5``, the text model under ``text_config`` as ``qwen3_5_text`` with interleaved M-RoPE
    sections in ``rope_parameters``, a ``vision_config``, ``transformers_version`` 5.8.0.dev0) around the text
    fields ``text`` (a :func:`config_dict`). ``mrope_section``: the three sections (default: the published
    [11, 11, 10] scaled to the text model's rotary dimension)."""
    text = {**text, "model_type": "qwen3_5_text", "mamba_ssm_dtype": "float32", "attn_output_gate": True,
            "mtp_use_dedicated_embeddings": False}
    rope = dict(text.get("rope_parameters") or {})
    half = int(text["head_dim"] * rope.get("partial_rotary_factor", 1.0)) // 2
    if mrope_section is None:
        a = round(half * 11 / 32)
        mrope_section = [a, a, half - 2 * a]
    text["rope_parameters"] = {**rope, "mrope_interleaved": True, "mrope_section": mrope_section}
    text.pop("architectures", None)
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "out_hidden_size": text["hidden_size"], "num_position_embeddings": 64}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "vision_config": vision, "tie_word_embeddings": text.get("tie_word_embeddings", False),
            "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
            "vision_end_token_id": 248054, "transformers_version": "5.8.0.dev0"}


def randomise_(model: TargetModel, seed: int, norm_spread: float = 0.5) -> None:
    """Fill every parameter with seeded random values of a sensible scale.

    Norm weights are randomised too (not left at 1 or 0), so a ``w`` vs ``(1 + w)`` slip changes the output.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.startswith("visual."):
                _randomise_vision_(name, p, gen, norm_spread)
            elif "norm" in name and leaf == "weight":
                centre = 0.0 if (model.config.zero_centred_norms and "linear_attn.norm" not in name) else 1.0
                p.copy_(centre + norm_spread * (2 * torch.rand(p.shape, generator=gen) - 1))
            elif leaf == "A_log":
                p.copy_(torch.log(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen)))
            elif leaf == "dt_bias":
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=gen) * (fan_in ** -0.5))


def _randomise_vision_(name: str, p: torch.Tensor, gen: torch.Generator, norm_spread: float) -> None:
    """A vision-tower parameter: LayerNorm weights around 1 (plain ``w``), small biases, weights by true fan-in
    (the patch embedding's Conv3d reads channels x frames x patch x patch values)."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and leaf == "weight":
        p.copy_(1.0 + norm_spread * (2 * torch.rand(p.shape, generator=gen) - 1))
    elif leaf == "bias":
        p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    elif "pos_embed" in name:
        p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    else:
        p.copy_(torch.randn(p.shape, generator=gen) * (p[0].numel() ** -0.5))


def write_random_checkpoint(folder: str | Path, cfg: dict[str, Any], seed: int = 0, *, prefix: str = "model.",
                            shards: int = 1, with_mtp: bool = False,
                            dtype: torch.dtype = torch.float32) -> Path:
    """Write ``config.json`` and random safetensors weights for ``cfg`` into ``folder``.

    ``prefix``: ``"model."`` (text-only layout) or ``"model.language_model."`` (Qwen3.5 VLM layout).
    ``shards > 1`` writes ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.
    ``with_mtp``: also write ``mtp.*`` weights (needs ``mtp_num_hidden_layers`` >= 1 in cfg). A config with a
    ``vision_config`` (:func:`edgespec.bench.vision_shapes.tiny_vl_config`) also gets a random vision tower under
    ``model.visual.``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model_cfg = parse_config(cfg)
    model = TargetModel(model_cfg, max_positions=8, with_mtp=with_mtp, with_vision=model_cfg.vision is not None)
    randomise_(model, seed)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.startswith("rope."):
            continue
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model."):
            name = prefix + name[len("model."):]
        tensors[name] = t.to(dtype).contiguous()
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    names = sorted(tensors)
    if shards <= 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    weight_map = {}
    per = -(-len(names) // shards)
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
        save_file(part, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


# -- a byte-level chat tokenizer for random-weight models ----------------------------------------------------
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK = ["<think>", "</think>"]

# The assistant turn's opening, thinking on or off (Qwen3.5's), shared by the chat templates of the test tokenizers.
GENERATION_PROMPT = """\
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}
{{- '<think>\\n' }}
{%- endif %}
{%- endif %}
"""

CHAT_TEMPLATE = """\
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
""" + GENERATION_PROMPT



def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens(THINK)
    return tok


def write_chat_tokenizer(folder: str | Path) -> Path:
    """Write a byte-level tokenizer (261 ids, with <think> tokens) and a Qwen-style chat template into ``folder``,
    next to any checkpoint whose vocabulary is at least that large (random-weight benchmark models)."""
    folder = Path(folder)
    tok = _byte_tokenizer()
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    tok.save(str(folder / "tokenizer.json"))
    tok_cfg = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "added_tokens_decoder": {str(tok.token_to_id(s)): {"content": s, "special": True} for s in SPECIALS},
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot]}))
    return folder
