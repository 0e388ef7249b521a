"""Vision-language checkpoints for tests and benchmarks: the tiny Qwen3.5 VLM, the published towers, test frames.

:func:`write_tiny_vl_checkpoint` writes what a Qwen3.5/3.6 release folder holds for images -- ``config.json`` with
``text_config`` + ``vision_config`` + the image token ids, random weights under ``model.language_model.*`` /
``model.visual.*`` (and ``mtp.*``), ``preprocessor_config.json``, a byte-level tokenizer with the vision tokens and a
chat template that renders image parts as Qwen's does -- small enough for CPU golden checks against transformers'
``Qwen3_5ForConditionalGeneration``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.bench.shapes import GENERATION_PROMPT, SPECIALS, _byte_tokenizer, tiny_config, write_random_checkpoint

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]

# The published tower of Qwen3.5/3.6 (every size: 27 blocks of 1152, 16 heads), by the text hidden size it feeds.
QWEN35_TOWER: dict[str, Any] = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                                    temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                                    num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh",
                                    deepstack_visual_indexes=[])

# Tiny tower: 2 blocks of 32 (2 heads of 16: 2-D rotary over 4 frequencies per axis), a 4 x 4 position grid.
TINY_TOWER: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                                  temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                                  num_position_embeddings=16, hidden_act="gelu_pytorch_tanh",
                                  deepstack_visual_indexes=[])

# Images of the tiny model: at least 2 x 2 merged tokens, at most 64 (4096 px per token side of 32 -> 256 x 256).
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 64 * 64, 256 * 256

CHAT_TEMPLATE_VL = """\
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.content is string %}
{{- message.content }}
{%- else %}
{%- for item in message.content %}
{%- if item.type == 'image' or 'image' in item or 'image_url' in item %}
{{- '<|vision_start|><|image_pad|><|vision_end|>' }}
{%- elif 'text' in item %}
{{- item.text }}
{%- endif %}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
""" + GENERATION_PROMPT


def tiny_vl_config(**text_overrides: Any) -> dict[str, Any]:
    """The config.json of a tiny Qwen3.5 VLM: the tiny hybrid text model (6 layers, MTP), rotary over half the
    head (head_dim 32: 8 frequencies, M-RoPE sections 3/3/2 interleaved) and the tiny tower; image tokens after the
    byte tokenizer's 261 ids."""
    text = tiny_config("qwen3_5", **text_overrides)
    pairs = text["head_dim"] // 4             # rotary over half the head: head_dim / 4 frequency pairs
    h, w = int(pairs * 11 / 32 + 0.5), pairs * 10 // 32        # Qwen3.5's 11/11/10 of 32, scaled
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5,
                               "mrope_section": [pairs - h - w, h, w], "mrope_interleaved": True}
    tie = text.pop("tie_word_embeddings", False)
    text.pop("architectures", None)
    ids = {tok: 261 + i for i, tok in enumerate(VISION_TOKENS)}
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
            "vision_config": {**TINY_TOWER, "out_hidden_size": text["hidden_size"]},
            "image_token_id": ids["<|image_pad|>"], "video_token_id": 300,
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
            "tie_word_embeddings": tie}


def write_vl_tokenizer(folder: str | Path, min_pixels: int = TINY_MIN_PIXELS, max_pixels: int = TINY_MAX_PIXELS
                       ) -> Path:
    """The byte-level tokenizer with the vision tokens (ids 261-263), the VL chat template and a
    ``preprocessor_config.json`` (Qwen3.5's processor with the given pixel bounds)."""
    folder = Path(folder)
    tok = _byte_tokenizer()
    tok.add_special_tokens(VISION_TOKENS)
    tok.save(str(folder / "tokenizer.json"))
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    special = SPECIALS + VISION_TOKENS
    tok_cfg = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "added_tokens_decoder": {str(tok.token_to_id(s)): {"content": s, "special": True} for s in special},
               "chat_template": CHAT_TEMPLATE_VL}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot]}))
    proc = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
            "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}, "patch_size": 16,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "rescale_factor": 1 / 255, "do_resize": True, "do_rescale": True, "do_normalize": True,
            "do_convert_rgb": True}
    (folder / "preprocessor_config.json").write_text(json.dumps(proc, indent=2))
    return folder


def write_tiny_vl_checkpoint(folder: str | Path, seed: int = 0, **text_overrides: Any) -> Path:
    """A complete tiny Qwen3.5 VLM folder (weights, configs, tokenizer, processor); see the module doc."""
    folder = write_random_checkpoint(folder, tiny_vl_config(**text_overrides), seed=seed,
                                     prefix="model.language_model.", with_mtp=True)
    return write_vl_tokenizer(folder)


def synthetic_frame(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A synthetic RGB camera frame ``uint8 [H, W, 3]``: smooth gradients, a few blocks and some noise (so
    resampling and compression both have work)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    frame = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)),
                      ((x + y) * 127 // max(height + width - 2, 1))], axis=-1).astype(np.int32)
    for _ in range(4):
        y0, x0 = rng.integers(0, height), rng.integers(0, width)
        frame[y0:y0 + height // 4, x0:x0 + width // 4] = rng.integers(0, 256, size=3)
    frame += rng.integers(-12, 13, size=frame.shape)
    return frame.clip(0, 255).astype(np.uint8)


def encode_frame(frame: np.ndarray, fmt: str = "PNG", quality: int = 90) -> bytes:
    """``frame`` encoded as PNG, JPEG or WebP bytes (Pillow)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format=fmt, **({} if fmt == "PNG" else {"quality": quality}))
    return buf.getvalue()


def data_url(data: bytes, fmt: str = "PNG") -> str:
    import base64

    return f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()
