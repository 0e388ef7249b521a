"""The one point where ``edgespec distill`` meets a drafter architecture: build, load, train and write it.

The data (the target's tokens and tapped hidden states), the anchored blocks (:func:`~edgespec.distill.objective.
make_blocks`), the loop (:mod:`edgespec.distill.train`) and the held-out estimate are the same for every drafter
that drafts a block from the target's taps (DFlash, DFlash2). What differs lives behind a :class:`DrafterKind`:
how a fresh drafter is made, how a published checkpoint is read back (``--init``), the differentiable forward and
loss (:class:`TrainObjective`), and the ``config.json`` it is published with. ``--drafter-kind NAME`` picks one;
a new kind is one module exposing ``KIND`` and one line in :data:`KIND_MODULES`.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from edgespec.errors import ConfigError

if TYPE_CHECKING:
    from edgespec.distill.objective import BlockBatch
    from edgespec.models.decoder import TargetModel


class TrainObjective(Protocol):
    """What the training loop needs of a drafter's objective (an ``nn.Module``; DDP wraps it)."""

    drafter: nn.Module          # the trained parameters (the target's embedding and head are frozen buffers)
    cfg: Any                    # the drafter's parsed config: block_size, mask_token_id, target_layer_ids
    head: torch.Tensor          # the target's output projection [V, H] (its row count sizes a sampled softmax)

    def __call__(self, b: BlockBatch, vocab: torch.Tensor | None = None) -> Any:
        """Float32 logits ``[N, bs-1, V]`` (or over ``vocab``) of the draft rows of every block, or an object whose
        ``logits`` they are, carrying what else its :meth:`loss` needs (DFlash2: the selector's path scores)."""

    def loss(self, out: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted mean loss, weight sum) over the valid rows of the forward's output ``out``."""

    def drafts(self, b: BlockBatch) -> torch.Tensor:
        """The tokens ``[N, bs-1]`` the proposer would draft for every block (the held-out AL compares them)."""


@dataclass(frozen=True)
class DrafterKind:
    """How one drafter architecture is built, loaded, trained and published by ``edgespec distill``."""

    name: str
    # (parsed distill arguments, target, seed) -> a fresh fp32 drafter, started from the target where it can be
    new: Callable[[argparse.Namespace, TargetModel, int], nn.Module]
    # (published checkpoint folder, target) -> that drafter in fp32, to fine-tune (--init)
    load: Callable[[str, TargetModel], nn.Module]
    # (drafter, target embedding [V, H], target head [V, H], max positions, window or None, gamma) -> objective
    objective: Callable[[nn.Module, torch.Tensor, torch.Tensor, int, int | None, float], TrainObjective]
    # (drafter config, target config) -> the published config.json the runtime's loader reads
    published_config: Callable[[Any, Any], dict[str, Any]]


# kind name -> the module whose ``KIND`` it is (imported only when that kind is asked for).
KIND_MODULES: dict[str, str] = {
    "dflash": "edgespec.distill.dflash_kind",
    "dflash2": "edgespec.distill.dflash2_kind",
}


def drafter_kind(name: str) -> DrafterKind:
    """The :class:`DrafterKind` called ``name``; an unknown name is a ConfigError listing the known ones."""
    if name not in KIND_MODULES:
        raise ConfigError(f"--drafter-kind {name!r} is not one of {', '.join(KIND_MODULES)}")
    kind = importlib.import_module(KIND_MODULES[name]).KIND
    if not isinstance(kind, DrafterKind) or kind.name != name:
        raise ConfigError(f"{KIND_MODULES[name]}.KIND is not the DrafterKind {name!r}")
    return kind
