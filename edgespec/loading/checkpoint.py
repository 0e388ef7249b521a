"""Load a Hugging Face checkpoint folder into a :class:`TargetModel`, checking every key and shape."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from edgespec.errors import CheckpointError
from edgespec.loading.experts import split_fused_experts
from edgespec.loading.hf_config import load_config
from edgespec.loading.quant_config import QuantSpec, detect_quantization
from edgespec.loading.quantized import ignored, pack_linears, packed_slots, part_view
from edgespec.loading.safetensors_io import Slot, TensorEntry, fill_slots, read_headers
from edgespec.loading.weights import weight_files
from edgespec.memory import MemoryBudget, module_bytes, plan_budget
from edgespec.models.config import ModelConfig
from edgespec.models.decoder import TargetModel
from edgespec.models.layers import RotaryEmbedding
from edgespec.models.meta_init import meta_modules
from edgespec.weights.base import PackedLinear

log = logging.getLogger(__name__)

# Parameters kept in fp32 whatever the model dtype: tiny, and they feed exp()/softplus() of the GDN decay.
_FP32_PARAMS = ("A_log", "dt_bias")


def normalise_key(key: str, vision: bool = False) -> str | None:
    """Map a checkpoint key to our parameter name; None for keys deliberately ignored (the vision tower's
    ``model.visual.*`` unless ``vision``: then they load as ``visual.*``)."""
    if key.startswith("model.visual."):
        return "visual." + key[len("model.visual."):] if vision else None
    if key.endswith("rotary_emb.inv_freq"):
        return None
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    return key


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_target(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                max_positions: int | None = None, merge: bool = True, *, kv_fp8: bool = False,
                drafter_bytes: int = 0, check_memory: bool = True, vision: bool = True) -> TargetModel:
    """Build the model described by ``folder/config.json`` and load its safetensors weights.

    ``merge``: merge the projections as served (see :meth:`TargetModel.merge_projections`); ``False`` keeps the
    checkpoint's layout, which rounds exactly like transformers (the golden tests compare in that layout).

    Quantized checkpoints (block-FP8, NVFP4, AWQ/GPTQ int4; :mod:`edgespec.loading.quant_config`) load into
    packed layers that stay quantized in memory. Every tensor streams from the files into its final place, so
    the load never holds more than the weights plus one staging buffer. Before anything is allocated the memory
    budget (weights + KV cache for ``max_positions`` + ``drafter_bytes`` + workspace) is compared with the
    device's free memory (``check_memory``); the budget is kept as ``model.memory_budget``.

    ``vision``: load the vision tower (``model.visual.*``, as ``model.visual``) when the checkpoint has one; False
    leaves it on disk (a text-only deployment saves its memory).

    Errors name the file and key: unexpected keys, missing keys and shape mismatches are all reported at
    once (a partly loaded model would produce plausible-looking garbage).
    """
    folder = Path(folder)
    cfg = load_config(folder)
    spec = detect_quantization(folder)
    files = weight_files(folder)
    raw = split_fused_experts(read_headers(files), cfg)     # fused MoE experts -> per-expert entries
    has_mtp = any(k.startswith("mtp.") for k in raw)
    with_vision = vision and cfg.vision is not None and any(k.startswith("model.visual.") for k in raw)
    device = torch.device(device)

    def name_of(key: str) -> str | None:
        name = normalise_key(key, with_vision)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return None  # tied: the embedding serves as the head
        if name is not None and spec is not None and ignored(name):
            return None
        return name

    entries = {n: e for k, e in raw.items() if (n := name_of(k)) is not None}
    max_len = max_positions or cfg.max_position_embeddings

    def budget_of(weights: int, packed: bool, vision_weights: int = 0) -> MemoryBudget:
        return plan_budget(cfg, weights, device, dtype, max_len, kv_fp8=kv_fp8, drafter=drafter_bytes,
                           packed=packed, vision_weights=vision_weights)

    model = build_empty(cfg, dtype, device, max_positions, with_mtp=has_mtp, quant=spec, entries=entries,
                        budget=budget_of if check_memory else None, merge=merge, with_vision=with_vision)
    problems = fill_slots(model_slots(model, spec), raw, name_of)
    if problems:
        raise CheckpointError(f"checkpoint {folder} does not fit model_type {cfg.model_type!r}"
                              + (f" quantized as {spec.method}" if spec else "") + ": " + " | ".join(problems))
    for note in spec.notes if spec else ():
        log.info("%s: %s", folder, note)
    # The KV-cache format the checkpoint asks for (kv_dtype "auto" follows it; see Engine).
    model.checkpoint_kv_cache = spec.kv_cache if spec else None
    # Merges that depend on loaded values (NVFP4 parts sharing one global scale) happen now, one group at a time.
    return (model.merge_projections() if merge else model).eval()


def model_slots(model: TargetModel, spec: QuantSpec | None) -> dict[str, Slot]:
    """Every checkpoint tensor the model expects, by parameter name, and where it goes. A projection merged on the
    meta device expects its parts under their own names, each loaded straight into its rows of the merged layer."""
    slots: dict[str, Slot] = {}
    merged_params: set[str] = set()
    for name, module in model.named_modules():
        parts = getattr(module, "merged_parts", None)
        if isinstance(module, PackedLinear) and not parts:
            slots.update(packed_slots(name, module, spec))
        if not parts:
            continue
        parent = name.rpartition(".")[0]
        merged_params.update(f"{name}.{p}" for p, _ in module.named_parameters())
        row = 0
        for part, rows in parts:
            part_name = f"{parent}.{part}" if parent else part
            if isinstance(module, PackedLinear):
                slots.update(packed_slots(part_name, PackedLinear(part_view(module.weight, row, row + rows)), spec))
            else:
                slots[f"{part_name}.weight"] = Slot(module.weight.data[row:row + rows],
                                                     (rows, module.in_features))
            if module.bias is not None:
                slots[f"{part_name}.bias"] = Slot(module.bias.data[row:row + rows], (rows,))
            row += rows
    for name, p in model.named_parameters():
        if name not in merged_params:
            slots[name] = Slot(p.data, tuple(p.shape))
    return slots


def build_empty(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int | None,
                with_mtp: bool = False, *, quant: QuantSpec | None = None,
                entries: dict[str, TensorEntry] | None = None,
                budget: Callable[..., MemoryBudget] | None = None, merge: bool = False,
                with_vision: bool = False) -> TargetModel:
    """Construct the module tree on the meta device, give every tensor its serving dtype or packed format there,
    then allocate each once on ``device`` (no fp32 staging: peak memory is the weights themselves).

    ``quant`` + ``entries`` (checkpoint tensors by parameter name): layers whose tensors are quantized become
    :class:`PackedLinear` s. ``budget``: called with the weight bytes (and whether any layer is packed) before
    allocation; its :class:`MemoryBudget` is checked and kept as ``model.memory_budget``. ``merge``: merge the
    projections on the meta device, so loading fills each merged layer part by part (no second copy).
    ``with_vision``: build the vision tower too (its weights are counted apart in the budget).
    """
    with meta_modules():   # no throw-away random init (edgespec.models.meta_init)
        model = TargetModel(cfg, max_positions=1, with_mtp=with_mtp, with_vision=with_vision)
        model.to(dtype)
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] in _FP32_PARAMS:
                p.data = p.data.float()
    packed = pack_linears(model, quant, entries or {}, dtype) if quant is not None else 0
    if merge:
        model.merge_projections()
    plan = None
    if budget is not None:
        if model.visual is None:
            plan = budget(module_bytes(model), packed > 0)
        else:       # the tower's weights are a part of the budget of their own
            tower = module_bytes(model.visual)
            plan = budget(module_bytes(model) - tower, packed > 0, tower)
        plan.check()
    model = model.to_empty(device=device)
    model.memory_budget = plan
    # Rotary tables are derived, not loaded: rebuild them for real on the target device.
    model.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings).to(device)
    return model
