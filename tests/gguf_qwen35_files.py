"""A Qwen3.5 hybrid HF checkpoint written as a ``qwen35`` GGUF the way llama.cpp's converter writes it (test-only):
gguf-py's writer and tensor-name map, and the converter's changes (``Qwen3NextModel`` and
``_LinearAttentionVReorderBase`` in llama.cpp's ``convert_hf_to_gguf`` / ``conversion/qwen.py``): norms stored as
``1 + w`` (not the gated linear-attention norm), ``A_log`` as ``-exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, conv1d
squeezed, and with more value than key heads the value heads of every linear-attention tensor reordered from
grouped to tiled (V rows of in_proj_qkv and of the conv, in_proj_z / a / b rows, A_log, dt_bias, out_proj columns).

Also returns the oracle: the HF state dict the written file stands for (quantized tensors dequantized by gguf-py,
every change undone), which transformers loads to give the reference logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf_files import CONTROL, _vocab
from safetensors.torch import load_file

from edgespec.weights.gguf_kquants import K_D_SCALE, random_kquant


def _tiled(t: np.ndarray, axis: int, hk: int, r: int, d: int, inverse: bool = False) -> np.ndarray:
    """Value heads along ``axis`` (``hk * r`` heads of ``d``) grouped -> tiled (``inverse``: tiled -> grouped)."""
    t = np.moveaxis(t, axis, 0)
    rest = t.shape[1:]
    order = (r, hk) if inverse else (hk, r)
    t = t.reshape(*order, d, *rest).swapaxes(0, 1).reshape(hk * r * d, *rest)
    return np.ascontiguousarray(np.moveaxis(t, 0, axis))


def _v_axis_changes(name: str, cfg: dict) -> list[tuple[int, int, int]]:
    """(axis, first index, head size) of the value-head blocks the converter reorders in tensor ``name``."""
    hk, dk, dv = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if ".linear_attn." not in name or cfg["linear_num_value_heads"] == hk:
        return []
    qk = 2 * hk * dk
    table = {"in_proj_qkv.weight": (0, qk, dv), "conv1d.weight": (0, qk, dv), "in_proj_z.weight": (0, 0, dv),
             "in_proj_a.weight": (0, 0, 1), "in_proj_b.weight": (0, 0, 1), "A_log": (0, 0, 1), "dt_bias": (0, 0, 1),
             "out_proj.weight": (1, 0, dv)}
    return [v for k, v in table.items() if name.endswith("linear_attn." + k)]


def _reorder(t: np.ndarray, name: str, cfg: dict, inverse: bool = False) -> np.ndarray:
    hk = cfg["linear_num_key_heads"]
    r = cfg["linear_num_value_heads"] // hk
    for axis, start, d in _v_axis_changes(name, cfg):
        head, tail = np.split(t, [start], axis=axis)
        t = np.concatenate([head, _tiled(tail, axis, hk, r, d, inverse)], axis=axis)
    return t


def _plus_one(name: str) -> bool:
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def write_qwen35_gguf(hf_folder: Path, path: Path, qtype: str = "F32", *, mtp_layers: int = 0,
                      bad_a: bool = False) -> tuple[Path, dict[str, torch.Tensor]]:
    """``hf_folder`` (a random qwen3_5_text checkpoint) as a qwen35 GGUF whose 2-D matrices are ``qtype`` (``F32``
    or a type gguf-py quantizes, e.g. ``Q8_0``; a K-quant such as ``Q4_K``: random super-blocks, which gguf-py cannot
    quantize to, for every matrix whose rows are whole super-blocks -- the oracle is what they decode to);
    ``mtp_layers`` appends that many dummy MTP layers as newer
    converters do; ``bad_a`` stores a positive ``A`` (a damaged file). Returns the path and the oracle state dict."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    cfg = json.loads((hf_folder / "config.json").read_text())
    state = load_file(str(hf_folder / "model.safetensors"))
    n_layers, arch = cfg["num_hidden_layers"], gguf.MODEL_ARCH.QWEN35
    head_dim = cfg["head_dim"]
    rope = cfg.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    tokens = _vocab()
    tokens += [f"<x{i}>" for i in range(cfg["vocab_size"] - len(tokens))]
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_block_count(n_layers + mtp_layers)
    if mtp_layers:
        w.add_uint32("qwen35.nextn_predict_layers", mtp_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 1e7)))
    w.add_rope_dimension_count(int(head_dim * partial))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_ssm_conv_kernel(cfg.get("linear_conv_kernel_dim", 4))
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in CONTROL else 1 for t in tokens])
    w.add_token_merges(["Ġ t", "Ġt h", "Ġth e"])
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    names = gguf.get_tensor_name_map(arch, n_layers + mtp_layers)
    oracle: dict[str, torch.Tensor] = {}
    rng = np.random.default_rng(7)
    extra = {f"model.layers.{n_layers + i}.input_layernorm.weight": torch.zeros(cfg["hidden_size"])
             for i in range(mtp_layers)}
    for name, tensor in {**state, **extra}.items():
        data = tensor.float().numpy()
        hf_name = name
        if name.endswith(".A_log"):
            data = -np.exp(data) * (-1.0 if bad_a else 1.0)
        elif name.endswith(".dt_bias"):
            name = name[: -len("dt_bias")] + "dt_proj.bias"
        elif "conv1d" in name:
            data = data.squeeze()
        elif _plus_one(name):
            data = data + 1
        data = _reorder(data.astype(np.float32), hf_name, cfg)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        kquant = qtype in K_D_SCALE and data.shape[-1] % 256 == 0
        if data.ndim == 2 and "conv1d" not in name and qtype != "F32" and (kquant or qtype not in K_D_SCALE):
            qt = getattr(Q, qtype)
            raw = random_kquant(*data.shape, qtype, rng, scale=0.2) if kquant else quants.quantize(data, qt)
            w.add_tensor(gguf_name, raw, raw_dtype=qt)
            data = quants.dequantize(raw, qt).reshape(data.shape)
        else:
            w.add_tensor(gguf_name, data)
        if hf_name in extra:
            continue
        # the oracle: what this file holds, every change undone
        data = _reorder(data, hf_name, cfg, inverse=True)
        if hf_name.endswith(".A_log"):
            with np.errstate(invalid="ignore"):      # bad_a: no oracle for a damaged file
                data = np.log(-data)
        elif "conv1d" in hf_name:
            data = data.reshape(tensor.shape)
        elif _plus_one(hf_name):
            data = data - 1
        oracle[hf_name] = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, oracle
