"""Qwen3.5 hybrid GGUFs (llama.cpp's ``qwen35`` architecture), read in the file's own layout.

What llama.cpp's converter (``Qwen3NextModel``, ``_LinearAttentionVReorderBase`` and ``Qwen3_5TextModel`` of its
``convert_hf_to_gguf`` / ``conversion/qwen.py``) changes from the HF checkpoint, and how each change is served:

* With more value heads than key heads (r = hv / hk), the value heads of every linear-attention layer are
  reordered from grouped by key head (HF: ``[k0v0 .. k0v(r-1), k1v0 ..]``) to tiled (``[k0v0, k1v0, .., k0v1, ..]``),
  so that ggml can broadcast the key heads: the V rows of ``in_proj_qkv`` and its conv channels, the rows of
  ``in_proj_z``, ``in_proj_a``, ``in_proj_b``, ``A_log`` and ``dt_bias``, and the input columns of ``out_proj``.
  All of them move the same way, so the model computes the same function in the new head order if value head
  h reads key head ``h % hk`` instead of ``h // r``. That is ``ModelConfig.linear_value_head_order = "tiled"``
  (:class:`edgespec.models.gdn.GatedDeltaNet`), and every tensor is used as stored: no quantized block, not even
  ``out_proj``'s (whose permuted columns cut across its blocks), is touched.
* Norm weights are stored as ``1 + w`` (Qwen3.5's zero-centred norms; all but the gated linear-attention norm):
  ``w = stored - 1`` at load (fp32, dense tensors only).
* ``A_log`` is stored as ``A = -exp(A_log)``: ``A_log = log(-A)``.
* ``conv1d`` is stored squeezed, ``[channels, kernel]``: reshaped to ``[channels, 1, kernel]``.
* ``dt_bias`` is named ``ssm_dt.bias``.
* Newer converters append the MTP block as extra layers (``nextn_predict_layers``): those tensors are skipped (the
  native loader serves the main model; an MTP drafter is not read from a GGUF).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from edgespec.errors import CheckpointError

# GGUF block roles of the qwen35 architecture -> HF module paths (beside the llama/qwen3 ones).
QWEN35_BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ssm_a": "linear_attn",
    "ssm_dt": "linear_attn",
}
# (role, suffix) of the tensors that are parameters of no sub-module in HF's layout -> their HF name in the layer.
QWEN35_PARAMS = {("ssm_a", None): "linear_attn.A_log", ("ssm_dt", "bias"): "linear_attn.dt_bias"}
# Norms llama.cpp stores as 1 + w.
_PLUS_ONE_ROLES = {"attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


def qwen35_dense_value(gguf_name: str, role: str | None, weight: np.ndarray) -> np.ndarray:
    """A dense (float) qwen35 tensor as the HF checkpoint holds it (see the module doc); others unchanged."""
    if role in _PLUS_ONE_ROLES or gguf_name == "output_norm.weight":
        return weight - np.float32(1.0)
    if role == "ssm_a":
        if not np.all(weight < 0):
            raise CheckpointError(f"GGUF tensor {gguf_name}: A = -exp(A_log) must be negative everywhere "
                                  "(a damaged file, or not a qwen35 conversion)")
        return np.log(-weight)
    if role == "ssm_conv1d":
        return weight.reshape(weight.shape[0], 1, weight.shape[-1])
    return weight


def is_mtp_tensor(gguf_name: str, main_layers: int) -> bool:
    """True for a tensor of the MTP layers a converter appended after the ``main_layers`` decoder layers."""
    m = _LAYER_RE.match(gguf_name)
    return m is not None and int(m.group(1)) >= main_layers


def main_layer_count(meta: Any, arch: str) -> int:
    """Decoder layers of the main model: ``block_count`` less the appended MTP layers."""
    return int(meta.require(f"{arch}.block_count")) - int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)


def qwen35_config(meta: Any, arch: str, head_dim: int, rope_theta: float) -> dict[str, Any]:
    """The hybrid fields of the HF config from the GGUF metadata (``meta``: ``get`` / ``require`` by key)."""
    n_layers = main_layer_count(meta, arch)
    hk = int(meta.require(f"{arch}.ssm.group_count"))
    hv = int(meta.require(f"{arch}.ssm.time_step_rank"))
    inner = int(meta.require(f"{arch}.ssm.inner_size"))
    if hk <= 0 or hv <= 0 or hv % hk or inner % hv:
        raise CheckpointError(f"{arch}: ssm.group_count {hk}, ssm.time_step_rank {hv} and ssm.inner_size {inner} "
                              "do not describe whole key and value heads")
    interval = int(meta.get(f"{arch}.full_attention_interval", 4))
    rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    partial = rotary / head_dim
    return {
        "num_hidden_layers": n_layers,
        # llama.cpp: layer i is recurrent unless (i + 1) is a multiple of the interval (transformers' default).
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)],
        "full_attention_interval": interval,
        "linear_num_key_heads": hk,
        "linear_num_value_heads": hv,
        "linear_key_head_dim": int(meta.require(f"{arch}.ssm.state_size")),
        "linear_value_head_dim": inner // hv,
        "linear_conv_kernel_dim": int(meta.require(f"{arch}.ssm.conv_kernel")),
        "linear_value_head_order": "tiled" if hv != hk else "grouped",
        "partial_rotary_factor": partial,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": partial},
    }
