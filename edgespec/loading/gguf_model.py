"""Load a llama-, qwen3- or qwen35-architecture GGUF natively: its Q4_0 / Q4_1 / Q8_0 and K-quant tensors stay
in their blocks (qwen35: in the file's own value-head order, edgespec.loading.gguf_qwen35).

The config and tokenizer come from :func:`edgespec.loading.gguf_meta.gguf_metadata_folder` (the same metadata
reading as the fp32 conversion, without the weights); the tensors are read from the memory-mapped file:

* quantized matrices become :class:`~edgespec.weights.base.PackedLinear` layers holding a
  :class:`~edgespec.weights.gguf.GGUFBlockWeight` (the file's bytes; q/k rows put back in HF's RoPE order,
  which moves whole rows of blocks and so changes no value);
* a quantized token embedding becomes a :class:`PackedEmbedding`; with tied embeddings the output head is that
  same packed weight, so the logits use the packed product too;
* F32 / F16 / BF16 tensors (norms, unquantized matrices) load as dense parameters of the model dtype.

The fp32 conversion (``edgespec convert``, ``weights: fp32``) stays the oracle this path is tested against.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from edgespec.errors import CheckpointError, UnsupportedModelError
from edgespec.loading.gguf_meta import (
    GGUF_ARCHS,
    ROPE_PERMUTED_ARCHS,
    _hf_name,
    _unpermute_rows,
    gguf_metadata_folder,
)
from edgespec.loading.gguf_qwen35 import is_mtp_tensor, qwen35_dense_value
from edgespec.loading.hf_config import load_config
from edgespec.loading.resident import settle, small_pages
from edgespec.models.decoder import TargetModel
from edgespec.models.layers import RotaryEmbedding
from edgespec.models.meta_init import materialize, meta_modules
from edgespec.weights.base import PackedEmbedding, PackedLinear
from edgespec.weights.gguf import GGML_FORMATS
from edgespec.weights.gguf_kquants import K_FORMATS

# ggml type ids of unquantized tensors and their numpy dtypes.
_DENSE = {0: np.float32, 1: np.float16, 30: None}   # 30 = BF16 (gguf-py returns its raw uint8 bytes)


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: ``shape`` innermost dimension first (as GGUF lists it); ``data`` a read-only
    view of the mapped file (uint8 ``[rows, row_bytes]`` for block types, the element dtype otherwise) starting at
    byte ``offset`` of the file."""

    name: str
    tensor_type: int
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int = -1


