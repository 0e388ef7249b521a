"""Quantized linear layers of a checkpoint: which format each layer has, and where each of its tensors goes.

A layer's format is read from its tensors, under the method the config declares (:mod:`quant_config`): a layer
whose file has ``weight_scale_inv`` (or a float8 ``weight``) is block-FP8, ``weight_scale`` (or a uint8 ``weight``)
NVFP4, ``qweight`` int4; a layer with a 16-bit ``weight`` only stays dense, as the file has it. Releases keep
lm_head, embeddings, norms and parts of the GDN layers in bf16, and their ``modules_to_not_convert`` lists are
not always complete (MTP layers, the small GDN projections), so the tensors, not the list, decide.
Each packed layer's tensors map to :class:`~edgespec.loading.safetensors_io.Slot` s: copied straight into its
buffers, or repacked on the host one tensor at a time (AWQ/GPTQ -> the int4 layout).
"""

from __future__ import annotations

import torch
from torch import nn

from edgespec.errors import CheckpointError
from edgespec.loading.quant_config import QuantSpec
from edgespec.loading.safetensors_io import Slot, TensorEntry
from edgespec.models.layers import Linear
from edgespec.weights.base import PackedLinear, PackedWeight
from edgespec.weights.fp8_block import FP8BlockWeight
from edgespec.weights.fp8_row import FP8RowWeight
from edgespec.weights.int4 import Int4Weight
from edgespec.weights.nvfp4 import NVFP4Weight

# Per-layer tensors a weight-only runtime does not use: activation scales (activations are quantized dynamically
# or not at all) and KV-cache scales (edgespec computes its own per token and head).
IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".output_scale", ".input_global_scale",
                    ".input_zero_point")
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def ignored(name: str) -> bool:
    return name.endswith(IGNORED_SUFFIXES)


def _scheme_format(name: str, spec: QuantSpec, entries: dict[str, TensorEntry]) -> str | None:
    """Per-module formats (compressed-tensors, ModelOpt mixed): the config names the scheme, the tensors must agree.
    Quantized tensors in a module the config leaves unquantized are refused; a 16-bit weight loads as it is."""
    weight = entries.get(name + ".weight")
    quantized = name + ".weight_packed" in entries or (
        weight is not None and weight.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int32))
    scheme = spec.scheme_for(name)
    if scheme is None:
        if quantized:
            raise CheckpointError(f"{spec.source}: layer {name} has quantized tensors but the config leaves it "
                                  "unquantized (in 'ignore' / 'exclude_modules', or no config group targets it)")
        return None
    return scheme.fmt if quantized else None


def _layer_format(name: str, spec: QuantSpec, entries: dict[str, TensorEntry]) -> str | None:
    if spec.schemes is not None:
        return _scheme_format(name, spec, entries)
    weight = entries.get(name + ".weight")
    if spec.method == "fp8_block":
        if name + ".weight_scale_inv" in entries or (weight is not None and weight.dtype == torch.float8_e4m3fn):
            return "fp8_block"
    elif spec.method == "nvfp4":
        if name + ".weight_scale" in entries or (weight is not None and weight.dtype == torch.uint8):
            return "nvfp4"
    elif name + ".qweight" in entries:
        return spec.method
    return None


def _packed(fmt: str, out_f: int, in_f: int, spec: QuantSpec, dtype: torch.dtype, name: str) -> PackedWeight:
    try:
        if fmt == "fp8_block" and spec.schemes is None:
            return FP8BlockWeight(out_f, in_f, dtype, spec.block, device="meta")
        if fmt == "nvfp4":
            return NVFP4Weight(out_f, in_f, dtype, device="meta")
        if fmt == "fp8_row":
            return FP8RowWeight(out_f, in_f, dtype, device="meta")
        scheme = spec.scheme_for(name)
        if fmt == "fp8_block" and scheme is not None:
            return FP8BlockWeight(out_f, in_f, dtype, scheme.block, device="meta")
        size = scheme.group_size if scheme is not None else spec.group_size
        group = in_f if size <= 0 else size
        return Int4Weight(out_f, in_f, dtype, group, device="meta")
    except ValueError as e:
        raise CheckpointError(f"{spec.source}: layer {name}: {e}") from None


def pack_linears(model: nn.Module, spec: QuantSpec, entries: dict[str, TensorEntry], dtype: torch.dtype) -> int:
    """Replace (on the meta device) every Linear of ``model`` whose checkpoint tensors are quantized by a
    :class:`PackedLinear` of that format. ``entries`` are keyed by parameter name. Returns the count replaced."""
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        fmt = _layer_format(name, spec, entries)
        if fmt is None:
            continue
        packed = _packed(fmt, module.out_features, module.in_features, spec, dtype, name)
        bias = torch.empty(module.out_features, dtype=module.bias.dtype, device="meta") \
            if module.bias is not None else None
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, PackedLinear(packed, bias))
        count += 1
    return count


