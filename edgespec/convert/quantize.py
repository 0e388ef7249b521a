"""``edgespec quantize SRC DST --format {int4,nvfp4,fp8}``: round-to-nearest weight quantization of a checkpoint.

Reads a bf16/fp16/fp32 Hugging Face checkpoint one projection group at a time (q/k/v, gate/up, the GDN input
projections: the parts a model serves merged), quantizes every linear weight group-wise, and writes the public
layout other runtimes load too: Qwen block-FP8 (``weight_scale_inv``, ``quantization_config.quant_method fp8``),
NVIDIA ModelOpt NVFP4 (``weight_scale``/``weight_scale_2`` + ``hf_quant_config.json``) or AWQ GEMM int4
(``qweight``/``qzeros``/``scales``). Embeddings, lm_head, norms, convolutions and the GDN decay parameters stay as
they are, as do layers matching ``--keep`` and (unless ``--quantize-mtp``) the MTP layers. Memory stays bounded:
at most one projection group is held in fp32 and one output shard (``--shard-mb``) is buffered. Config and
tokenizer files are copied; a per-layer reconstruction-error summary ends the run.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from edgespec.convert.quantize_args import FORMATS  # the formats --format offers
from edgespec.errors import CheckpointError, ConfigError
from edgespec.loading.checkpoint import normalise_key
from edgespec.loading.experts import split_fused_experts
from edgespec.loading.hf_config import parse_config, read_json
from edgespec.loading.safetensors_io import TensorEntry, TensorReader, read_headers
from edgespec.loading.weights import weight_files
from edgespec.models.layers import Linear
from edgespec.weights.requantize import quantize_weight

# Kept in their source dtype by default: read once per token (embeddings), sensitive (lm_head), or tiny.
DEFAULT_KEEP = ("lm_head", "*embed_tokens*")
# Parts a model serves as one merged projection: NVFP4 gives each group one global scale so they can merge.
_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
           ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))


@dataclass
class LayerError:
    """Reconstruction error of one quantized matrix: ||W - deq(Q(W))|| / ||W||."""

    name: str
    shape: tuple[int, int]
    rel_error: float


def _matches(name: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.search(p[3:], name):
                return True
        elif fnmatch.fnmatch(name, p) or name == p or name.startswith(p + "."):
            return True
    return False


def _linear_names(raw_cfg: dict[str, Any], with_mtp: bool) -> dict[str, tuple[int, int]]:
    """Module name -> (out, in) of every linear layer of the model the config describes (meta device: free)."""
    from edgespec.models.decoder import TargetModel

    cfg = parse_config(raw_cfg)
    with torch.device("meta"):
        model = TargetModel(cfg, max_positions=1, with_mtp=with_mtp)
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, Linear)}


def _public_tensors(fmt: str, q) -> dict[str, torch.Tensor]:
    if fmt == "fp8":
        return {"weight": q.weight, "weight_scale_inv": q.weight_scale_inv}
    if fmt == "nvfp4":
        return {"weight": q.weight, "weight_scale": q.weight_scale, "weight_scale_2": q.weight_scale_2,
                "input_scale": torch.ones((), dtype=torch.float32)}
    return q.to_awq()


def _fits(fmt: str, out_f: int, in_f: int, group_size: int) -> str | None:
    """Why a matrix cannot take ``fmt`` (None: it can)."""
    if fmt == "nvfp4" and in_f % 16:
        return f"in_features {in_f} not a multiple of 16"
    if fmt == "int4" and (in_f % group_size or out_f % 8):
        return f"[{out_f}, {in_f}] needs in % {group_size} == 0 and out % 8 == 0"
    return None


class _ShardWriter:
    """Buffers output tensors and writes a safetensors shard whenever ``limit`` bytes are reached."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.buffer: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        self.buffer[key] = t.contiguous()
        self.size += t.numel() * t.element_size()
        if self.size >= self.limit:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        name = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.buffer, str(self.folder / name), metadata={"format": "pt"})
        self.files.append((name, list(self.buffer)))
        self.total += self.size
        self.buffer, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        n = len(self.files)
        weight_map: dict[str, str] = {}
        for i, (old, keys) in enumerate(self.files):
            new = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.folder / old).rename(self.folder / new)
            weight_map.update({k: new for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _config_fields(fmt: str, kept: list[str], group_size: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": kept}, None
    if fmt == "nvfp4":
        hf = {"producer": {"name": "edgespec", "version": _version()},
              "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                               "exclude_modules": kept}}
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": kept}, hf
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": kept}, None


def _version() -> str:
    from edgespec import __version__
    return __version__


def _select_keys(entries: dict[str, TensorEntry], linears: dict[str, tuple[int, int]], patterns: list[str],
                 fmt: str, group_size: int) -> tuple[dict[str, str], list[str], list[str]]:
    """The checkpoint keys to quantize (key -> module name), the linear modules kept as they are (a pattern or a
    shape the format cannot take) and a note for each kept by shape."""
    quant_keys: dict[str, str] = {}              # checkpoint key -> module name
    kept_modules: list[str] = []
    notes: list[str] = []
    for key, e in entries.items():
        name = normalise_key(key)
        if name is None or not name.endswith(".weight"):
            continue
        module = name[:-len(".weight")]
        if module not in linears or len(e.shape) != 2:
            continue
        why = _fits(fmt, *e.shape, group_size)
        if _matches(module, patterns) or why:
            kept_modules.append(key[:-len(".weight")])
            if why and not _matches(module, patterns):
                notes.append(f"kept {module}: {why}")
            continue
        if e.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise CheckpointError(f"{key} is {e.dtype}: quantize a bf16/fp16/fp32 checkpoint")
        quant_keys[key] = module
    return quant_keys, kept_modules, notes


def _write_config_and_files(src: Path, dst: Path, raw_cfg: dict[str, Any], fmt: str, kept_modules: list[str],
                            group_size: int, drop_mtp: bool) -> None:
    """``config.json`` with the format's quantization_config (and ``hf_quant_config.json`` where the format has
    one), and every other non-weight file of ``src`` copied."""
    quant_cfg, hf_quant = _config_fields(fmt, kept_modules, group_size)
    out_cfg = dict(raw_cfg)
    out_cfg["quantization_config"] = quant_cfg
    if drop_mtp and "mtp_num_hidden_layers" in out_cfg:
        out_cfg["mtp_num_hidden_layers"] = 0
    (dst / "config.json").write_text(json.dumps(out_cfg, indent=2))
    if hf_quant is not None:
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".safetensors.index.json")) \
                and path.name not in ("config.json", "hf_quant_config.json"):
            shutil.copy2(path, dst / path.name)


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str, *, keep: list[str] | None = None,
                        group_size: int = 128, quantize_mtp: bool = False, drop_mtp: bool = False,
                        shard_bytes: int = 4 << 30, force: bool = False, progress: bool = True) -> list[LayerError]:
    """Quantize ``src`` into ``dst`` (see the module doc); returns the per-layer reconstruction errors."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    src, dst = Path(src), Path(dst)
    raw_cfg = read_json(src / "config.json")
    if raw_cfg.get("quantization_config") or (src / "hf_quant_config.json").is_file():
        raise CheckpointError(f"{src} is already quantized; quantize a bf16/fp16/fp32 checkpoint")
    # Fused MoE experts are quantized (and written) per expert, the layout the quantized releases use.
    entries = split_fused_experts(read_headers(weight_files(src)), parse_config(raw_cfg))
    if dst.exists() and any(dst.iterdir()) and not force:
        raise ConfigError(f"{dst} is not empty (use --force to write into it)")
    dst.mkdir(parents=True, exist_ok=True)
    has_mtp = any(k.startswith("mtp.") for k in entries)
    linears = _linear_names(raw_cfg, has_mtp)
    patterns = list(DEFAULT_KEEP) + list(keep or [])
    if not quantize_mtp:
        patterns.append("mtp.*")

    # Which checkpoint keys are quantized, grouped as the model merges them.
    quant_keys, kept_modules, notes = _select_keys(entries, linears, patterns, fmt, group_size)

    def group_of(key: str) -> tuple[str, ...]:
        parent, _, leaf = key[:-len(".weight")].rpartition(".")
        for group in _GROUPS:
            if leaf in group:
                members = tuple(f"{parent}.{g}.weight" for g in group if f"{parent}.{g}.weight" in quant_keys)
                return members
        return (key,)

    groups = list(dict.fromkeys(group_of(k) for k in sorted(quant_keys)))
    writer = _ShardWriter(dst, shard_bytes)
    errors: list[LayerError] = []
    from edgespec.progress import Progress

    bar = Progress(len(groups), None) if progress else None
    with TensorReader() as reader:
        for group in groups:
            t0 = time.monotonic()
            mats = {k: reader.read(entries[k]).float() for k in group}
            amax = max(m.abs().amax() for m in mats.values()) if fmt == "nvfp4" else None
            for k, w in mats.items():
                q = quantize_weight(fmt, w, group_size=group_size, global_amax=amax)
                err = (q.dequantize(torch.float32) - w).norm() / w.norm().clamp(min=1e-12)
                errors.append(LayerError(quant_keys[k], tuple(w.shape), float(err)))
                prefix = k[:-len("weight")]
                for suffix, t in _public_tensors(fmt, q).items():
                    writer.add(prefix + suffix, t)
            del mats
            if bar is not None:
                bar.step(group[0].rsplit(".", 2)[0], time.monotonic() - t0)
        for key in sorted(entries):
            if key in quant_keys or (drop_mtp and key.startswith("mtp.")):
                continue
            writer.add(key, reader.read(entries[key]))
    if bar is not None:
        bar.close()
    writer.finish()

    _write_config_and_files(src, dst, raw_cfg, fmt, sorted(kept_modules), group_size, drop_mtp)
    for n in notes:
        print(n, file=sys.stderr)
    return errors


def format_errors(errors: list[LayerError], worst: int = 5) -> list[str]:
    """The summary printed after a run: count, mean and max relative error, and the worst layers."""
    if not errors:
        return ["no layer quantized"]
    rel = [e.rel_error for e in errors]
    lines = [f"{len(errors)} matrices quantized; relative error ||W - Q(W)|| / ||W||: mean {sum(rel) / len(rel):.4f}, "
             f"max {max(rel):.4f}"]
    for e in sorted(errors, key=lambda e: -e.rel_error)[:worst]:
        lines.append(f"  {e.name:<48} {str(list(e.shape)):<14} {e.rel_error:.4f}")
    return lines


def run_quantize(args: argparse.Namespace) -> int:
    """Entry point of ``edgespec quantize``."""
    errors = quantize_checkpoint(args.src, args.dst, args.format, keep=args.keep, group_size=args.group_size,
                                 quantize_mtp=args.quantize_mtp, drop_mtp=args.drop_mtp,
                                 shard_bytes=args.shard_mb << 20, force=args.force)
    print("\n".join(format_errors(errors)))
    print(args.dst)
    return 0