# Byte sizes of GGUF metadata value types (8 = string, 9 = array are variable).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _HeaderCursor:
    """Reads a GGUF header's little-endian fields in order from a buffer."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> tuple:
        vals = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return vals

    def text(self) -> str:
        (n,) = self.take("Q")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8")

    def skip_value(self, kind: int) -> None:
        if kind == 8:                        # string
            (n,) = self.take("Q")
            self.pos += n
        elif kind == 9:                      # array
            sub, count = self.take("IQ")
            if sub in _SCALAR_BYTES:
                self.pos += _SCALAR_BYTES[sub] * count
            else:
                for _ in range(count):
                    self.skip_value(sub)
        else:
            self.pos += _SCALAR_BYTES[kind]


def _read_header(path: Path, buf: memoryview) -> tuple[list[tuple[str, tuple, int, int]], int]:
    """The tensor infos ``(name, dims, ggml type, offset)`` of a GGUF header and the byte where tensor data starts;
    metadata values are skipped, not decoded (only ``general.alignment`` is read)."""
    cur = _HeaderCursor(buf)
    try:
        magic, version, n_tensors, n_kv = cur.take("4sIQQ")
        if magic != b"GGUF" or version < 2:
            raise CheckpointError(f"{path}: not a GGUF v2/v3 file (magic {magic!r}, version {version})")
        alignment = 32
        for _ in range(n_kv):
            (n,) = cur.take("Q")
            key = bytes(buf[cur.pos:cur.pos + n]).decode("utf-8", errors="replace")
            cur.pos += n
            (kind,) = cur.take("I")
            if key == "general.alignment" and kind == 4:
                (alignment,) = cur.take("I")
            else:
                cur.skip_value(kind)
        infos = []
        for _ in range(n_tensors):
            name = cur.text()
            (n_dims,) = cur.take("I")
            dims = cur.take("Q" * n_dims)
            kind, offset = cur.take("IQ")
            infos.append((name, dims, kind, offset))
    except (struct.error, KeyError, RecursionError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file (header: {exc})") from None
    return infos, (cur.pos + alignment - 1) // alignment * alignment


def _tensor_view(path: Path, mm: np.ndarray, start: int, name: str, dims: tuple, kind: int,
                 offset: int) -> GGUFTensor:
    """One tensor of the mapped file ``mm`` as a view of its bytes: float types shaped as stored, BF16 as uint16,
    block-quantized types as ``[rows, bytes per row]``."""
    import gguf

    try:
        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise UnsupportedModelError(f"{path}: tensor {name} has unknown ggml type {kind}") from None
    count = int(np.prod(dims)) if dims else 1
    nbytes = count // block * type_bytes
    begin = start + offset
    if begin + nbytes > mm.size:
        raise CheckpointError(f"{path}: tensor {name} ends at byte {begin + nbytes} but the file has "
                              f"{mm.size} bytes (truncated file?)")
    raw = mm[begin:begin + nbytes]
    rows = count // dims[0] if dims else 1
    if kind in (0, 1):
        data = raw.view(np.float32 if kind == 0 else np.float16).reshape(tuple(reversed(dims)))
    elif kind == 30:
        data = raw.view(np.uint16).reshape(tuple(reversed(dims)))
    else:
        data = raw.reshape(rows, nbytes // max(1, rows))
    return GGUFTensor(name, kind, tuple(int(d) for d in dims), data, begin)


def read_tensor_table(path: Path, mm: np.ndarray | None = None) -> list[GGUFTensor]:
    """The tensors of a GGUF file, reading only what locating them needs (gguf-py's reader also decodes every
    metadata value, the demo's 49k-token vocabulary among them). ``mm``: the file already mapped
    (:func:`map_file`), so that the tensors view that mapping. Damaged files raise :class:`CheckpointError` naming
    the file."""
    if mm is None:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    try:
        infos, start = _read_header(path, buf)
    finally:
        buf.release()    # the mapping then lives exactly as long as the tensors' views
    return [_tensor_view(path, mm, start, *info) for info in infos]


def _type_name(kind: int) -> str:
    try:
        import gguf
        return gguf.GGMLQuantizationType(kind).name
    except (ImportError, ValueError):
        return f"ggml type {kind}"


def _dense(tensor: GGUFTensor, shape: tuple[int, ...]) -> torch.Tensor:
    kind = int(tensor.tensor_type)
    data = np.asarray(tensor.data)
    if kind == 30:
        arr = (data.astype(np.uint32) << 16).view(np.float32)
    else:
        arr = data.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(shape))


def _module(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    parent, _, attr = dotted.rpartition(".")
    return root.get_submodule(parent), attr


def map_file(path: Path) -> np.ndarray:
    """The whole file mapped once, privately: the loader reads the table and the small dense tensors through it,
    and the packed weights served as stored are views of it (``torch.from_numpy``: no copy; pages resident once
    read, shared with the page cache) sharing one storage, so weights that lie one after the other merge without
    a copy (``GGUFBlockWeight.cat``). One mapping, not one per reader: file pages are mapped in whole folios, and
    a folio mapped twice counts twice in the resident set. Copy-on-write only so that torch accepts the array as
    writable: nothing writes the weights."""
    return np.memmap(path, dtype=np.uint8, mode="c")


def _map_only_served(model: nn.Module, mapped: torch.Tensor) -> None:
    """Keep mapped only the bytes of the file the model's weights view (edgespec.loading.resident.map_only): the
    header, the q/k/v rows copied into the merged q/k/v and the dense tensors copied out are not read again,
    and in large folios they stayed mapped beside the weights around them."""
    from edgespec.loading.resident import map_only

    base, size = mapped.data_ptr(), mapped.numel()
    used = []
    for buf in model.buffers():
        if buf.dtype == torch.uint8 and buf.device.type == "cpu" and base <= buf.data_ptr() < base + size:
            used.append((buf.data_ptr(), buf.data_ptr() + buf.numel()))
    map_only(base, size, used)


def _place_tensor(model: TargetModel, path: Path, tensor: GGUFTensor, dtype: torch.dtype, device: torch.device,
                  dense: dict[str, torch.Tensor], problems: list[str], mapped: torch.Tensor) -> None:
    """Put one GGUF tensor into ``model`` (built on the meta device): a quantized matrix as a packed layer in
    place of its dense module, its blocks a view of ``mapped`` (:func:`map_file`) where they are served as
    stored; a dense tensor into ``dense`` (under its HF name) for the caller to copy in. What does not fit goes
    to ``problems``; a type the loader cannot serve raises."""
    cfg = model.config
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    permuted = cfg.model_type in ROPE_PERMUTED_ARCHS     # llama.cpp reordered the q/k rows of these
    qwen35 = cfg.model_type == GGUF_ARCHS["qwen35"][0]
    if qwen35 and is_mtp_tensor(tensor.name, cfg.num_hidden_layers):
        return                                   # appended MTP layers: not part of the main model
    name, role, _ = _hf_name(tensor.name)
    kind = int(tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))   # GGUF lists dims innermost first
    if kind in _DENSE:
        weight = _dense(tensor, shape)
        if role in ("attn_q", "attn_k") and permuted:
            weight = torch.from_numpy(_unpermute_rows(weight.numpy(), n_heads if role == "attn_q" else n_kv))
        if qwen35:       # norms stored as 1 + w, A as -exp(A_log), conv squeezed; matrices stay as stored
            weight = torch.from_numpy(qwen35_dense_value(tensor.name, role, weight.numpy()))
        dense[name] = weight
        return
    fmt = GGML_FORMATS.get(kind) or K_FORMATS.get(kind)
    if fmt is None:
        raise UnsupportedModelError(
            f"{path}: tensor {tensor.name} is {_type_name(kind)}; the native GGUF loader packs Q4_0, Q4_1, "
            "Q8_0, Q4_K, Q5_K, Q6_K and reads F32/F16/BF16 (2- and 3-bit and I-quants are not served; convert "
            "other types to fp32 with `edgespec convert --gguf`)")
    if len(shape) != 2 or not name.endswith(".weight"):
        raise CheckpointError(f"{path}: quantized tensor {tensor.name} has shape {list(shape)}, not a matrix")
    out_f, in_f = shape
    blocks = np.asarray(tensor.data)
    want = (out_f, in_f // fmt.block * fmt.block_bytes)
    if in_f % fmt.block or blocks.size != want[0] * want[1]:
        raise CheckpointError(f"{path}: tensor {tensor.name} ({_type_name(kind)}, shape {list(shape)}) holds "
                              f"{blocks.size} bytes, expected {want[0] * want[1]} (truncated file?)")
    if role in ("attn_q", "attn_k") and permuted:
        # rows reordered: the one kind of weight held as a copy
        stored = torch.from_numpy(_unpermute_rows(blocks.reshape(want), n_heads if role == "attn_q" else n_kv))
    else:
        stored = mapped[tensor.offset:tensor.offset + blocks.size].view(want)
    packed = fmt(stored.to(device), out_f, in_f, dtype)
    module_name = name[: -len(".weight")]
    try:
        parent, attr = _module(model, module_name)
        current = getattr(parent, attr)
    except AttributeError:
        problems.append(f"unexpected tensor {tensor.name} ({name})")
        return
    if current is None and attr == "lm_head":
        problems.append(f"unexpected tensor {tensor.name}: the config ties the output to the embedding")
        return
    if tuple(current.weight.shape) != shape:
        problems.append(f"{tensor.name}: shape {list(shape)}, expected {list(current.weight.shape)}")
        return
    bias = None
    if getattr(current, "bias", None) is not None:
        bias = torch.empty(current.bias.shape, dtype=dtype, device=device)   # filled from `dense` below
    setattr(parent, attr, PackedEmbedding(packed) if attr == "embed_tokens" else PackedLinear(packed, bias))


def load_gguf_target(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     max_positions: int | None = None, merge: bool = True, drafter_bytes: int = 0
                     ) -> tuple[TargetModel, Path]:
    """The GGUF at ``path`` as a :class:`TargetModel` with packed layers, and the folder of its config and
    tokenizer files. ``merge``: merge q/k/v and gate/up as served (packed rows stack exactly). ``drafter_bytes``:
    the drafter's share of the memory budget kept as ``model.memory_budget``."""
    path = Path(path).expanduser()
    device = torch.device(device)
    if device.type == "cpu":
        # before the weights are mapped, and again once loaded: torch's start-up code and the freed heap given
        # back (edgespec.loading.resident), so the weights add to a small process
        settle()
    folder = gguf_metadata_folder(path)   # validates architecture, tensor names and tokenizer
    cfg = load_config(folder)
    mm = map_file(path)
    if device.type == "cpu":
        small_pages(mm.ctypes.data, mm.size)    # before any read: see _map_only_served
    tensors = read_tensor_table(path, mm)
    mapped = torch.from_numpy(mm)
    with meta_modules():   # no throw-away random init (edgespec.models.meta_init)
        model = TargetModel(cfg, max_positions=1)
    dense: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for tensor in tensors:
        _place_tensor(model, path, tensor, dtype, device, dense, problems, mapped)
    del mm, tensors      # the model's views keep the mapping; nothing else does

    materialize(model, device, requires_grad=False)
    params = dict(model.named_parameters())
    for name, value in dense.items():
        param = params.pop(name, None)
        if param is None:
            problems.append(f"unexpected tensor for {name}")
        elif tuple(param.shape) != tuple(value.shape):
            problems.append(f"{name}: shape {list(value.shape)}, expected {list(param.shape)}")
        else:
            with torch.no_grad():
                param.data = value.to(device=device, dtype=dtype)
    if params:
        problems.append("missing tensor(s) for: " + ", ".join(sorted(params)[:20]))
    if problems:
        raise CheckpointError(f"{path} does not fit its llama config: " + " | ".join(problems))
    # Dense modules were built on the meta device in fp32; put what is left in the model dtype.
    for module in model.modules():
        for key, buf in list(module._buffers.items()):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                module._buffers[key] = buf.to(dtype)
    model.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings).to(device)
    if merge:
        model.merge_projections()
    if device.type == "cpu":
        _map_only_served(model, mapped)
    # Reported by `bench` / `doctor` beside the measured peak (the packed blocks are what the model holds).
    from edgespec.memory import module_bytes, plan_budget
    model.memory_budget = plan_budget(cfg, module_bytes(model), device, dtype,
                                      max_positions or cfg.max_position_embeddings, drafter=drafter_bytes,
                                      packed=True)
    if device.type == "cpu":
        settle()
    return model.eval(), folder
