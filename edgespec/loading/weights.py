"""Read safetensors checkpoints (single file or sharded with ``*.safetensors.index.json``) with named errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from edgespec.errors import CheckpointError
from edgespec.loading.hf_config import read_json


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, checked to exist."""
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder not found: {folder}")
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        index = read_json(indexes[0])
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{indexes[0]}: missing or empty 'weight_map'")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{indexes[0]} names shard(s) that are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {folder}")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """Yield ``(key, file, tensor)`` for every tensor; a truncated or corrupt file raises naming the file."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    yield key, path, f.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"cannot read weights from {path}: {e} (truncated or corrupt file?)") from None


def load_parameters(params: dict[str, torch.Tensor], files: list[Path], name_of: Callable[[str], str | None],
                    shape_hint: Callable[[str], str] = lambda name: "") -> list[str]:
    """Copy every checkpoint tensor into the parameter ``name_of(key)`` (None: ignored key), checking shapes.

    Returns the problems found (shape mismatches, missing and unexpected keys), each naming key and file, so the
    caller reports them all at once: a partly loaded model would produce plausible-looking garbage.
    """
    seen: set[str] = set()
    unexpected: list[str] = []
    mismatched: list[str] = []
    for key, path, tensor in iter_tensors(files):
        name = name_of(key)
        if name is None:
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(f"{key} (in {path.name})")
            continue
        if tuple(param.shape) != tuple(tensor.shape):
            mismatched.append(f"{key} in {path.name}: checkpoint {tuple(tensor.shape)}, expected "
                              f"{tuple(param.shape)}{shape_hint(name)}")
            continue
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        seen.add(name)
    missing = sorted(set(params) - seen)
    problems = []
    if mismatched:
        problems.append("shape mismatch: " + "; ".join(mismatched))
    for label, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            problems.append(f"{label} key(s): " + ", ".join(keys[:20]) + (" ..." if len(keys) > 20 else ""))
    return problems
