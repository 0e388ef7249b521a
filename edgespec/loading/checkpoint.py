"""Load a Hugging Face checkpoint folder into a :class:`TargetModel`, checking every key and shape."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from edgespec.errors import CheckpointError
from edgespec.loading.hf_config import load_config
from edgespec.loading.weights import load_parameters, weight_files
from edgespec.models.config import ModelConfig
from edgespec.models.decoder import TargetModel
from edgespec.models.layers import RotaryEmbedding

# Parameters kept in fp32 whatever the model dtype: tiny, and they feed exp()/softplus() of the GDN decay.
_FP32_PARAMS = ("A_log", "dt_bias")


def normalise_key(key: str) -> str | None:
    """Map a checkpoint key to our parameter name; None for keys deliberately ignored."""
    if key.startswith("model.visual.") or key.endswith("rotary_emb.inv_freq"):
        return None
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    return key


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_target(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                max_positions: int | None = None, merge: bool = True) -> TargetModel:
    """Build the model described by ``folder/config.json`` and load its safetensors weights.

    ``merge``: merge the projections as served (see :meth:`TargetModel.merge_projections`); ``False`` keeps the
    checkpoint's layout, which rounds exactly like transformers (the golden tests compare in that layout).

    Errors name the file and key: unexpected keys, missing keys and shape mismatches are all reported at
    once (a partly loaded model would produce plausible-looking garbage).
    """
    folder = Path(folder)
    cfg = load_config(folder)
    files = weight_files(folder)
    has_mtp = _has_mtp_keys(files)
    device = torch.device(device)
    model = build_empty(cfg, dtype, device, max_positions, with_mtp=has_mtp)

    def name_of(key: str) -> str | None:
        name = normalise_key(key)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return None  # tied: the embedding serves as the head
        return name

    problems = load_parameters(dict(model.named_parameters()), files, name_of)
    if problems:
        raise CheckpointError(f"checkpoint {folder} does not fit model_type {cfg.model_type!r}: "
                              + " | ".join(problems))
    # One GEMV per merged projection: fewer launches on a GPU, fewer BLAS calls and Python steps on CPU.
    return (model.merge_projections() if merge else model).eval()


def build_empty(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int | None,
                with_mtp: bool = False) -> TargetModel:
    """Construct the module tree without random init (meta device), then allocate it on ``device``."""
    with torch.device("meta"):
        model = TargetModel(cfg, max_positions=1, with_mtp=with_mtp)
    model = model.to_empty(device=device).to(dtype)
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in _FP32_PARAMS:
            p.data = p.data.float()
    # Rotary tables are derived, not loaded: rebuild them for real on the target device.
    model.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings).to(device)
    return model


def _has_mtp_keys(files: list[Path]) -> bool:
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                if any(k.startswith("mtp.") for k in f.keys()):
                    return True
        except Exception as e:  # a corrupt header: report it the same way iter_tensors does
            raise CheckpointError(f"cannot read weights from {path}: {e} (truncated or corrupt file?)") from None
    return False
