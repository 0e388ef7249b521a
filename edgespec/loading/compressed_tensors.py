"""llm-compressor's ``compressed-tensors`` checkpoints: the scheme of every module, and where its tensors go.

``quantization_config`` has ``quant_method: compressed-tensors``, a ``format`` (top level or per group) and
``config_groups``, each with ``targets`` (a class name such as ``Linear``, an exact module name, or ``re:REGEX``
matched from the start of the name) and a ``weights`` scheme; ``ignore`` lists modules (same syntax) left in 16
bits. A module takes the first group whose targets match it, unless ``ignore`` matches it. The layouts (checked
against compressed-tensors 0.20's compressors):

* ``pack-quantized`` int4 (W4A16): ``weight_packed`` int32 ``[out, in/8]`` (element 8j + i in bits 4i..4i+3 of
  word j, stored as the signed code + 8), ``weight_scale`` ``[out, in/g]`` (``[out, 1]`` per channel),
  ``weight_shape`` ``[2]``, and when asymmetric ``weight_zero_point`` int32 ``[out/8, in/g]`` packed the same way
  along the output dimension. value = (code - zero) x scale: in our int4 layout the stored nibbles as they are,
  the zero point the stored zero nibble (8 when symmetric). A pure bit shuffle.
* ``float-quantized`` (or ``naive-quantized``) FP8: ``weight`` float8_e4m3fn, ``weight_scale`` ``[out, 1]``
  (channel), one value (tensor) or ``[out/bo, in/bi]`` (block): value = fp8 x scale -> ``fp8_row`` (channel,
  tensor) or ``fp8_block``.
* ``nvfp4-pack-quantized``: ``weight_packed`` uint8 ``[out, in/2]`` (e2m1 codes, low nibble first),
  ``weight_scale`` float8_e4m3fn ``[out, in/16]``, ``weight_global_scale`` float32 ``[1]``: value = e2m1 x scale /
  global -> ``nvfp4`` with ``weight_scale_2`` = 1 / global (one fp32 rounding of a scalar).

Activation schemes (dynamic FP8 or int8 per token, NVFP4's W4A4) are served weight-only: activations stay in the
model dtype, which the notes say at load.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from edgespec.errors import CheckpointError, UnsupportedModelError
from edgespec.loading.quant_spec import LayerScheme, QuantSpec
from edgespec.loading.safetensors_io import Slot
from edgespec.weights.base import PackedWeight
from edgespec.weights.fp8_block import FP8BlockWeight
from edgespec.weights.fp8_row import FP8RowWeight
from edgespec.weights.int4 import Int4Weight, unpack_int32
from edgespec.weights.nvfp4 import NVFP4Weight, pack_nibbles

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
# Our parameter names drop the multimodal wrapper's prefix (checkpoint.normalise_key); configs name either.
_WRAPPED = ("model.", "model.language_model.")


def _refuse(where: str, group: str, what: str, why: str = "") -> UnsupportedModelError:
    return UnsupportedModelError(f"{where} config_groups.{group}: compressed-tensors {what} is not supported{why}; "
                                 "supported: pack-quantized int4 (group or channel, symmetric or with zero points), "
                                 "float-quantized fp8 (channel, tensor or block), nvfp4-pack-quantized")


def _group_scheme(name: str, group: dict[str, Any], fmt: str, where: str, notes: list[str]) -> LayerScheme:
    w = group.get("weights")
    if not isinstance(w, dict):
        raise UnsupportedModelError(f"{where} config_groups.{name}: no 'weights' scheme")
    kind, bits = str(w.get("type", "int")).lower(), int(w.get("num_bits", 0))
    strategy = str(w.get("strategy", "")).lower()
    acts = group.get("input_activations")
    label = f"config_groups.{name} ({fmt}, {kind}{bits} {strategy})"
    if w.get("dynamic"):
        raise _refuse(where, name, "dynamic weight quantization")
    if isinstance(acts, dict):
        notes.append(f"{label}: activations declared {acts.get('type', '?')}{acts.get('num_bits', '?')} "
                     f"({'dynamic' if acts.get('dynamic') else 'static'}) are served unquantized (weight-only)")
    if fmt == "pack-quantized":
        if kind != "int" or bits != 4:
            raise _refuse(where, name, f"pack-quantized {kind}{bits}", " (4-bit int only; 2/3/8-bit packs are not)")
        order = w.get("actorder")
        if order not in (None, False, "static", "weight"):
            raise _refuse(where, name, f"actorder {order!r}",
                          " (act-order reorders the input channels; re-export with actorder null or 'static')")
        if strategy == "group":
            group_size = int(w.get("group_size") or 0)
            if group_size <= 0:
                raise _refuse(where, name, "group strategy without group_size")
        elif strategy == "channel":
            group_size = 0
        else:
            raise _refuse(where, name, f"int4 strategy {strategy!r}", " (group or channel)")
        return LayerScheme("int4", "ct", group_size, bool(w.get("symmetric", True)), label=label)
    if fmt in ("float-quantized", "naive-quantized"):      # naive: what 0.20 writes for FP8 in mixed models
        if kind != "float" or bits != 8:
            raise _refuse(where, name, f"float-quantized {kind}{bits}")
        if strategy in ("channel", "tensor"):
            return LayerScheme("fp8_row", "ct", strategy=strategy, label=label)
        if strategy == "block":
            block = w.get("block_structure")
            if not (isinstance(block, list) and len(block) == 2):
                raise _refuse(where, name, "fp8 block strategy without block_structure [rows, cols]")
            return LayerScheme("fp8_block", "ct", block=(int(block[0]), int(block[1])), label=label)
        raise _refuse(where, name, f"fp8 strategy {strategy!r}", " (channel, tensor or block)")
    if fmt == "nvfp4-pack-quantized":
        if kind != "float" or bits != 4 or int(w.get("group_size") or 0) != 16:
            raise _refuse(where, name, f"nvfp4-pack-quantized {kind}{bits} group {w.get('group_size')}")
        return LayerScheme("nvfp4", "ct", 16, label=label)
    raise _refuse(where, name, f"format {fmt!r}")


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        pattern = target[3:]
        return any(re.match(pattern, n) is not None for n in _names(name))
    # Every module asked about is a linear layer: the class targets that cover it are Linear's.
    return target == "Linear" or name == target or target in _names(name)


def _names(name: str) -> list[str]:
    """``name`` and its spelling inside a multimodal wrapper (``model.language_model.layers...``)."""
    if name.startswith(_WRAPPED[0]):
        return [name, _WRAPPED[1] + name[len(_WRAPPED[0]):]]
    return [name]


def parse_compressed_tensors(qc: dict[str, Any], where: str) -> QuantSpec:
    """The :class:`QuantSpec` of a ``compressed-tensors`` quantization config; named errors for what stays
    unsupported (act-order, other bit widths, sparse and MX formats, dynamic weights)."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise UnsupportedModelError(f"{where}: compressed-tensors config without config_groups")
    top = qc.get("format")
    notes: list[str] = []
    table: list[tuple[list[str], LayerScheme]] = []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise UnsupportedModelError(f"{where} config_groups.{name}: must be an object")
        targets = group.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise UnsupportedModelError(f"{where} config_groups.{name}: 'targets' must be a list of names")
        fmt = str(group.get("format") or top or "").lower()
        table.append((targets, _group_scheme(name, group, fmt, where, notes)))
    ignore = [str(p) for p in qc.get("ignore") or []]
    kv = qc.get("kv_cache_scheme")
    kv_cache = None
    if isinstance(kv, dict):
        if str(kv.get("type", "")).lower() != "float" or int(kv.get("num_bits", 0)) != 8:
            raise UnsupportedModelError(f"{where} kv_cache_scheme: {kv.get('type')}{kv.get('num_bits')} KV cache is "
                                        "not supported (fp8 only)")
        kv_cache = "fp8"

    def scheme(module: str) -> LayerScheme | None:
        if any(_matches(module, p) for p in ignore):
            return None
        for targets, s in table:
            if any(_matches(module, t) for t in targets):
                return s
        return None

    return QuantSpec("compressed-tensors", where, excluded=ignore, schemes=scheme, kv_cache=kv_cache, notes=notes)


