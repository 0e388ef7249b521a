"""Write random-weight drafters for a target checkpoint: DFlash / DFlash2 folders in the public format, or MTP weights.

No hub access is possible in tests or on an air-gapped robot, so this builds drafters of the right *shapes*
(random values) for any target ``config.json``: enough to exercise loading, the window and the speculative loop,
and to time a real-size drafter. Acceptance of a random drafter is near zero, of course.

Library use (tests, tools, lab)::

    from edgespec.bench.random_drafter import add_mtp_weights, write_dflash_drafter
    write_dflash_drafter("/tmp/d", "/tmp/target", num_layers=2, block_size=8, sliding_layers=1, sliding_window=4)
    add_mtp_weights("/tmp/qwen35_target")

Command line (from the repository root; ``tools/make_drafter.py`` runs :func:`main`)::

    python tools/make_drafter.py dflash --target DIR --out DIR [--layers 2] [--block-size 16] [--sliding 1
        --sliding-window 2048] [--layout nested|top] [--prefix model.] [--own-embed] [--own-lm-head]
    python tools/make_drafter.py dflash2 --target DIR --out DIR [the dflash options] [--conv-taps 2]
        [--conv-group 16] [--selector-rank 256] [--selector-top-k 16]
    python tools/make_drafter.py mtp --target DIR          # adds mtp.* to a Qwen3.5 checkpoint in place

A tiny Qwen3.5 target that already has MTP weights: ``edgespec.bench.shapes.write_random_checkpoint(folder,
tiny_config("qwen3_5"), with_mtp=True)``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from edgespec.drafters.dflash2_net import ARCHITECTURE as DFLASH2
from edgespec.drafters.dflash2_net import DFlash2DraftModel, parse_dflash2_config
from edgespec.drafters.dflash_net import DFlashDraftModel, default_target_layer_ids, parse_dflash_config
from edgespec.loading.hf_config import parse_config, read_json
from edgespec.loading.weights import weight_files
from edgespec.models.decoder import MTPHead

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _target_config(target: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(target, dict):
        return target
    path = Path(target)
    return read_json(path / "config.json" if path.is_dir() else path)


def dflash_config_dict(target: str | Path | dict[str, Any], *, num_layers: int = 2, block_size: int = 16,
                       mask_token_id: int | None = None, target_layer_ids: list[int] | None = None,
                       write_layer_ids: bool = True, sliding_layers: int = 0, sliding_window: int = 2048,
                       layout: str = "nested", intermediate_size: int | None = None, num_heads: int | None = None,
                       num_kv_heads: int | None = None, head_dim: int | None = None,
                       rope_theta: float | None = None) -> dict[str, Any]:
    """A DFlash ``config.json`` dict matching ``target`` (a folder, a config.json path or a config dict).

    ``layout``: ``nested`` puts mask_token_id / target_layer_ids under ``dflash_config`` (and block_size at the
    top level, like the published drafters); ``top`` puts all three at the top level. ``write_layer_ids=False``
    leaves the tap ids out so the loader's fallback rule applies. ``sliding_layers``: how many leading layers
    are ``sliding_attention`` (the Qwen3.6-27B drafter: 4 of 5, window 2048); the rest are full.
    """
    if layout not in ("nested", "top"):
        raise ValueError(f"layout {layout!r} is not 'nested' or 'top'")
    if not 0 <= sliding_layers <= num_layers:
        raise ValueError(f"sliding_layers {sliding_layers} out of range 0..{num_layers}")
    tcfg = parse_config(_target_config(target))
    ids = target_layer_ids if target_layer_ids is not None else default_target_layer_ids(
        tcfg.num_hidden_layers, num_layers)
    heads = num_heads or tcfg.num_attention_heads
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": tcfg.hidden_size,
        "intermediate_size": intermediate_size or tcfg.intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": heads, "num_key_value_heads": num_kv_heads or tcfg.num_key_value_heads,
        "head_dim": head_dim or tcfg.head_dim, "rms_norm_eps": tcfg.rms_norm_eps,
        "rope_theta": rope_theta or tcfg.rope_theta, "rope_scaling": None, "max_position_embeddings": 32768,
        "attention_bias": False, "hidden_act": "silu", "vocab_size": tcfg.vocab_size,
        "num_target_layers": tcfg.num_hidden_layers, "tie_word_embeddings": False, "dtype": "bfloat16",
        "layer_types": ["sliding_attention"] * sliding_layers + ["full_attention"] * (num_layers - sliding_layers),
        "sliding_window": sliding_window if sliding_layers else None, "block_size": block_size,
    }
    mask = tcfg.vocab_size - 1 if mask_token_id is None else mask_token_id
    extra: dict[str, Any] = {"mask_token_id": mask}
    if write_layer_ids:
        extra["target_layer_ids"] = list(ids)
    if layout == "nested":
        cfg["dflash_config"] = extra
    else:
        cfg.update(extra)
    return cfg


def _randomise(module: torch.nn.Module, seed: int, zero_centred: bool, spread: float = 0.5) -> None:
    """Seeded values of a sensible scale; norm weights randomised around their identity value (1, or 0 when
    zero-centred) so a ``w`` vs ``1 + w`` slip changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                centre = 0.0 if zero_centred else 1.0
                p.copy_(centre + spread * (2 * torch.rand(p.shape, generator=gen) - 1))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=gen) * fan_in ** -0.5)


