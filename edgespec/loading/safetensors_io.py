"""Stream safetensors tensors straight into preallocated parameters, one bounded chunk at a time.

``safe_open`` maps a whole file: every page a load touches stays in the process's resident set until the file is
closed, so loading a single-file checkpoint onto the CPU showed twice the weights as peak RSS, and a GPU load held
a whole shard resident. Here the header is parsed once (named errors for truncated files), and each tensor is read
with ``readinto``: directly into the parameter's memory when it is a CPU tensor of the same dtype, otherwise through
one reusable staging buffer of :data:`STAGING_BYTES` (pinned on CUDA) whose chunks are cast and copied into place.
Peak extra host memory of a load is therefore one staging buffer, whatever the shard or tensor size.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from edgespec.errors import CheckpointError

# Host bytes staged per copy to a device (or per dtype cast): bounds a load's extra host memory.
STAGING_BYTES = 64 << 20

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file (absolute byte range) and what it holds."""

    key: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of one safetensors file, checked against the file size (a truncated shard is named here,
    before anything is allocated)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"header of {n} bytes does not fit the file's {size} bytes")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read weights from {path}: {e} (truncated or corrupt file?)") from None
    base = 8 + n
    out: dict[str, TensorEntry] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(v) for v in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"cannot read weights from {path}: tensor {key} has a malformed header entry "
                                  f"{info!r} (truncated or corrupt file?)") from None
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize:
            raise CheckpointError(f"cannot read weights from {path}: tensor {key} {info['dtype']}{list(shape)} "
                                  f"spans {end - begin} bytes (truncated or corrupt file?)")
        if base + end > size:
            raise CheckpointError(f"cannot read weights from {path}: tensor {key} ends at byte {base + end} but the "
                                  f"file has {size} bytes (truncated or corrupt file?)")
        out[key] = TensorEntry(key, path, dtype, shape, base + begin, base + end)
    return out


def read_headers(files: list[Path]) -> dict[str, TensorEntry]:
    """The tensors of all ``files`` by key (a key present twice is an error naming both files)."""
    entries: dict[str, TensorEntry] = {}
    for path in files:
        for key, entry in read_header(path).items():
            if key in entries:
                raise CheckpointError(f"tensor {key} is in both {entries[key].path.name} and {path.name}")
            entries[key] = entry
    return entries


class TensorReader:
    """Reads tensors of a checkpoint into destinations; keeps one file open at a time and one staging buffer."""

    def __init__(self) -> None:
        self._file = None
        self._path: Path | None = None
        self._staging: torch.Tensor | None = None

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._drop_cache()
            self._file.close()
        self._file = self._path = None
        self._staging = None

    def _drop_cache(self) -> None:
        # On Jetson the page cache of a finished shard competes with the weights for the same 128 GB: drop it.
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass

    def _open(self, path: Path):
        if self._path != path:
            self.close()
            try:
                self._file = open(path, "rb", buffering=0)
            except OSError as e:
                raise CheckpointError(f"cannot read weights from {path}: {e}") from None
            self._path = path
        return self._file

    def _read_exact(self, entry: TensorEntry, offset: int, view: memoryview) -> None:
        f = self._open(entry.path)
        f.seek(entry.start + offset)
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise CheckpointError(f"cannot read weights from {entry.path}: tensor {entry.key} ends early "
                                      f"(truncated or corrupt file?)")
            got += n

    def _staging_buffer(self, device: torch.device) -> torch.Tensor:
        if self._staging is None:
            pin = device.type == "cuda"
            self._staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=pin)
        return self._staging

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """The whole tensor as a new CPU tensor of its own dtype (for tensors that are repacked before use)."""
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_into(entry, out)
        return out

    def read_into(self, entry: TensorEntry, dest: torch.Tensor) -> None:
        """Copy ``entry`` into ``dest`` (same number of elements; dtype cast between float types only)."""
        if dest.numel() != _numel(entry.shape):
            raise CheckpointError(f"tensor {entry.key} in {entry.path.name}: {_numel(entry.shape)} values for a "
                                  f"destination of {dest.numel()}")
        if entry.dtype != dest.dtype and not (entry.dtype in _FLOATS and dest.dtype in _FLOATS):
            raise CheckpointError(f"tensor {entry.key} in {entry.path.name} is {_name(entry.dtype)} but its "
                                  f"parameter holds {_name(dest.dtype)}: a quantized tensor without the "
                                  f"quantization_config or scales that describe it cannot be loaded")
        if entry.nbytes == 0:
            return
        if dest.device.type == "cpu" and dest.dtype == entry.dtype and dest.is_contiguous():
            self._read_exact(entry, 0, memoryview(_bytes_of(dest).numpy()))
            return
        flat = dest.reshape(-1) if dest.is_contiguous() else None
        if flat is None:
            raise CheckpointError(f"internal: destination of {entry.key} is not contiguous")
        staging = self._staging_buffer(dest.device)
        item = entry.dtype.itemsize
        per = max(1, STAGING_BYTES // item)
        total = _numel(entry.shape)
        for s in range(0, total, per):
            e = min(total, s + per)
            chunk = staging[:(e - s) * item]
            self._read_exact(entry, s * item, memoryview(chunk.numpy()))
            flat[s:e].copy_(chunk.view(entry.dtype))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass
class Slot:
    """Where one checkpoint tensor goes: ``dest`` (a parameter, buffer or row slice), the checkpoint ``shape`` and
    ``dtypes`` it must have, and an optional ``transform`` (AWQ/GPTQ repacking, validations) applied to the whole
    tensor on the host before it is copied into ``dest`` (``dest`` None: the tensor is only checked)."""

    dest: torch.Tensor | None
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...] | None = None
    transform: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    hint: str = ""
    optional: bool = False


