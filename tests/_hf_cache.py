"""The transformers oracle's incremental decode on any supported transformers: the KV cache travels as ``cache``
where the model's ``forward`` takes it (``past_key_values`` is deprecated there and warns on every call), else as
``past_key_values``; the output carries it under the same name."""

from __future__ import annotations

import inspect
from typing import Any

import torch


def hf_step(model: torch.nn.Module, input_ids: torch.Tensor, cache: Any = None) -> tuple[Any, Any]:
    """``model(input_ids, use_cache=True)`` continuing ``cache`` (None: a fresh prompt), without gradients:
    (the output, its cache for the next step)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=True, **({} if cache is None else {name: cache}))
    return out, getattr(out, name)