def write_dflash_drafter(folder: str | Path, target: str | Path | dict[str, Any], *, seed: int = 0,
                         prefix: str = "", own_embed: bool = False, own_lm_head: bool = False,
                         dtype: torch.dtype = torch.float32, **config: Any) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of a random DFlash drafter for ``target``.

    ``prefix``: ``""`` (published layout) or ``"model."`` (also accepted by the loader; ``lm_head.weight`` stays
    unprefixed as in HF checkpoints). ``own_embed`` / ``own_lm_head`` ship ``embed_tokens.weight`` /
    ``lm_head.weight`` instead of borrowing the target's. Other keywords go to :func:`dflash_config_dict`.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tcfg_raw = _target_config(target)
    tcfg = parse_config(tcfg_raw)
    raw = dflash_config_dict(tcfg_raw, **config)
    cfg = parse_dflash_config(raw, tcfg.num_hidden_layers)
    vocab = tcfg.vocab_size
    # Built on meta and allocated directly in ``dtype``: a real-size drafter (Qwen3.6-27B: ~1.7B parameters)
    # must not need an fp32 copy in host memory.
    with torch.device("meta"):
        model = DFlashDraftModel(cfg, tcfg.hidden_size, vocab if own_embed else None,
                                 vocab if own_lm_head else None).to(dtype)
    model = model.to_empty(device="cpu")
    _randomise(model, seed, zero_centred=False)
    tensors = {}
    for name, t in model.state_dict().items():
        key = name if name.startswith("lm_head.") else prefix + name
        tensors[key] = t.contiguous()
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def dflash2_config_dict(target: str | Path | dict[str, Any], *, conv_taps: int = 2, conv_group: int = 16,
                        selector_rank: int = 256, selector_top_k: int = 16, **config: Any) -> dict[str, Any]:
    """A DFlash2 ``config.json`` dict for ``target``: :func:`dflash_config_dict`'s (nested layout) declaring
    ``DFlash2DraftModel``, with block size, convolution and selector sizes in ``dflash_config``."""
    raw = dflash_config_dict(target, layout="nested", **config)
    raw["architectures"] = [DFLASH2]
    raw["dflash_config"].update(block_size=raw.pop("block_size"), conv_kernel_size=conv_taps,
                                conv_group_size=conv_group, selector_rank=selector_rank, selector_top_k=selector_top_k)
    return raw


