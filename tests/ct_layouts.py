"""Test helper: tiny compressed-tensors checkpoints written by the real ``compressed-tensors`` library.

A dense random checkpoint is loaded into transformers, the library applies a quantization config to it
(``apply_quantization_config``), the weight scales, zero points and global scales are computed from each
weight's min/max with the library's own ``calculate_qparams`` / ``generate_gparam`` (what llm-compressor's
min-max observer feeds them), and ``ModelCompressor.compress_model`` packs the weights. The packed state dict is
the checkpoint; the same model after the library's ``decompress_model`` is the dense reference it means.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from quant_layouts import save_beside
from safetensors.torch import load_file

# name -> (format, config groups as {group: (targets, weights args, input activation args or None)})
W4 = {"num_bits": 4, "type": "int", "strategy": "group"}
FP8_W = {"num_bits": 8, "type": "float", "symmetric": True}
FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
NVFP4_W = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
NVFP4_A = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local",
           "symmetric": True}
SCHEMES: dict[str, tuple[str, dict[str, tuple[list[str], dict, dict | None]]]] = {
    "int4-g32-sym": ("pack-quantized", {"group_0": (["Linear"], {**W4, "group_size": 32, "symmetric": True}, None)}),
    "int4-g64-asym": ("pack-quantized", {"group_0": (["Linear"], {**W4, "group_size": 64, "symmetric": False},
                                                     None)}),
    "int4-g128-sym": ("pack-quantized", {"group_0": (["Linear"], {**W4, "group_size": 128, "symmetric": True},
                                                     None)}),
    "int4-channel-asym": ("pack-quantized", {"group_0": (["Linear"], {"num_bits": 4, "type": "int",
                                                                      "strategy": "channel", "symmetric": False},
                                                         None)}),
    "fp8-channel-dynamic": ("float-quantized", {"group_0": (["Linear"], {**FP8_W, "strategy": "channel"},
                                                            FP8_TOKEN)}),
    "fp8-tensor": ("float-quantized", {"group_0": (["Linear"], {**FP8_W, "strategy": "tensor"}, None)}),
    "fp8-block": ("float-quantized", {"group_0": (["Linear"], {**FP8_W, "strategy": "block",
                                                              "block_structure": [128, 128]}, FP8_TOKEN)}),
    "nvfp4": ("nvfp4-pack-quantized", {"group_0": (["Linear"], NVFP4_W, NVFP4_A)}),
    # Per-group targets (MLP int4, attention FP8 per channel) and an ignore list with a regex and an exact name.
    "mixed": (None, {"group_0": (["re:.*mlp\\..*"], {**W4, "group_size": 32, "symmetric": False}, None),
                     "group_1": (["re:.*(self_attn|linear_attn)\\..*"], {**FP8_W, "strategy": "channel"}, None)}),
}
# Releases keep the head and the tiny GDN gate projections (4 outputs) in 16 bits.
IGNORE = ["lm_head", "re:.*in_proj_[ab]$"]
MIXED_IGNORE = [*IGNORE, "model.layers.0.mlp.down_proj"]


def _minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    strategy = getattr(args.strategy, "value", args.strategy)
    if strategy in ("group", "tensor_group"):
        g = w.reshape(w.shape[0], -1, args.group_size)
        return g.amin(-1), g.amax(-1)
    if strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if strategy == "block":
        bo, bi = args.block_structure
        b = torch.nn.functional.pad(w, (0, -w.shape[1] % bi, 0, -w.shape[0] % bo))
        b = b.reshape(b.shape[0] // bo, bo, b.shape[1] // bi, bi)
        return b.amin(dim=(1, 3)), b.amax(dim=(1, 3))
    return w.amin().reshape(1), w.amax().reshape(1)


def write_ct(dense_dir: Path, out_dir: Path, ref_dir: Path, scheme: str) -> tuple[Path, Path]:
    """Quantize the checkpoint in ``dense_dir`` with ``scheme`` (:data:`SCHEMES`) through compressed-tensors:
    ``out_dir`` the compressed checkpoint, ``ref_dir`` the library's own dequantized weights as a dense one."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    from transformers import AutoModelForCausalLM

    fmt, groups = SCHEMES[scheme]
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    config_groups = {name: QuantizationScheme(targets=t, weights=QuantizationArgs(**w),
                                              input_activations=QuantizationArgs(**a) if a else None)
                     for name, (t, w, a) in groups.items()}
    ignore = MIXED_IGNORE if scheme == "mixed" else IGNORE
    apply_quantization_config(model, QuantizationConfig(config_groups=config_groups, ignore=ignore))
    with torch.no_grad():
        for _, module in model.named_modules():
            qs = getattr(module, "quantization_scheme", None)
            if qs is None or qs.weights is None:
                continue
            w = module.weight
            global_scale = None
            if hasattr(module, "weight_global_scale"):
                global_scale = generate_gparam(w.amin(), w.amax())
                module.weight_global_scale.copy_(global_scale)
            lo, hi = _minmax(w, qs.weights)
            scale, zero = calculate_qparams(lo, hi, qs.weights, global_scale=global_scale)
            if qs.weights.type == "int":
                scale = scale.bfloat16().float()     # releases store bf16 scales (the model dtype)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    original = set(load_file(str(dense_dir / "model.safetensors")))
    packed = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()
              if k in original or k.rsplit(".", 1)[0] + ".weight" in original}
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(dense_dir / "config.json", out_dir / "config.json")
    compressor.update_config(str(out_dir))     # now, while the status is "compressed"
    qconfig = json.loads((out_dir / "config.json").read_text())
    compressor.decompress_model(model)
    dense = {k: v.detach().float().contiguous().clone() for k, v in model.state_dict().items() if k in original}
    dense.update(_nvfp4_fp32(model, packed))
    for folder, tensors in ((out_dir, packed), (ref_dir, dense)):
        save_beside(dense_dir, folder, tensors)
    (out_dir / "config.json").write_text(json.dumps(qconfig))
    shutil.copy2(dense_dir / "config.json", ref_dir / "config.json")
    return out_dir, ref_dir


def _nvfp4_fp32(model, packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The NVFP4 layers dequantized by the library in fp32 (its decompressor unpacks the e2m1 codes to bf16,
    which would round the reference itself)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    out = {}
    for name, module in model.named_modules():
        key = f"{name}.weight_packed"
        qs = getattr(module, "quantization_scheme", None)
        if key not in packed or qs is None or qs.weights.type != "float":
            continue
        codes = packed[key]
        values = unpack_fp4_from_uint8(codes, codes.shape[0], codes.shape[1] * 2, dtype=torch.float32)
        out[f"{name}.weight"] = dequantize(values, packed[f"{name}.weight_scale"].float(), args=qs.weights,
                                           dtype=torch.float32,
                                           global_scale=packed[f"{name}.weight_global_scale"].float())
    return out


def edit_config(folder: Path, change) -> Path:
    """Apply ``change(quantization_config)`` to ``folder/config.json`` in place."""
    cfg: dict[str, Any] = json.loads((folder / "config.json").read_text())
    change(cfg["quantization_config"])
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder
