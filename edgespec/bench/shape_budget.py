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


def meta_drafter(name: str, fmt: str, dtype: torch.dtype, group_size: int = 128) -> torch.nn.Module:
    """A published drafter shape (``edgespec.bench.shapes.DRAFTER_SHAPES``) as served, on the meta device: q/k/v and
    gate/up merged, its linear layers packed in ``fmt`` (``drafter_weights``; its codebooks and any own head or
    embedding stay in ``dtype``)."""
    from edgespec.bench.formats import pack_meta_linears, shape_config
    from edgespec.bench.random_drafter import dflash2_config_dict
    from edgespec.bench.shapes import DRAFTER_SHAPES
    from edgespec.drafters.dflash2_net import DFlash2DraftModel, parse_dflash2_config
    from edgespec.drafters.quantize import KEEP_DENSE
    from edgespec.loading.hf_config import parse_config
    from edgespec.models.layers import merge_all_projections

    spec = dict(DRAFTER_SHAPES[name])
    spec.pop("kind"), spec.pop("published_al", None), spec.pop("al_source", None)
    tcfg_dict = shape_config(spec.pop("target"))
    tcfg = parse_config(tcfg_dict)
    cfg = parse_dflash2_config(dflash2_config_dict(tcfg_dict, **spec), tcfg.num_hidden_layers, source=name)
    with torch.device("meta"):
        drafter = DFlash2DraftModel(cfg, tcfg.hidden_size, tcfg.vocab_size).to(dtype)
        merge_all_projections(drafter)
        pack_meta_linears(drafter, fmt, dtype, group_size, keep=KEEP_DENSE)
    return drafter


def _drafter_split(name: str, shape: str, fmt: str, dtype: torch.dtype, group_size: int, window: int
                   ) -> dict[str, int]:
    """Held bytes (weights + context window) and bytes one draft reads (weights but the codebooks, of which it
    gathers the K candidates' rows per position; the window's K/V) of drafter shape ``name`` for ``shape``."""
    from edgespec.bench.shapes import DRAFTER_SHAPES
    from edgespec.memory import drafter_window_bytes

    target = DRAFTER_SHAPES[name]["target"]
    if target != shape:
        raise ConfigError(f"drafter {name!r} drafts for {target!r}, not {shape!r}")
    if fmt not in FORMATS:
        raise ConfigError(f"drafter format {fmt!r}: choose one of {', '.join(FORMATS)}")
    drafter = meta_drafter(name, "dense" if fmt == "dense" else fmt, dtype, group_size)
    cfg, sel = drafter.cfg, drafter.candidate_selector
    codebooks = module_bytes(sel) - module_bytes(sel.hidden_projection)
    rows = 2 * (cfg.block_size - 1) * cfg.selector_top_k * cfg.selector_rank * sel.successor_codebook.element_size()
    win = drafter_window_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size, window,
                               cfg.block_size)
    held = module_bytes(drafter)
    return {"drafter_weights": held, "drafter_window": win, "drafter_read": held - codebooks + rows + win,
            "block_size": cfg.block_size}


def shape_budget(shape: str, fmt: str, max_seq_len: int, kv_fp8: bool, drafter: str | None,
                 memory: int | None, group_size: int = 128, dtype: torch.dtype = torch.bfloat16,
                 drafter_format: str | None = None, window: int = 128,
                 vision: bool = False) -> tuple[MemoryBudget, dict[str, int]]:
    """The :class:`MemoryBudget` of serving ``shape`` (an ``edgespec.bench.shapes.SHAPES`` name) in ``fmt``
    with a KV cache of ``max_seq_len`` tokens, and ``drafter``: ``"mtp"`` (the shape's MTP head in the same
    format), a published drafter shape (``DRAFTER_SHAPES``: its weights in ``drafter_format``, default ``fmt``,
    plus its context window of ``window`` tokens), a drafter checkpoint folder, or None. ``memory``: the bytes
    to fit (a share of a device); None: what this machine has free. ``vision``: with the Qwen3.5/3.6 vision
    tower in bf16 (as the releases ship it) sized for 1280x720 frames (edgespec.memory.vision_bytes). Also
    returns the weights' split: experts, the rest of the target, the MTP head, the tower; the bytes one verify
    reads (``target_read``: every matrix, one embedding row) and, for a drafter shape, its parts and
    the bytes one draft reads (:func:`cycle_bytes`)."""
    from edgespec.bench.formats import meta_model, shape_config
    from edgespec.bench.gpu import weight_bytes_per_token
    from edgespec.bench.shapes import DRAFTER_SHAPES
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
    split = {"experts": experts, "target_rest": target - experts, "mtp_head": head,
             "target_read": weight_bytes_per_token(model), "head": module_bytes(model.lm_head)}
    if drafter in DRAFTER_SHAPES:
        split.update(_drafter_split(drafter, shape, drafter_format or fmt, dtype, group_size, window))
        drafter_bytes = split["drafter_weights"] + split["drafter_window"]
    else:
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
    split["vision_tower"] = tower
    return budget, split


def cycle_bytes(split: dict[str, int], cfg, context: int, kv_fp8: bool, dtype: torch.dtype = torch.bfloat16
                ) -> dict[str, int]:
    """Bytes one block-drafter cycle moves at ``context`` cached tokens, by stage: the draft (the drafter's weights
    as read, its window, the target's lm_head once more over the block rows), the verify (the target's weights, the
    KV of ``context`` tokens, the GDN states read and written back). ``split``: :func:`shape_budget`'s, with a
    drafter shape."""
    from edgespec.memory import gdn_state_bytes, kv_cache_bytes

    kv = kv_cache_bytes(cfg, context, dtype, kv_fp8, verify_rows=0) - kv_cache_bytes(cfg, 0, dtype, kv_fp8,
                                                                                      verify_rows=0)
    return {"draft": split["drafter_read"] + split["head"], "verify_weights": split["target_read"], "kv": kv,
            "states": 2 * gdn_state_bytes(cfg, dtype)}


def thor_projection_lines(split: dict[str, int], cfg, max_seq_len: int, kv_fp8: bool, al: float, al_source: str,
                          read_bw: float = 259e9, spec_bw: float = 273e9) -> list[str]:
    """The Thor projection of a block-drafter cycle from bytes alone, at an empty cache and at ``max_seq_len``
    cached tokens: ``al`` / (cycle bytes / Thor's measured 259 GB/s read rate), next to plain decoding's bound. An
    upper bound (no kernel reaches the byte rate; launches and compute are left out), not a measurement."""
    lines = []
    for context in (0, max_seq_len):
        parts = cycle_bytes(split, cfg, context, kv_fp8)
        total = sum(parts.values())
        ms = total / read_bw * 1e3
        plain_ms = (parts["verify_weights"] + parts["kv"] + parts["states"]) / read_bw * 1e3
        lines.append(
            f"{'Thor projection':>18}: context {context}: cycle reads {total / 1e9:.2f} GB (draft "
            f"{parts['draft'] / 1e9:.2f} + verify weights {parts['verify_weights'] / 1e9:.2f} + KV "
            f"{parts['kv'] / 1e9:.2f} + GDN states {parts['states'] / 1e9:.2f}) = {ms:.1f} ms at "
            f"{read_bw / 1e9:.0f} GB/s ({total / spec_bw * 1e3:.1f} ms at {spec_bw / 1e9:.0f}); at AL {al:g} "
            f"({al_source}) <= {al / ms * 1e3:.1f} tok/s, plain decoding <= {1e3 / plain_ms:.1f} tok/s")
    return lines
