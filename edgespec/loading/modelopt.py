"""NVIDIA ModelOpt FP8 and MIXED_PRECISION checkpoints: the algorithm of every module, and its FP8 tensors.

``hf_quant_config.json`` (or ``quantization_config`` with ``quant_method: modelopt``) holds ``quant_algo``. NVFP4
alone is :func:`edgespec.loading.quant_config._nvfp4`'s; here:

* ``FP8``: every quantized linear layer has ``weight`` float8_e4m3fn ``[out, in]`` and ``weight_scale`` float32,
  one value (per-tensor, static), value = fp8 x scale; ``input_scale`` (static activation scale) is not used:
  edgespec serves weight-only. ``FP8_PER_CHANNEL_PER_TOKEN``: ``weight_scale`` ``[out]``. Both load as
  ``fp8_row``.
* ``MIXED_PRECISION``: ``quantized_layers`` maps each quantized module name to its own entry, ``{"quant_algo":
  "NVFP4", "group_size": 16}`` (also written ``W4A16_NVFP4``) or ``{"quant_algo": "FP8"}``; a module not listed
  stays in 16 bits (the export puts the others in ``exclude_modules``).

``kv_cache_quant_algo: FP8`` asks for an FP8 KV cache. Releases ship it without ``k_scale``/``v_scale`` (or with
scales edgespec does not need): edgespec's FP8 cache computes one scale per token and head as it writes each
row (amax / 448), so no calibration and no fixed 1.0 scale is used.
"""

from __future__ import annotations

from typing import Any

import torch

from edgespec.errors import UnsupportedModelError
from edgespec.loading.quant_spec import LayerScheme, QuantSpec
from edgespec.loading.safetensors_io import Slot
from edgespec.weights.fp8_row import FP8RowWeight

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_NVFP4 = ("NVFP4", "W4A16_NVFP4")
_FP8 = {"FP8": "tensor", "FP8_PER_CHANNEL_PER_TOKEN": "channel"}
SUPPORTED_ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8", "FP8_PER_CHANNEL_PER_TOKEN")


def _layer_scheme(entry: Any, module: str, source: str) -> LayerScheme:
    algo = str(entry.get("quant_algo", "") if isinstance(entry, dict) else entry).upper()
    label = f"quantized_layers.{module} ({algo})"
    if algo in _NVFP4:
        group = int(entry.get("group_size", 16)) if isinstance(entry, dict) else 16
        if group != 16:
            raise UnsupportedModelError(f"{source} {label}: NVFP4 with group_size {group} is not supported (16)")
        return LayerScheme("nvfp4", "modelopt", 16, label=label)
    if algo in _FP8:
        return LayerScheme("fp8_row", "modelopt", strategy=_FP8[algo], label=label)
    raise UnsupportedModelError(f"{source} {label}: modelopt quant_algo {algo!r} is not supported; supported per "
                                f"layer: {', '.join(SUPPORTED_ALGOS)}")


def kv_cache_format(q: dict[str, Any], notes: list[str]) -> str | None:
    """``fp8`` when ``kv_cache_quant_algo`` asks for an FP8 cache; other values are noted (edgespec's KV cache is
    the model dtype or its own per-token FP8, chosen by the serving settings)."""
    algo = q.get("kv_cache_quant_algo")
    if algo is None:
        return None
    if str(algo).upper() == "FP8":
        return "fp8"
    notes.append(f"kv_cache_quant_algo {algo!r} is not served: the KV cache follows the kv_dtype setting")
    return None


def parse_modelopt(q: dict[str, Any], source: str, excluded: list[str]) -> QuantSpec:
    """The :class:`QuantSpec` of a ModelOpt ``FP8``, ``FP8_PER_CHANNEL_PER_TOKEN`` or ``MIXED_PRECISION`` config."""
    algo = str(q.get("quant_algo", "")).upper()
    notes: list[str] = []
    kv = kv_cache_format(q, notes)
    if algo == "MIXED_PRECISION":
        layers = q.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise UnsupportedModelError(f"{source}: modelopt MIXED_PRECISION without a quantized_layers object")
        # Every entry is checked now, so an unsupported algorithm is named before any weight is read.
        table = {str(name): _layer_scheme(entry, str(name), source) for name, entry in layers.items()}

        def mixed(module: str) -> LayerScheme | None:
            # Our names drop a multimodal wrapper's "language_model." (checkpoint.normalise_key); configs keep it.
            wrapped = "model.language_model." + module[len("model."):] if module.startswith("model.") else module
            return table.get(module) or table.get(wrapped)

        notes.append("static activation scales (input_scale) are not used: weight-only products")
        return QuantSpec("modelopt", source, group_size=16, excluded=excluded, schemes=mixed, kv_cache=kv,
                         notes=notes)
    one = _layer_scheme({"quant_algo": algo}, "*", source)
    notes.append("static activation scales (input_scale) are not used: weight-only products")
    spec = QuantSpec("modelopt", source, excluded=excluded, kv_cache=kv, notes=notes)
    spec.schemes = lambda module: None if spec.is_excluded(module) else one
    return spec


def fp8_slots(name: str, w: FP8RowWeight, scheme: LayerScheme) -> dict[str, Slot]:
    """The ModelOpt FP8 tensors of one layer: ``weight`` and its per-tensor (or per-channel) ``weight_scale``."""
    out_f, in_f = w.out_features, w.in_features
    shape = (out_f,) if scheme.strategy == "channel" else ()
    return {f"{name}.weight": Slot(w.weight, (out_f, in_f), (torch.float8_e4m3fn,)),
            f"{name}.weight_scale": Slot(w.weight_scale, shape, _FLOAT, lambda t: t.float().reshape(-1).expand(out_f),
                                         hint=f" ({scheme.label})")}
