"""Read safetensors checkpoints (single file or sharded with ``*.safetensors.index.json``) with named errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from edgespec.errors import CheckpointError
from edgespec.loading.hf_config import read_json
from edgespec.loading.safetensors_io import Slot, fill_slots, read_headers


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


def checkpoint_bytes(folder: str | Path | None) -> int:
    """Bytes of the tensors of a safetensors checkpoint folder (0 for None): a drafter's share of the memory
    budget (``edgespec.memory``), read from the headers only."""
    if folder is None:
        return 0
    return sum(e.nbytes for e in read_headers(weight_files(Path(folder))).values())


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

    Tensors stream from the files into the parameters (:mod:`edgespec.loading.safetensors_io`): no tensor is
    held twice. Returns the problems found (shape mismatches, missing and unexpected keys), each naming key and
    file, so the caller reports them all at once: a partly loaded model would produce plausible-looking garbage.
    """
    slots = {name: Slot(p.data, tuple(p.shape), hint=shape_hint(name)) for name, p in params.items()}
    return fill_slots(slots, read_headers(files), name_of)
