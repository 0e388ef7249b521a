"""The DFlash drafter kind of ``edgespec distill`` (:mod:`edgespec.distill.kinds`): a z-lab-layout block drafter.

A fresh drafter takes the target's shapes (``--layers``, ``--taps``, ``--heads`` ... narrow it) and, where the
shapes match, starts from the target's own last decoder layer (:func:`target_init`); ``--init`` reads a published
checkpoint back; the objective is :class:`~edgespec.distill.objective.BlockObjective`, the torch reference of the
proposer's block forward; the checkpoint is written with the published ``config.json`` keys.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgespec.distill.kinds import DrafterKind
from edgespec.distill.objective import BlockObjective
from edgespec.drafters.dflash_net import (
    DFlashConfig,
    DFlashDraftModel,
    default_target_layer_ids,
    parse_dflash_config,
)
from edgespec.errors import CheckpointError, ConfigError


def published_config(cfg: Any, target_cfg: Any) -> dict[str, Any]:
    """The published ``config.json`` of a drafter (the z-lab keys, mask id and taps under ``dflash_config``)."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "max_position_embeddings": target_cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias, "hidden_act": "silu", "vocab_size": target_cfg.vocab_size,
        "num_target_layers": target_cfg.num_hidden_layers, "tie_word_embeddings": False, "dtype": "bfloat16",
        "layer_types": list(cfg.layer_types), "sliding_window": cfg.sliding_window, "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
    }


def drafter_config(args: argparse.Namespace, target_cfg: Any) -> DFlashConfig:
    """The DFlash config the distill arguments ask for (defaults: the target's shapes), as its published
    ``config.json`` reads back; taps outside the target are a ConfigError naming ``--taps``."""
    taps = ([int(t) for t in args.taps.split(",")] if args.taps
            else default_target_layer_ids(target_cfg.num_hidden_layers, args.layers))
    heads = args.heads or target_cfg.num_attention_heads
    raw = {
        "hidden_size": target_cfg.hidden_size, "intermediate_size": args.intermediate_size or
        target_cfg.intermediate_size, "num_hidden_layers": args.layers, "num_attention_heads": heads,
        "num_key_value_heads": args.kv_heads or target_cfg.num_key_value_heads,
        "head_dim": target_cfg.head_dim, "rms_norm_eps": target_cfg.rms_norm_eps, "rope_theta": target_cfg.rope_theta,
        "vocab_size": target_cfg.vocab_size, "num_target_layers": target_cfg.num_hidden_layers,
        "block_size": args.block_size,
        "mask_token_id": target_cfg.vocab_size - 1 if args.mask_token_id is None else args.mask_token_id,
        "target_layer_ids": taps,
    }
    cfg = parse_dflash_config(raw, target_cfg.num_hidden_layers, source="distill arguments")
    bad = [t for t in cfg.target_layer_ids if not 0 <= t < target_cfg.num_hidden_layers]
    if bad:
        raise ConfigError(f"--taps {bad} outside the target's layers 0..{target_cfg.num_hidden_layers - 1}")
    return parse_dflash_config(published_config(cfg, target_cfg), target_cfg.num_hidden_layers)


def random_init(drafter: nn.Module, seed: int) -> None:
    """Norm weights 1, every other parameter N(0, 0.02), from ``seed``."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)


def random_drafter(args: argparse.Namespace, target_cfg: Any, seed: int) -> DFlashDraftModel:
    """A random-weight drafter of the shape the distill arguments ask for (defaults: the target's)."""
    drafter = DFlashDraftModel(drafter_config(args, target_cfg), target_cfg.hidden_size)
    random_init(drafter, seed)
    return drafter


def target_init(drafter, target) -> bool:
    """Start the drafter from the target itself, where the shapes allow (a from-scratch drafter spends most of a
    CPU budget learning what the target's top layer already does): every drafter layer copies the target's last
    decoder layer (attention and MLP projections, both norms); the final norm copies the target's final norm (its
    output feeds the target's lm_head); ``hidden_norm`` copies that last layer's input norm and ``fc`` starts as
    the identity on the last tap, so the context keys/values begin as the last layer's own keys/values of the
    committed tokens. q/k norms (absent in Llama) stay at 1. Returns False (nothing copied) on a shape mismatch."""
    last = target.model.layers[-1]
    cfg = drafter.cfg
    att = getattr(last, "self_attn", None)
    if att is None or not hasattr(att, "q_proj") or getattr(att, "gated", False):
        return False
    pairs = []
    for layer in drafter.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            pairs.append((getattr(layer.self_attn, name).weight, getattr(att, name).weight))
        for name in ("gate_proj", "up_proj", "down_proj"):
            pairs.append((getattr(layer.mlp, name).weight, getattr(last.mlp, name).weight))
        pairs.append((layer.input_layernorm.weight, last.input_layernorm.weight))
        pairs.append((layer.post_attention_layernorm.weight, last.post_attention_layernorm.weight))
    pairs.append((drafter.norm.weight, target.model.norm.weight))
    pairs.append((drafter.hidden_norm.weight, last.input_layernorm.weight))
    if any(a.shape != b.shape for a, b in pairs) or last.input_layernorm.zero_centred:
        return False
    with torch.no_grad():
        for a, b in pairs:
            a.copy_(b.float())
        H = cfg.hidden_size
        fc = drafter.fc.weight
        fc.mul_(0.1)
        fc[:, -H:] += torch.eye(H)
    return True


def load_drafter(folder: str, target, kind: str = "DFlash",
                 parse: Callable[..., DFlashConfig] = parse_dflash_config,
                 build: Callable[[Any, Any], nn.Module] | None = None,
                 rename: Callable[[str], str] = lambda name: name) -> nn.Module:
    """An existing drafter (checkpoint names, unmerged, fp32) to fine-tune (``--init``). Another kind passes its
    config parser, ``build(cfg, target)`` and ``rename`` (checkpoint name -> parameter name)."""
    from edgespec.drafters.dflash_loader import _check_fit, _checkpoint_index
    from edgespec.loading.hf_config import read_json
    from edgespec.loading.weights import load_parameters, weight_files

    path = Path(folder).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"--init drafter folder not found: {path}")
    cfg = parse(read_json(path / "config.json"), target.config.num_hidden_layers, source=str(path / "config.json"))
    files = weight_files(path)
    index = {key: (rename(name), shape) for key, (name, shape) in _checkpoint_index(files).items()}
    embed_vocab, head_vocab = _check_fit(cfg, target, dict(index.values()), path)
    if embed_vocab or head_vocab:
        raise ConfigError(f"--init {path}: drafters with their own embedding / lm_head are not trainable here")
    drafter = (build or (lambda c, t: DFlashDraftModel(c, t.config.hidden_size)))(cfg, target)
    names = {key: name for key, (name, _) in index.items()}
    problems = load_parameters(dict(drafter.named_parameters()), files, names.get, lambda n: "")
    if problems:
        raise CheckpointError(f"--init {kind} drafter {path} does not fit its config: " + " | ".join(problems))
    return drafter.float()


def new_drafter(args: argparse.Namespace, target, seed: int) -> DFlashDraftModel:
    """A fresh drafter for ``target``: random, then started from the target's last layer (``--target-init``,
    on by default) where the shapes match."""
    drafter = random_drafter(args, target.config, seed)
    if getattr(args, "target_init", False):
        target_init(drafter, target)
    return drafter


def objective(drafter: DFlashDraftModel, embed: torch.Tensor, head: torch.Tensor, max_positions: int,
              window: int | None, gamma: float) -> BlockObjective:
    return BlockObjective(drafter, embed, head, max_positions, window=window, gamma=gamma)


KIND = DrafterKind(name="dflash", new=new_drafter, load=load_drafter, objective=objective,
                   published_config=published_config)