def part_view(merged: PackedWeight, start: int, stop: int) -> PackedWeight:
    """A weight of the same format whose buffers are rows ``start:stop`` of ``merged``'s (views, no memory): the
    part of a projection merged on the meta device, so its checkpoint tensors load straight into place."""
    rows = stop - start
    if isinstance(merged, FP8BlockWeight):
        view = FP8BlockWeight(rows, merged.in_features, merged.compute_dtype, merged.block, device="meta")
        bo = merged.block[0]
        view._buffers["weight_scale_inv"] = merged.weight_scale_inv[start // bo:-(-stop // bo)]
        view._buffers["weight"] = merged.weight[start:stop]
        return view
    if isinstance(merged, FP8RowWeight):
        view = FP8RowWeight(rows, merged.in_features, merged.compute_dtype, device="meta")
        for name in ("weight", "weight_scale"):
            view._buffers[name] = getattr(merged, name)[start:stop]
        return view
    if isinstance(merged, Int4Weight):
        view = Int4Weight(rows, merged.in_features, merged.compute_dtype, merged.group_size, device="meta")
        for name in ("qweight", "scales", "zeros"):
            view._buffers[name] = getattr(merged, name)[start:stop]
        return view
    raise CheckpointError(f"internal: {merged.format} weights are not merged before loading")


def packed_slots(name: str, layer: PackedLinear, spec: QuantSpec) -> dict[str, Slot]:
    """The checkpoint tensors of one packed layer ``name`` and where each goes (its ``bias`` is a parameter and is
    loaded with the dense ones)."""
    w = layer.weight
    out_f, in_f = w.out_features, w.in_features
    scheme = spec.scheme_for(name)
    if scheme is not None and scheme.layout == "ct":
        from edgespec.loading.compressed_tensors import layer_slots
        return layer_slots(name, w, scheme)
    if isinstance(w, FP8RowWeight):
        from edgespec.loading.modelopt import fp8_slots
        assert scheme is not None
        return fp8_slots(name, w, scheme)
    if isinstance(w, FP8BlockWeight):
        return {f"{name}.weight": Slot(w.weight, tuple(w.weight.shape), (torch.float8_e4m3fn,)),
                f"{name}.weight_scale_inv": Slot(w.weight_scale_inv, tuple(w.weight_scale_inv.shape), _FLOAT,
                                                 hint=f" (one scale per {w.block[0]}x{w.block[1]} block)")}
    if isinstance(w, NVFP4Weight):
        return {f"{name}.weight": Slot(w.weight, tuple(w.weight.shape), (torch.uint8,),
                                       hint=" (two e2m1 values per byte)"),
                f"{name}.weight_scale": Slot(w.weight_scale, tuple(w.weight_scale.shape), (torch.float8_e4m3fn,),
                                             hint=" (one e4m3 scale per 16 inputs)"),
                f"{name}.weight_scale_2": Slot(w.weight_scale_2, (), _FLOAT, hint=" (one global scale)")}
    assert isinstance(w, Int4Weight)
    g = w.group_size
    groups = in_f // g
    i32 = (torch.int32,)
    scales = Slot(w.scales, (groups, out_f), (torch.float16, torch.bfloat16, torch.float32),
                  transform=lambda t: t.t().contiguous())
    if spec.method == "awq":
        return {f"{name}.qweight": Slot(w.qweight, (in_f, out_f // 8), i32, Int4Weight.awq_qweight,
                                        hint=" (AWQ GEMM: [in, out/8] int32)"),
                f"{name}.qzeros": Slot(w.zeros, (groups, out_f // 8), i32, Int4Weight.awq_zeros),
                f"{name}.scales": scales}
    key = f"{name}.g_idx"

    def check_g_idx(t: torch.Tensor) -> None:
        if not torch.equal(t.long(), torch.arange(in_f) // g):
            raise CheckpointError(f"{key} is not the trivial group order (an act-order checkpoint although "
                                  f"desc_act is false?)")
        return None

    return {f"{name}.qweight": Slot(w.qweight, (in_f // 8, out_f), i32, Int4Weight.gptq_qweight,
                                    hint=" (GPTQ: [in/8, out] int32)"),
            f"{name}.qzeros": Slot(w.zeros, (groups, out_f // 8), i32,
                                   lambda t: Int4Weight.gptq_zeros(t, spec.zeros_minus_one)),
            f"{name}.scales": scales,
            key: Slot(None, (in_f,), i32, check_g_idx, optional=True)}
