"""Which quantized format a checkpoint folder declares, read from ``config.json`` / ``hf_quant_config.json``.

Supported (see docs/weights.md): Qwen block-FP8 (``quant_method: fp8`` with ``weight_block_size``), NVIDIA ModelOpt
NVFP4 (``hf_quant_config.json`` ``quant_algo: NVFP4`` and/or ``quant_method: modelopt``), AWQ in the GEMM layout and
GPTQ without act-order, both 4-bit; llm-compressor's ``compressed-tensors`` (:mod:`compressed_tensors`) and ModelOpt
``MIXED_PRECISION`` / FP8 (:mod:`modelopt`), whose format is chosen module by module (:mod:`quant_spec`).
Anything else is refused by name before a byte of weights is read: a key error or silent garbage later would
tell the user nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgespec.errors import UnsupportedModelError
from edgespec.loading.hf_config import read_json
from edgespec.loading.quant_spec import QuantSpec

SUPPORTED = ("fp8 (block-wise, weight_block_size)", "modelopt NVFP4 / FP8 / MIXED_PRECISION", "awq (4-bit, GEMM)",
             "gptq (4-bit, desc_act false)",
             "compressed-tensors (pack-quantized int4, float-quantized fp8, nvfp4-pack-quantized)")


def _unsupported(name: str, source: str, why: str = "") -> UnsupportedModelError:
    return UnsupportedModelError(f"{source}: quantized checkpoint format {name} is not supported{why}; supported: "
                                 + ", ".join(SUPPORTED))


def _patterns(qc: dict[str, Any], *keys: str) -> list[str]:
    out: list[str] = []
    for k in keys:
        v = qc.get(k)
        if isinstance(v, list):
            out.extend(str(x) for x in v)
    return out


def _nvfp4(q: dict[str, Any], source: str, excluded: list[str]) -> QuantSpec:
    algo = str(q.get("quant_algo", "")).upper()
    if algo in ("MIXED_PRECISION", "FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
        from edgespec.loading.modelopt import parse_modelopt
        return parse_modelopt(q, source, excluded + _patterns(q, "exclude_modules", "ignore"))
    if algo != "NVFP4":
        raise _unsupported(f"modelopt {q.get('quant_algo')!r}", source)
    group = int(q.get("group_size", 16))
    if group != 16:
        raise _unsupported(f"modelopt NVFP4 with group_size {group}", source, " (NVFP4 uses 16)")
    from edgespec.loading.modelopt import kv_cache_format
    notes: list[str] = []
    return QuantSpec("nvfp4", source, group_size=16,
                     excluded=excluded + _patterns(q, "exclude_modules", "ignore", "modules_to_not_convert"),
                     kv_cache=kv_cache_format(q, notes), notes=notes)


def parse_quant_config(raw: dict[str, Any], folder: Path | None = None) -> QuantSpec | None:
    """The :class:`QuantSpec` of a config dict (and ``folder/hf_quant_config.json``), None for a dense checkpoint."""
    source = str(folder / "config.json") if folder else "config.json"
    qc = raw.get("quantization_config")
    if qc is None and isinstance(raw.get("text_config"), dict):
        qc = raw["text_config"].get("quantization_config")
    hf_quant = folder / "hf_quant_config.json" if folder else None
    if hf_quant is not None and hf_quant.is_file():
        q = read_json(hf_quant).get("quantization")
        if not isinstance(q, dict):
            raise UnsupportedModelError(f"{hf_quant}: missing 'quantization' object")
        extra = _patterns(qc, "ignore", "exclude_modules", "modules_to_not_convert") if isinstance(qc, dict) else []
        return _nvfp4(q, str(hf_quant), extra)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedModelError(f"{source}: quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()
    excluded = _patterns(qc, "modules_to_not_convert", "ignore", "exclude_modules", "ignored_layers")
    where = f"{source} quantization_config"
    if method == "fp8":
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise _unsupported(f"fp8 fmt {fmt!r}", where, " (only e4m3 weights)")
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2):
            raise _unsupported("fp8 without weight_block_size (per-tensor FP8)", where)
        return QuantSpec("fp8_block", where, block=(int(block[0]), int(block[1])), excluded=excluded)
    if method == "modelopt":
        inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
        return _nvfp4(inner, where, excluded)
    if method in ("awq", "gptq"):
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        if bits != 4:
            raise _unsupported(f"{method} with bits={bits}", where, " (4-bit only)")
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise _unsupported(f"awq version {version!r}", where, " (the GEMM layout only)")
            if not qc.get("zero_point", True):
                raise _unsupported("awq with zero_point false", where)
            return QuantSpec("awq", where, group_size=group, excluded=excluded)
        if qc.get("desc_act"):
            raise _unsupported("gptq with desc_act true", where,
                               " (act-order reorders the input channels; re-export with desc_act false)")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise _unsupported(f"gptq checkpoint_format {fmt!r}", where)
        return QuantSpec("gptq", where, group_size=group, zeros_minus_one=fmt == "gptq", excluded=excluded)
    if method == "compressed-tensors":
        from edgespec.loading.compressed_tensors import parse_compressed_tensors
        return parse_compressed_tensors(qc, where)
    raise _unsupported(repr(qc.get("quant_method")), where)


def detect_quantization(folder: Path) -> QuantSpec | None:
    """Read ``folder/config.json`` (and ``hf_quant_config.json``) and return its :class:`QuantSpec`."""
    return parse_quant_config(read_json(folder / "config.json"), folder)