# ---- tensors -> buffers ---------------------------------------------------------------------------------------
def _int4_codes(packed: torch.Tensor) -> torch.Tensor:
    """``weight_packed [out, in/8]`` int32 -> our ``[out, in/2]`` uint8 (the stored nibbles, input order kept)."""
    return pack_nibbles(unpack_int32(packed).reshape(packed.shape[0], -1))


def _zero_points(packed: torch.Tensor, out_f: int) -> torch.Tensor:
    """``weight_zero_point [ceil(out/8), groups]`` int32 (packed along the outputs) -> ``[out, groups]`` uint8."""
    nib = unpack_int32(packed.t().contiguous())            # [groups, out/8, 8]: output 8j + i in nibble i
    return nib.reshape(packed.shape[1], -1)[:, :out_f].t().to(torch.uint8).contiguous()


def layer_slots(name: str, w: PackedWeight, scheme: LayerScheme) -> dict[str, Slot]:
    """The compressed-tensors tensors of one packed layer ``name`` and where each goes."""
    out_f, in_f = w.out_features, w.in_features
    if isinstance(w, Int4Weight):
        groups = in_f // w.group_size

        def codes(t: torch.Tensor) -> torch.Tensor:
            if scheme.symmetric:
                w.zeros.fill_(8)        # symmetric: the zero is the +8 offset of the stored codes, not a tensor
            return _int4_codes(t)

        def shape_check(t: torch.Tensor) -> None:
            if t.tolist() != [out_f, in_f]:
                raise CheckpointError(f"weight_shape {t.tolist()} is not the layer's [{out_f}, {in_f}]")

        slots = {f"{name}.weight_packed": Slot(w.qweight, (out_f, in_f // 8), (torch.int32,), codes,
                                               hint=" (pack-quantized int4: [out, in/8] int32)"),
                 f"{name}.weight_scale": Slot(w.scales, (out_f, groups), _FLOAT, hint=f" ({scheme.label})"),
                 f"{name}.weight_shape": Slot(None, (2,), (torch.int64, torch.int32), shape_check, optional=True)}
        if not scheme.symmetric:
            slots[f"{name}.weight_zero_point"] = Slot(w.zeros, (-(-out_f // 8), groups), (torch.int32,),
                                                      lambda t: _zero_points(t, out_f))
        return slots
    if isinstance(w, FP8RowWeight):
        scale_shape = (out_f, 1) if scheme.strategy == "channel" else ()
        return {f"{name}.weight": Slot(w.weight, (out_f, in_f), (torch.float8_e4m3fn,)),
                f"{name}.weight_scale": Slot(w.weight_scale, scale_shape, _FLOAT,
                                             lambda t: t.float().reshape(-1).expand(out_f),
                                             hint=f" ({scheme.label})")}
    if isinstance(w, FP8BlockWeight):
        return {f"{name}.weight": Slot(w.weight, (out_f, in_f), (torch.float8_e4m3fn,)),
                f"{name}.weight_scale": Slot(w.weight_scale_inv, tuple(w.weight_scale_inv.shape), _FLOAT,
                                             hint=f" (one scale per {w.block[0]}x{w.block[1]} block)")}
    assert isinstance(w, NVFP4Weight)
    return {f"{name}.weight_packed": Slot(w.weight, (out_f, in_f // 2), (torch.uint8,),
                                          hint=" (two e2m1 values per byte)"),
            f"{name}.weight_scale": Slot(w.weight_scale, (out_f, in_f // 16), (torch.float8_e4m3fn,),
                                         hint=" (one e4m3 scale per 16 inputs)"),
            f"{name}.weight_global_scale": Slot(w.weight_scale_2, (), _FLOAT, lambda t: 1.0 / t.float().reshape(()),
                                                hint=" (one global scale, a divisor)")}
