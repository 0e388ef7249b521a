"""Test helpers: write tiny checkpoints in each public quantized layout, independently of edgespec's own packing.

Each writer draws random codes and scales for a layer, packs them with plain loops following the published
layout (Qwen block-FP8, ModelOpt NVFP4, AWQ GEMM, GPTQ v1/v2), and returns the dense matrix those tensors mean,
computed from the formula. A checkpoint written with the dense matrices instead is the dequantize-then-fp32
reference model the packed model must match.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
FORMATS = ("fp8", "nvfp4", "awq", "gptq", "gptq_v2")


def _int32(values: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    return torch.where(values >= 2 ** 31, values - 2 ** 32, values).to(torch.int32)


def _pack8(cols: list[torch.Tensor]) -> torch.Tensor:
    acc = torch.zeros_like(cols[0], dtype=torch.int64)
    for k, c in enumerate(cols):
        acc += (c.long() & 0xF) << (4 * k)
    return _int32(acc)


def fp8_layer(w_shape: tuple[int, int], gen: torch.Generator, block: int = 128):
    out_f, in_f = w_shape
    q = (torch.randn(out_f, in_f, generator=gen) * 2).to(torch.float8_e4m3fn)
    scale = (torch.rand(-(-out_f // block), -(-in_f // block), generator=gen) + 0.5) * in_f ** -0.5 / 2
    rows, cols = torch.arange(out_f) // block, torch.arange(in_f) // block
    dense = q.float() * scale[rows][:, cols]
    return {"weight": q, "weight_scale_inv": scale}, dense


def nvfp4_layer(w_shape: tuple[int, int], gen: torch.Generator):
    out_f, in_f = w_shape
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)       # low nibble = even index
    block = (torch.rand(out_f, in_f // 16, generator=gen) * 3 + 1).to(torch.float8_e4m3fn)
    scale_2 = torch.tensor(0.1 * in_f ** -0.5, dtype=torch.float32)
    table = torch.tensor(E2M1)
    dense = table[codes] * block.float().repeat_interleave(16, 1) * scale_2
    return {"weight": packed, "weight_scale": block, "weight_scale_2": scale_2,
            "input_scale": torch.tensor(1.0)}, dense


def int4_values(w_shape, gen, group):
    out_f, in_f = w_shape
    q = torch.randint(0, 16, (in_f, out_f), generator=gen)                   # [in, out] like both layouts
    z = torch.randint(0, 16, (in_f // group, out_f), generator=gen)
    s = ((torch.rand(in_f // group, out_f, generator=gen) + 0.5) * 0.3 * in_f ** -0.5).half()
    gi = torch.arange(in_f) // group
    dense = ((q - z[gi]).float() * s.float()[gi]).t().contiguous()          # [out, in]
    return q, z, s, dense


def awq_layer(w_shape, gen, group):
    q, z, s, dense = int4_values(w_shape, gen, group)
    # nibble k of packed column j holds output column 8j + AWQ_ORDER[k]
    qweight = _pack8([q[:, AWQ_ORDER[k]::8] for k in range(8)])
    qzeros = _pack8([z[:, AWQ_ORDER[k]::8] for k in range(8)])
    return {"qweight": qweight, "qzeros": qzeros, "scales": s}, dense


def gptq_layer(w_shape, gen, group, v2: bool = False):
    q, z, s, dense = int4_values(w_shape, gen, group)
    in_f = q.shape[0]
    qweight = _pack8([q[k::8] for k in range(8)])                           # nibble k of row j: input 8j + k
    stored = z if v2 else (z - 1) & 0xF                                     # v1 stores zero - 1
    qzeros = _pack8([stored[:, k::8] for k in range(8)])
    g_idx = (torch.arange(in_f) // group).to(torch.int32)
    return {"qweight": qweight, "qzeros": qzeros, "scales": s, "g_idx": g_idx}, dense


def quant_config(fmt: str, group: int, kept: list[str]) -> dict:
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": kept}
    if fmt == "nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": kept}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": kept}
    cfg = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False,
           "damp_percent": 0.01}
    if fmt == "gptq_v2":
        cfg["checkpoint_format"] = "gptq_v2"
    return cfg


def _quantizable(name: str, shape, fmt: str, group: int) -> bool:
    if not name.endswith("_proj.weight") and not name.endswith(".fc.weight"):
        return False
    out_f, in_f = shape
    if "in_proj_b" in name or "in_proj_a" in name:       # releases keep the tiny GDN gate projections in bf16
        return False
    if fmt == "nvfp4":
        return in_f % 16 == 0
    if fmt != "fp8":
        return in_f % group == 0 and out_f % 8 == 0
    return True


def save_beside(dense_dir: Path, folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` as ``folder/model.safetensors`` with ``dense_dir``'s other files (tokenizer ...) beside it;
    the caller writes ``config.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for extra in dense_dir.iterdir():
        if extra.name not in ("model.safetensors", "config.json"):
            shutil.copy2(extra, folder / extra.name)


def write_quantized(dense_dir: Path, out_dir: Path, ref_dir: Path, fmt: str, group: int = 32, seed: int = 0,
                    quantize_mtp: bool = True) -> tuple[Path, Path]:
    """From a dense random checkpoint, write ``out_dir`` (public layout of ``fmt``) and ``ref_dir`` (the same model
    with every quantized layer's dequantized matrix as a dense fp32 weight)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(dense_dir / "model.safetensors"))
    packed, ref = {}, {}
    kept = ["lm_head"]
    for key, t in tensors.items():
        if not _quantizable(key, t.shape, fmt, group) or (key.startswith("mtp.") and not quantize_mtp):
            packed[key] = ref[key] = t
            if key.endswith("_proj.weight"):
                kept.append(key[:-len(".weight")])
            continue
        prefix = key[:-len("weight")]
        if fmt == "fp8":
            parts, dense = fp8_layer(t.shape, gen)
        elif fmt == "nvfp4":
            parts, dense = nvfp4_layer(t.shape, gen)
        elif fmt == "awq":
            parts, dense = awq_layer(t.shape, gen, group)
        else:
            parts, dense = gptq_layer(t.shape, gen, group, v2=fmt == "gptq_v2")
        packed.update({prefix + k: v for k, v in parts.items()})
        ref[key] = dense
    cfg = json.loads((dense_dir / "config.json").read_text())
    for folder, ts in ((out_dir, packed), (ref_dir, ref)):
        save_beside(dense_dir, folder, ts)
    qcfg = dict(cfg, quantization_config=quant_config(fmt, group, kept))
    (out_dir / "config.json").write_text(json.dumps(qcfg))
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    if fmt == "nvfp4":
        hf = {"producer": {"name": "modelopt", "version": "0.0"},
              "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                               "exclude_modules": kept}}
        (out_dir / "hf_quant_config.json").write_text(json.dumps(hf))
    return out_dir, ref_dir


def fp8_tensor_layer(w_shape: tuple[int, int], gen: torch.Generator):
    """ModelOpt FP8: e4m3 weight, one static float32 ``weight_scale`` (and an ``input_scale`` a weight-only
    runtime leaves unused)."""
    q = (torch.randn(w_shape, generator=gen) * 2).to(torch.float8_e4m3fn)
    scale = (torch.rand((), generator=gen) + 0.5) * w_shape[1] ** -0.5 / 2
    return {"weight": q, "weight_scale": scale, "input_scale": torch.tensor(0.02)}, q.float() * scale


def write_modelopt_mixed(dense_dir: Path, out_dir: Path, ref_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """The layout of ModelOpt's MIXED_PRECISION export of a Qwen hybrid: MLP projections NVFP4 (W4A16, group 16),
    attention and GDN projections FP8 with per-tensor static scales, the GDN gates and lm_head in 16 bits, an FP8
    KV cache asked for without k/v scales. Layer names in ``quantized_layers`` are the checkpoint's own."""
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(dense_dir / "model.safetensors"))
    packed, ref, layers, excluded = {}, {}, {}, ["lm_head"]
    for key, t in tensors.items():
        prefix = key[:-len(".weight")]
        if key.endswith("_proj.weight") and ".mlp." in key:
            parts, dense = nvfp4_layer(t.shape, gen)
            parts.pop("input_scale")
            layers[prefix] = {"quant_algo": "NVFP4", "group_size": 16}
        elif key.endswith("_proj.weight") and "in_proj_a" not in key and "in_proj_b" not in key:
            parts, dense = fp8_tensor_layer(t.shape, gen)
            layers[prefix] = {"quant_algo": "FP8"}
        else:
            packed[key] = ref[key] = t
            if key.endswith("_proj.weight"):
                excluded.append(prefix)
            continue
        packed.update({f"{prefix}.{k}": v for k, v in parts.items()})
        ref[key] = dense
    save_beside(dense_dir, out_dir, packed)
    save_beside(dense_dir, ref_dir, ref)
    cfg = json.loads((dense_dir / "config.json").read_text())
    quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8", "quantized_layers": layers,
             "exclude_modules": excluded}
    (out_dir / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.0"},
                                                               "quantization": quant}))
    (out_dir / "config.json").write_text(json.dumps(dict(cfg, quantization_config={"quant_method": "modelopt",
                                                                                   **quant})))
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    return out_dir, ref_dir