def write_dflash2_drafter(folder: str | Path, target: str | Path | dict[str, Any], *, seed: int = 0,
                          dtype: torch.dtype = torch.float32, conv_taps: int = 2, conv_group: int = 16,
                          selector_rank: int = 256, selector_top_k: int = 16, **config: Any) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of a random DFlash2 drafter for ``target``: a DFlash drafter
    (keywords as :func:`dflash_config_dict`, the convolution and selector sizes in ``dflash_config``) with each
    layer's convolutions -- their learnt kernels around the identity, so the block's signal survives -- and the
    selector's codebooks stored bare, as published."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tcfg_raw = _target_config(target)
    tcfg = parse_config(tcfg_raw)
    raw = dflash2_config_dict(tcfg_raw, conv_taps=conv_taps, conv_group=conv_group, selector_rank=selector_rank,
                              selector_top_k=selector_top_k, **config)
    cfg = parse_dflash2_config(raw, tcfg.num_hidden_layers)
    with torch.device("meta"):
        model = DFlash2DraftModel(cfg, tcfg.hidden_size, tcfg.vocab_size).to(dtype)
    model = model.to_empty(device="cpu")
    _randomise(model, seed, zero_centred=False)
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel[:, 0] += 1.0
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def add_mtp_weights(folder: str | Path, seed: int = 0, num_layers: int | None = None,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Add random ``mtp.*`` weights to a Qwen3.5/3.6 checkpoint folder (written to ``mtp.safetensors``; a
    sharded checkpoint's index gets the new keys). ``num_layers`` also sets ``mtp_num_hidden_layers`` in the
    config (default: the config's value, or 1 when it has none)."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    raw = read_json(cfg_path)
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    if num_layers is not None or not text.get("mtp_num_hidden_layers"):
        text["mtp_num_hidden_layers"] = num_layers or 1
        cfg_path.write_text(json.dumps(raw, indent=2))
    cfg = parse_config(raw)
    if cfg.family != "qwen3_5":
        raise ValueError(f"{folder}: MTP weights exist only for Qwen3.5/3.6 targets, not {cfg.model_type!r}")
    files = weight_files(folder)
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            if any(k.startswith("mtp.") for k in f.keys()):
                raise ValueError(f"{path} already holds mtp.* weights")
    head = MTPHead(cfg)
    _randomise(head, seed, zero_centred=cfg.zero_centred_norms)
    tensors = {f"mtp.{name}": t.to(dtype).contiguous() for name, t in head.state_dict().items()}
    save_file(tensors, str(folder / "mtp.safetensors"), metadata={"format": "pt"})
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        index = read_json(indexes[0])
        index["weight_map"].update({k: "mtp.safetensors" for k in tensors})
        indexes[0].write_text(json.dumps(index, indent=2))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("dflash", help="write a random DFlash drafter folder for a target")
    p.add_argument("--target", required=True, help="target checkpoint folder or config.json")
    p.add_argument("--out", required=True, help="drafter folder to write")
    p.add_argument("--layers", type=int, default=2, help="drafter layers (published: 5)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, default=None, help="default: target vocab_size - 1")
    p.add_argument("--taps", default=None, help="comma-separated target_layer_ids (default: the fallback rule)")
    p.add_argument("--no-taps", action="store_true", help="leave target_layer_ids out of the config")
    p.add_argument("--sliding", type=int, default=0, help="leading sliding_attention layers")
    p.add_argument("--sliding-window", type=int, default=2048)
    p.add_argument("--layout", choices=("nested", "top"), default="nested")
    p.add_argument("--prefix", default="", help="key prefix: '' or 'model.'")
    p.add_argument("--own-embed", action="store_true", help="ship embed_tokens.weight")
    p.add_argument("--own-lm-head", action="store_true", help="ship lm_head.weight")
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("dflash2", help="write a random DFlash2 drafter folder for a target", parents=[p],
                       add_help=False)
    p.add_argument("--conv-taps", type=int, default=2, help="conv_kernel_size")
    p.add_argument("--conv-group", type=int, default=16, help="conv_group_size")
    p.add_argument("--selector-rank", type=int, default=256)
    p.add_argument("--selector-top-k", type=int, default=16)
    p = sub.add_parser("mtp", help="add random mtp.* weights to a Qwen3.5/3.6 checkpoint folder (in place)")
    p.add_argument("--target", required=True, help="target checkpoint folder")
    p.add_argument("--layers", type=int, default=None, help="mtp_num_hidden_layers (default: config or 1)")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command in ("dflash", "dflash2"):
        taps = [int(t) for t in args.taps.split(",")] if args.taps else None
        shape = dict(num_layers=args.layers, block_size=args.block_size, mask_token_id=args.mask_token_id,
                     target_layer_ids=taps, write_layer_ids=not args.no_taps, sliding_layers=args.sliding,
                     sliding_window=args.sliding_window, intermediate_size=args.intermediate_size,
                     num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim)
        if args.command == "dflash":
            out = write_dflash_drafter(args.out, args.target, seed=args.seed, prefix=args.prefix,
                                       own_embed=args.own_embed, own_lm_head=args.own_lm_head,
                                       dtype=_DTYPES[args.dtype], layout=args.layout, **shape)
        else:
            out = write_dflash2_drafter(args.out, args.target, seed=args.seed, dtype=_DTYPES[args.dtype],
                                        conv_taps=args.conv_taps, conv_group=args.conv_group,
                                        selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
                                        **shape)
    else:
        out = add_mtp_weights(args.target, seed=args.seed, num_layers=args.layers, dtype=_DTYPES[args.dtype])
    print(out)
    return 0
