"""The model id a server answers to (``model`` in requests, ``GET /v1/models``): stable across restarts and
conversions, so a client configured once keeps working."""

from __future__ import annotations

import os
from pathlib import Path

# How a deployment sets the id, for messages that tell a client or an integrator.
HOW_TO_SET = "set with --served-model-name (served_model_name in YAML, EDGESPEC_SERVED_MODEL_NAME)"


def served_model_id(model: str, served_model_name: str | None = None) -> str:
    """``served_model_name`` when set; else the name of what ``model`` names: a checkpoint folder's name, a GGUF
    file's name without ``.gguf``, the demo's folder name (``smollm2-135m-instruct``). Never the cache folder a GGUF
    is converted into, whose name carries a hash of the file's path, size and time."""
    if served_model_name:
        return served_model_name
    if model == "demo":
        from edgespec.convert.gguf import DEMO_SUBDIR
        return DEMO_SUBDIR
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return path.stem
    # The absolute path's last part (".", "models/Qwen3-4B/" name their folder); symlinks are not followed, so a
    # link such as /models/current keeps its own name.
    return Path(os.path.abspath(path)).name or str(path)
