"""Load a DFlash2 drafter checkpoint folder for a target, checking that the two fit, into a proposer.

The folder is z-lab's format: ``config.json`` with ``architectures: ["DFlash2DraftModel"]`` and the convolution
and selector sizes in ``dflash_config``, and safetensors weights under the DFlash names plus
``layers.{i}.{attention_conv,mlp_conv}.{base_kernel,kernel_projection.weight}`` and
``candidate_selector.{hidden_projection.weight,predecessor_codebook,successor_codebook}`` (the codebooks bare, as
published; the ``.weight`` names ``save_pretrained`` writes are accepted too). Checks, dtype and the
``drafter_weights`` formats are the DFlash loader's (:mod:`edgespec.drafters.dflash_loader`); the codebooks stay
dense (only their rows of the K candidates are read per draft).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from edgespec.drafters.dflash2_net import DFlash2Config, DFlash2DraftModel, is_dflash2_config, parse_dflash2_config
from edgespec.drafters.dflash2_proposer import DFlash2Proposer
from edgespec.drafters.dflash_loader import (
    _check_fit,
    _checkpoint_index,
    check_draft_count,
    check_window,
    fill_drafter,
    open_drafter_folder,
)
from edgespec.drafters.plan import DrafterPlan
from edgespec.drafters.quantize import serve_quantized
from edgespec.errors import CheckpointError
from edgespec.loading.hf_config import read_json
from edgespec.loading.weights import weight_files
from edgespec.models.decoder import TargetModel

_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def is_dflash2_folder(folder: str | Path | None) -> bool:
    """True when ``folder`` holds a ``config.json`` that declares a DFlash2 drafter (False when it cannot be read:
    the DFlash loader then names the problem)."""
    if folder is None:
        return False
    try:
        return is_dflash2_config(read_json(Path(folder).expanduser() / "config.json"))
    except CheckpointError:
        return False


def _parameter_name(name: str) -> str:
    """Our parameter name of a checkpoint name (``model.`` already stripped): the codebooks' ``.weight`` dropped."""
    stem = name.removesuffix(".weight")
    return stem if stem in _CODEBOOKS else name


def _selector_vocab(cfg: DFlash2Config, target: TargetModel, shapes: dict[str, tuple[int, ...]], folder: Path,
                    head_vocab: int | None) -> int:
    """Rows of the codebooks: the tokens the head scores (the selector looks candidates up by token id)."""
    scored = head_vocab or target.config.vocab_size
    for name in _CODEBOOKS:
        shape = shapes.get(name)
        if shape is None:
            raise CheckpointError(f"DFlash2 drafter {folder}: missing {name} (the candidate selector's codebook)")
        if shape != (scored, cfg.selector_rank):
            raise CheckpointError(f"DFlash2 drafter {folder}: {name} has shape {shape}, expected ({scored}, "
                                  f"{cfg.selector_rank}) = (tokens the head scores, selector_rank)")
    return scored


def load_dflash2_checkpoint(folder: str | Path, target: TargetModel, *, window_size: int = 128,
                            window_seed: bool = True, cuda_graphs: bool = False, weights: str = "model",
                            choose_kernels: Callable[[nn.Module], int] | None = None,
                            use_selector: bool = True) -> DFlash2Proposer:
    """Load a DFlash2 drafter folder for ``target``. ``weights``: ``model`` serves the checkpoint's dtype; ``fp8``
    / ``int4`` / ``nvfp4`` pack its linear layers after loading (``choose_kernels`` as for
    :func:`~edgespec.drafters.dflash_loader.load_dflash_checkpoint`). ``use_selector``: draft the selector's path
    (False: each position's argmax).

    Raises :class:`CheckpointError` for missing / unreadable files, missing or unexpected keys and shape mismatches
    (a codebook not sized to the head's vocabulary included), and :class:`ConfigError` when the drafter was made for
    another target.
    """
    folder, raw = open_drafter_folder(folder, weights, "DFlash2")
    cfg = parse_dflash2_config(raw, target.config.num_hidden_layers, source=str(folder / "config.json"))
    check_window(window_size, cfg.block_size, folder)
    files = weight_files(folder)
    index = {key: (_parameter_name(name), shape) for key, (name, shape) in _checkpoint_index(files).items()}
    shapes = dict(index.values())
    embed_vocab, head_vocab = _check_fit(cfg, target, shapes, folder)
    selector_vocab = _selector_vocab(cfg, target, shapes, folder, head_vocab)
    drafter = fill_drafter(
        lambda: DFlash2DraftModel(cfg, target.config.hidden_size, selector_vocab, embed_vocab, head_vocab),
        target, files, {key: name for key, (name, _) in index.items()}, folder, "DFlash2")
    serve_quantized(drafter, weights, drafter.fc.weight.dtype, choose_kernels)
    return DFlash2Proposer(drafter, target, window_size=window_size, window_seed=window_seed,
                           cuda_graphs=cuda_graphs, use_selector=use_selector)


def load_dflash2(plan: DrafterPlan, model: TargetModel,
                 choose_kernels: Callable[[nn.Module], int] | None = None) -> DFlash2Proposer:
    """Build the DFlash2 proposer ``plan`` describes (folder, window, seeding, graphs, weight format, selector)."""
    proposer = load_dflash2_checkpoint(plan.dflash_path, model, window_size=plan.window_size,
                                       window_seed=plan.window_seed, cuda_graphs=plan.cuda_graphs,
                                       weights=plan.weights, choose_kernels=choose_kernels,
                                       use_selector=plan.dflash_selector)
    check_draft_count(plan.num_draft_tokens, proposer)
    return proposer


__all__ = ["is_dflash2_folder", "load_dflash2", "load_dflash2_checkpoint"]
