"""The memory budget of a published model shape in a weight format, with no checkpoint and no weights
(``edgespec doctor --shape``): will Qwen3.5-35B-A3B in int4, its drafter and a 32k FP8 KV cache fit a 24 GB share
of a Jetson's memory?

The served module tree is built on the meta device in the format (every linear layer packed where its width fits
the format's blocks, every MoE expert included: they all live in memory; embeddings, norms and the output
projection stay in the activation dtype, as ``edgespec quantize`` writes them), and its exact bytes go through
the same :func:`edgespec.memory.plan_budget` that refuses a real load.
"""

from __future__ import annotations

import re

import torch

from edgespec.errors import ConfigError
from edgespec.memory import MemoryBudget, module_bytes, plan_budget

FORMATS = ("dense", "fp8", "nvfp4", "int4")


def parse_memory(text: str) -> int:
    """``24GB`` (10^9), ``24GiB`` (2^30), ``512MiB`` ... -> bytes; a named error otherwise."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(GB|GiB|MB|MiB)\s*", text)
    if not m:
        raise ConfigError(f"memory {text!r}: expected a size such as 24GB, 24GiB or 512MiB")
    scale = {"GB": 10**9, "GiB": 1 << 30, "MB": 10**6, "MiB": 1 << 20}[m.group(2)]
    return int(float(m.group(1)) * scale)


def shape_budget(shape: str, fmt: str, max_seq_len: int, kv_fp8: bool, drafter: str | None,
                 memory: int | None, group_size: int = 128, dtype: torch.dtype = torch.bfloat16,
                 vision: bool = False) -> tuple[MemoryBudget, dict[str, int]]:
    """The :class:`MemoryBudget` of serving ``shape`` (an ``edgespec.bench.shapes.SHAPES`` name) in ``fmt``
    with a KV cache of ``max_seq_len`` tokens, and ``drafter``: ``"mtp"`` (the shape's MTP head in the same
    format), a drafter checkpoint folder, or None. ``memory``: the bytes to fit (a share of a device); None: what
    this machine has free. ``vision``: with the Qwen3.5/3.6 vision tower in bf16 (as the releases ship it) sized for
    1280x720 frames (edgespec.memory.vision_bytes). Also returns the weights' split: experts, the rest of the
    target, the MTP head, the tower."""
    from edgespec.bench.formats import meta_model, shape_config
    from edgespec.loading.hf_config import parse_config
    from edgespec.loading.weights import checkpoint_bytes

    if fmt not in FORMATS:
        raise ConfigError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if max_seq_len < 1:
        raise ConfigError(f"max_seq_len must be positive, got {max_seq_len}")
    cfg_dict = shape_config(shape)
    cfg = parse_config(cfg_dict)
    mtp = drafter == "mtp"
    if mtp and not cfg.model_type.startswith("qwen3_5"):
        raise ConfigError(f"shape {shape!r} ({cfg.model_type}) has no MTP head; pass a drafter folder or none")
    if mtp:     # the Qwen3.5/3.6 releases carry one MTP layer; the shapes table leaves it out
        cfg_dict = {**cfg_dict, "mtp_num_hidden_layers": cfg.mtp_num_hidden_layers or 1}
    model = meta_model(cfg_dict, fmt, dtype, group_size, with_mtp=mtp)
    head = module_bytes(model.mtp) if mtp else 0
    experts = sum(module_bytes(m) for n, m in model.named_modules() if n.endswith(".experts")
                  and not n.startswith("mtp."))
    target = module_bytes(model) - head
    drafter_bytes = head if mtp else checkpoint_bytes(drafter)
    tower = 0
    if vision:
        from edgespec.bench.vision_shapes import QWEN35_TOWER
        from edgespec.models.config import VisionConfig
        from edgespec.models.vision import VisionTower

        cfg.vision = VisionConfig(**QWEN35_TOWER, out_hidden_size=cfg.hidden_size)
        with torch.device("meta"):
            tower = module_bytes(VisionTower(cfg.vision).to(dtype))
    budget = plan_budget(cfg, target, torch.device("cpu"), dtype, max_seq_len, kv_fp8=kv_fp8,
                         drafter=drafter_bytes, packed=fmt != "dense", vision_weights=tower)
    if memory is not None:
        budget.available = memory
        budget.device = f"a {memory / 1e9:.1f} GB share"
    return budget, {"experts": experts, "target_rest": target - experts, "mtp_head": head, "vision_tower": tower}
