"""The DFlash2 drafter kind of ``edgespec distill`` (:mod:`edgespec.distill.kinds`): z-lab's ``DFlash2DraftModel``.

A fresh drafter is a DFlash drafter of the shape the arguments ask for (:func:`~edgespec.distill.dflash_kind.
drafter_config`, started from the target's last layer where the shapes match) plus each layer's two grouped
dynamic convolutions (``--conv-kernel-size`` taps, groups of ``--conv-group-size`` channels), started as the
identity -- base kernel 1 on the current row, 0 on the rows before, no dynamic part -- so the drafter begins as the
DFlash drafter it extends, and the candidate selector (``--selector-rank``, ``--selector-top-k``). ``--init`` reads
a published DFlash2 checkpoint back (bare or ``.weight`` codebooks); the objective is
:class:`~edgespec.distill.dflash2_objective.DFlash2Objective`; the checkpoint is written with the package's
``config.json`` keys (the convolution and selector sizes, ``output_multiplier`` and ``final_logit_softcapping``
under ``dflash_config``), so our loader and z-lab's ``DFlash2DraftModel.from_pretrained`` both read it.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from edgespec.distill import dflash_kind
from edgespec.distill.dflash2_objective import DFlash2Objective
from edgespec.distill.kinds import DrafterKind
from edgespec.drafters.dflash2_loader import _parameter_name
from edgespec.drafters.dflash2_net import ARCHITECTURE, DFlash2Config, DFlash2DraftModel, parse_dflash2_config


def published_config(cfg: DFlash2Config, target_cfg: Any) -> dict[str, Any]:
    """The DFlash ``config.json`` (:func:`~edgespec.distill.dflash_kind.published_config`) as a DFlash2 one."""
    raw = dflash_kind.published_config(cfg, target_cfg)
    raw["architectures"] = [ARCHITECTURE]
    raw["dflash_config"].update(
        block_size=cfg.block_size, conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
        selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k,
        output_multiplier=cfg.output_multiplier)
    if cfg.final_logit_softcapping is not None:
        raw["dflash_config"]["final_logit_softcapping"] = cfg.final_logit_softcapping
    return raw


def drafter_config(args: argparse.Namespace, target_cfg: Any) -> DFlash2Config:
    """The DFlash2 config of the distill arguments: the DFlash shape plus the convolution and selector sizes."""
    raw = dflash_kind.published_config(dflash_kind.drafter_config(args, target_cfg), target_cfg)
    raw["dflash_config"].update(conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
                                selector_rank=args.selector_rank, selector_top_k=args.selector_top_k)
    return parse_dflash2_config(raw, target_cfg.num_hidden_layers, source="distill arguments (--conv-kernel-size, "
                                "--conv-group-size, --selector-rank, --selector-top-k)")


def random_drafter(args: argparse.Namespace, target_cfg: Any, seed: int) -> DFlash2DraftModel:
    """A random drafter (norms 1, weights N(0, 0.02)) whose convolutions start as the identity."""
    drafter = DFlash2DraftModel(drafter_config(args, target_cfg), target_cfg.hidden_size, target_cfg.vocab_size)
    dflash_kind.random_init(drafter, seed)
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0
                conv.kernel_projection.weight.zero_()
    return drafter


def new_drafter(args: argparse.Namespace, target, seed: int) -> DFlash2DraftModel:
    """A fresh drafter for ``target``: random, then started from the target's last layer (``--target-init``)."""
    drafter = random_drafter(args, target.config, seed)
    if getattr(args, "target_init", False):
        dflash_kind.target_init(drafter, target)
    return drafter


def load_drafter(folder: str, target) -> DFlash2DraftModel:
    """A published DFlash2 drafter in fp32 to fine-tune (``--init``)."""
    return dflash_kind.load_drafter(
        folder, target, "DFlash2", parse=parse_dflash2_config, rename=_parameter_name,
        build=lambda cfg, t: DFlash2DraftModel(cfg, t.config.hidden_size, t.config.vocab_size))


def objective(drafter: DFlash2DraftModel, embed: torch.Tensor, head: torch.Tensor, max_positions: int,
              window: int | None, gamma: float) -> DFlash2Objective:
    return DFlash2Objective(drafter, embed, head, max_positions, window=window, gamma=gamma)


KIND = DrafterKind(name="dflash2", new=new_drafter, load=load_drafter, objective=objective,
                   published_config=published_config)