def _same_shape(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    # A scalar is written as [] by some exporters and as [1] by others.
    return a == b or (_numel(a) == 1 and _numel(b) == 1 and len(a) <= 1 and len(b) <= 1)


def fill_slots(slots: dict[str, Slot], entries: dict[str, TensorEntry],
               key_of: Callable[[str], str | None]) -> list[str]:
    """Load every checkpoint tensor into its slot (``key_of`` maps a checkpoint key to a slot name; None: ignored).

    Returns the problems found (unexpected keys, wrong shapes or dtypes, missing tensors), each naming the tensor
    and file, so the caller reports them all at once: a partly loaded model would produce plausible garbage.
    """
    seen: set[str] = set()
    unexpected: list[str] = []
    bad: list[str] = []
    with TensorReader() as reader:
        # File order, then offset order: each shard is read front to back, once.
        for entry in sorted(entries.values(), key=lambda e: (str(e.path), e.start)):
            name = key_of(entry.key)
            if name is None:
                continue
            slot = slots.get(name)
            if slot is None:
                unexpected.append(f"{entry.key} (in {entry.path.name})")
                continue
            if not _same_shape(tuple(slot.shape), entry.shape):
                bad.append(f"{entry.key} in {entry.path.name}: checkpoint {entry.shape}, expected "
                           f"{tuple(slot.shape)}{slot.hint}")
                continue
            if slot.dtypes is not None and entry.dtype not in slot.dtypes:
                bad.append(f"{entry.key} in {entry.path.name}: checkpoint dtype {_name(entry.dtype)}, expected "
                           + " or ".join(_name(d) for d in slot.dtypes))
                continue
            with torch.no_grad():
                if slot.transform is None:
                    reader.read_into(entry, slot.dest)
                else:
                    try:
                        value = slot.transform(reader.read(entry))
                    except CheckpointError as e:
                        bad.append(f"{entry.key} in {entry.path.name}: {e}")
                        continue
                    if slot.dest is not None:
                        slot.dest.copy_(value)
            seen.add(name)
    missing = [n for n, s in slots.items() if n not in seen and not s.optional]
    problems = []
    if bad:
        problems.append("shape mismatch: " + "; ".join(bad))
    for label, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            problems.append(f"{label} key(s): " + ", ".join(keys[:20]) + (" ..." if len(keys) > 20 else ""))
    return problems
