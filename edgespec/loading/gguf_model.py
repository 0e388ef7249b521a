"""Load a llama-architecture GGUF natively: its Q4_0 / Q4_1 / Q8_0 tensors stay in their blocks.

The config and tokenizer come from :func:`edgespec.loading.gguf_demo.gguf_metadata_folder` (the same metadata
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

from pathlib import Path

import numpy as np
import torch
from torch import nn

from edgespec.errors import CheckpointError, UnsupportedModelError
from edgespec.loading.gguf_demo import _hf_name, _unpermute_rows, gguf_metadata_folder, open_gguf
from edgespec.loading.hf_config import load_config
from edgespec.models.decoder import TargetModel
from edgespec.models.layers import RotaryEmbedding
from edgespec.weights.base import PackedLinear, PackedWeight
from edgespec.weights.gguf import GGML_FORMATS

# ggml type ids of unquantized tensors and their numpy dtypes.
_DENSE = {0: np.float32, 1: np.float16, 30: None}   # 30 = BF16 (gguf-py returns its raw uint8 bytes)


class PackedEmbedding(nn.Module):
    """A token embedding whose table is a :class:`PackedWeight` (rows decoded on lookup)."""

    def __init__(self, packed: PackedWeight) -> None:
        super().__init__()
        self.weight = packed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(tokens)


def _type_name(kind: int) -> str:
    try:
        import gguf
        return gguf.GGMLQuantizationType(kind).name
    except (ImportError, ValueError):
        return f"ggml type {kind}"


def _dense(tensor, shape: tuple[int, ...]) -> torch.Tensor:
    kind = int(tensor.tensor_type)
    data = np.asarray(tensor.data)
    if kind == 30:
        raw = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
        arr = raw.view(np.float32)
    else:
        arr = data.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(shape))


def _module(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    parent, _, attr = dotted.rpartition(".")
    return root.get_submodule(parent), attr


def _materialize(root: nn.Module, device: torch.device) -> None:
    """Allocate what is still on the meta device (``to_empty`` on the whole model would also re-allocate,
    and so wipe, the packed weights already in place)."""
    for module in root.modules():
        for store in (module._parameters, module._buffers):
            for key, value in list(store.items()):
                if value is not None and value.is_meta:
                    fresh = torch.empty_like(value, device=device)
                    store[key] = nn.Parameter(fresh, requires_grad=False) if isinstance(value, nn.Parameter) \
                        else fresh


def load_gguf_target(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     max_positions: int | None = None, merge: bool = True) -> tuple[TargetModel, Path]:
    """The GGUF at ``path`` as a :class:`TargetModel` with packed layers, and the folder of its config and
    tokenizer files. ``merge``: merge q/k/v and gate/up as served (packed rows stack exactly)."""
    path = Path(path).expanduser()
    folder = gguf_metadata_folder(path)   # validates architecture, tensor names and tokenizer
    cfg = load_config(folder)
    device = torch.device(device)
    reader = open_gguf(path)
    with torch.device("meta"):
        model = TargetModel(cfg, max_positions=1)
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    dense: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for tensor in reader.tensors:
        name, role, _ = _hf_name(tensor.name)
        kind = int(tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape))   # GGUF lists dims innermost first
        if kind in _DENSE:
            weight = _dense(tensor, shape)
            if role in ("attn_q", "attn_k"):
                weight = torch.from_numpy(_unpermute_rows(weight.numpy(), n_heads if role == "attn_q" else n_kv))
            dense[name] = weight
            continue
        fmt = GGML_FORMATS.get(kind)
        if fmt is None:
            raise UnsupportedModelError(
                f"{path}: tensor {tensor.name} is {_type_name(kind)}; the native GGUF loader packs Q4_0, Q4_1, "
                "Q8_0 and reads F32/F16/BF16 (convert other types to fp32 with `edgespec convert --gguf`)")
        if len(shape) != 2 or not name.endswith(".weight"):
            raise CheckpointError(f"{path}: quantized tensor {tensor.name} has shape {list(shape)}, not a matrix")
        out_f, in_f = shape
        blocks = np.asarray(tensor.data)
        want = (out_f, in_f // 32 * fmt.block_bytes)
        if in_f % 32 or blocks.size != want[0] * want[1]:
            raise CheckpointError(f"{path}: tensor {tensor.name} ({_type_name(kind)}, shape {list(shape)}) holds "
                                  f"{blocks.size} bytes, expected {want[0] * want[1]} (truncated file?)")
        blocks = blocks.reshape(want)
        if role in ("attn_q", "attn_k"):
            blocks = _unpermute_rows(blocks, n_heads if role == "attn_q" else n_kv)
        packed = fmt(torch.from_numpy(np.array(blocks)).to(device), out_f, in_f, dtype)
        module_name = name[: -len(".weight")]
        try:
            parent, attr = _module(model, module_name)
            current = getattr(parent, attr)
        except AttributeError:
            problems.append(f"unexpected tensor {tensor.name} ({name})")
            continue
        if current is None and attr == "lm_head":
            problems.append(f"unexpected tensor {tensor.name}: the config ties the output to the embedding")
            continue
        if tuple(current.weight.shape) != shape:
            problems.append(f"{tensor.name}: shape {list(shape)}, expected {list(current.weight.shape)}")
            continue
        bias = None
        if getattr(current, "bias", None) is not None:
            bias = torch.empty(current.bias.shape, dtype=dtype, device=device)   # filled from `dense` below
        setattr(parent, attr, PackedEmbedding(packed) if attr == "embed_tokens" else PackedLinear(packed, bias))

    _materialize(model, device)
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
    return model.eval(), folder
