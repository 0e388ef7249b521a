"""Load a DFlash drafter checkpoint folder for a target, checking that the two fit, into a proposer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from edgespec.drafters.dflash_net import DFlashConfig, DFlashDraftModel, parse_dflash_config
from edgespec.drafters.dflash_proposer import DFlashProposer
from edgespec.drafters.draft_vocab import load_draft_ids
from edgespec.drafters.plan import DrafterPlan
from edgespec.drafters.quantize import DRAFTER_WEIGHTS, serve_quantized
from edgespec.errors import CheckpointError, ConfigError
from edgespec.loading.hf_config import read_json
from edgespec.loading.weights import load_parameters, weight_files
from edgespec.models.decoder import TargetModel
from edgespec.models.meta_init import materialize, meta_modules


def _checkpoint_index(files: list[Path]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Checkpoint key -> (our parameter name with ``model.`` stripped, shape), from the file headers only;
    ``rotary_emb.*`` (derived, not weights) is left out."""
    index: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    name = key[len("model."):] if key.startswith("model.") else key
                    if "rotary_emb." not in name:
                        index[key] = (name, tuple(f.get_slice(key).get_shape()))
        except Exception as e:  # a corrupt header: name the file
            raise CheckpointError(f"cannot read weights from {path}: {e} (truncated or corrupt file?)") from None
    return index


def _check_fit(cfg: DFlashConfig, target: TargetModel, shapes: dict[str, tuple[int, ...]],
               folder: Path) -> tuple[int | None, int | None]:
    """Raise ConfigError when the drafter cannot run with this target; returns (own embed vocab, own head vocab)."""
    tcfg = target.config
    where = f"DFlash drafter {folder}"
    n_target = tcfg.num_hidden_layers
    if cfg.num_target_layers is not None and cfg.num_target_layers != n_target:
        raise ConfigError(f"{where} was trained for a target with {cfg.num_target_layers} layers, but the target "
                          f"({tcfg.model_type}) has {n_target}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < n_target]
    if bad:
        raise ConfigError(f"{where}: target_layer_ids {cfg.target_layer_ids} include {bad}, outside the target's "
                          f"layers 0..{n_target - 1}")
    embed_vocab = shapes["embed_tokens.weight"][0] if "embed_tokens.weight" in shapes else None
    head_vocab = shapes["lm_head.weight"][0] if "lm_head.weight" in shapes else None
    borrows = embed_vocab is None or (head_vocab is None and not cfg.tie_word_embeddings)
    if borrows and cfg.hidden_size != tcfg.hidden_size:
        raise ConfigError(f"{where}: hidden_size {cfg.hidden_size} does not match the target's "
                          f"{tcfg.hidden_size} (the drafter borrows the target's embedding / lm_head)")
    if borrows and cfg.vocab_size is not None and cfg.vocab_size != tcfg.vocab_size:
        raise ConfigError(f"{where}: vocab_size {cfg.vocab_size} does not match the target's {tcfg.vocab_size} "
                          f"(a drafter for another tokenizer?)")
    vocab = embed_vocab if embed_vocab is not None else tcfg.vocab_size
    if not 0 <= cfg.mask_token_id < vocab:
        raise ConfigError(f"{where}: mask_token_id {cfg.mask_token_id} is outside the embedding's vocabulary "
                          f"of {vocab} tokens")
    out_vocab = head_vocab or (embed_vocab if cfg.tie_word_embeddings else None)
    if out_vocab is not None and out_vocab > tcfg.vocab_size:
        raise ConfigError(f"{where}: its lm_head scores {out_vocab} tokens, more than the target's vocabulary "
                          f"of {tcfg.vocab_size}")
    return embed_vocab, head_vocab


class WindowTooSmallError(ConfigError):
    """``window_size`` below the drafter's ``block_size``: one verify can commit a whole block of tokens, more
    than such a window holds, so the window would lose tokens it must keep (refused before any generation)."""


def check_window(window_size: int, block_size: int, where: object = "the DFlash drafter") -> None:
    """Raise :class:`WindowTooSmallError` unless ``window_size >= block_size``."""
    if window_size < block_size:
        raise WindowTooSmallError(
            f"window_size {window_size} is below the block_size {block_size} of {where}: one cycle can commit "
            f"up to {block_size} tokens, so the per-token context window needs at least that many slots "
            f"(set --window-size {block_size} or more)")


def _drafter_dtype(target: TargetModel) -> torch.dtype:
    # fp16 overflows on hidden-state outliers and collapses acceptance: such targets get a bf16 drafter.
    return torch.bfloat16 if target.dtype == torch.float16 else target.dtype


def open_drafter_folder(folder: str | Path, weights: str, kind: str) -> tuple[Path, dict]:
    """Check the ``drafter_weights`` format and that ``folder`` exists; returns the folder and its config dict."""
    if weights not in DRAFTER_WEIGHTS:
        raise ConfigError(f"drafter_weights {weights!r}: choose one of {', '.join(DRAFTER_WEIGHTS)}")
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"{kind} drafter folder not found: {folder}")
    return folder, read_json(folder / "config.json")


def fill_drafter(build: Callable[[], nn.Module], target: TargetModel, files: list[Path], key_names: dict[str, str],
                 folder: Path, kind: str) -> nn.Module:
    """The drafter ``build`` makes, built on the meta device, allocated on the target's device in the drafter
    dtype and filled from ``files`` (checkpoint key -> parameter name: ``key_names``); every problem named."""
    with meta_modules():   # no throw-away random init (edgespec.models.meta_init)
        drafter = build()
    materialize(drafter, target.device)
    drafter = drafter.to(_drafter_dtype(target))
    fc_hint = f" (= {len(drafter.cfg.target_layer_ids)} taps x target hidden {target.config.hidden_size})"
    problems = load_parameters(dict(drafter.named_parameters()), files, key_names.get,
                               lambda name: fc_hint if name == "fc.weight" else "")
    if problems:
        raise CheckpointError(f"{kind} drafter {folder} does not fit its config: " + " | ".join(problems))
    return drafter


def load_dflash_checkpoint(folder: str | Path, target: TargetModel, *, window_size: int = 128,
                           window_seed: bool = True, cuda_graphs: bool = False, weights: str = "model",
                           choose_kernels: Callable[[nn.Module], int] | None = None,
                           draft_vocab: int = 0) -> DFlashProposer:
    """Load a DFlash drafter folder (``config.json`` + safetensors) for ``target``, checking that they fit.
    ``weights``: ``model`` serves the checkpoint's dtype; ``fp8`` / ``int4`` / ``nvfp4`` quantize the drafter's
    linear layers after loading (:mod:`edgespec.drafters.quantize`) and give them the device's fast product:
    ``choose_kernels`` (the engine's ``ArchHooks.choose_weight_kernels``; None: the portable choice every arch
    shares, for callers without an engine). ``draft_vocab``: score only the folder's ``draft_vocab`` most frequent
    token ids (its ``draft_vocab.json``, :mod:`edgespec.drafters.draft_vocab`; 0: the full head).

    Raises :class:`CheckpointError` for missing / unreadable files, missing or unexpected keys and shape
    mismatches, and :class:`ConfigError` when the drafter was made for another target (hidden size,
    vocabulary, mask id, tap layers, layer count).
    """
    folder, raw = open_drafter_folder(folder, weights, "DFlash")
    cfg = parse_dflash_config(raw, target.config.num_hidden_layers, source=str(folder / "config.json"))
    check_window(window_size, cfg.block_size, folder)
    files = weight_files(folder)
    index = _checkpoint_index(files)
    embed_vocab, head_vocab = _check_fit(cfg, target, dict(index.values()), folder)
    drafter = fill_drafter(lambda: DFlashDraftModel(cfg, target.config.hidden_size, embed_vocab, head_vocab),
                           target, files, {key: name for key, (name, _) in index.items()}, folder, "DFlash")
    serve_quantized(drafter, weights, drafter.fc.weight.dtype, choose_kernels)
    # Loaded under the checkpoint's names; the proposer merges q/k/v and gate/up (+ fused SiLU), as in the target.
    proposer = DFlashProposer(drafter, target, window_size=window_size, window_seed=window_seed,
                              cuda_graphs=cuda_graphs)
    if draft_vocab:
        proposer.set_draft_vocab(load_draft_ids(folder, draft_vocab, proposer._head_vocab()))
    return proposer


def demo_drafter_path() -> Path:
    """The DFlash drafter shipped for the embedded demo model (``--model demo``), trained by ``edgespec distill``
    (recipe in docs/drafters.md)."""
    from importlib import resources

    return Path(str(resources.files("edgespec").joinpath("data/drafters/smollm2-135m-dflash")))


def is_packaged_drafter(model: str, drafter_path: str | None) -> bool:
    """True when a ``model`` and ``drafter_path`` setting serve the packaged demo drafter: the demo model with no
    drafter path."""
    return not drafter_path and model == "demo"


def dflash_folder(model: str, drafter_path: str | None) -> str | None:
    """The DFlash checkpoint folder a ``model`` and ``drafter_path`` setting name: the drafter path, or the
    packaged demo drafter."""
    return str(demo_drafter_path()) if is_packaged_drafter(model, drafter_path) else drafter_path


def load_dflash(plan: DrafterPlan, model: TargetModel,
                choose_kernels: Callable[[nn.Module], int] | None = None) -> DFlashProposer:
    """Build the DFlash proposer ``plan`` describes (its folder, window, seeding, graphs and weight format, arch
    defaults already applied). The packaged demo drafter, when it does not fit, says which setting picks another."""
    if not plan.dflash_path:
        raise ConfigError("drafter dflash needs drafter_path (--drafter-path / EDGESPEC_DRAFTER_PATH): the "
                          "DFlash checkpoint folder")
    try:
        proposer = load_dflash_checkpoint(plan.dflash_path, model, window_size=plan.window_size,
                                          window_seed=plan.window_seed, cuda_graphs=plan.cuda_graphs,
                                          weights=plan.weights, choose_kernels=choose_kernels,
                                          draft_vocab=plan.draft_vocab)
    except ConfigError as e:
        if not plan.dflash_packaged:
            raise
        # The packaged drafter serves the embedded demo model only: name the setting that picks another.
        raise ConfigError(f"the packaged demo DFlash drafter does not fit this target ({e}); set drafter_path "
                          f"(--drafter-path / EDGESPEC_DRAFTER_PATH) to a drafter trained for it") from None
    check_draft_count(plan.num_draft_tokens, proposer)
    return proposer


def check_draft_count(k: int | None, proposer: DFlashProposer) -> None:
    """Raise ConfigError when ``num_draft_tokens`` ``k`` is more than one block of ``proposer`` drafts."""
    if k is not None and k > proposer.max_k:
        raise ConfigError(f"num_draft_tokens {k} exceeds what the {proposer.name} drafter can draft in one block "
                          f"(block_size {proposer.block_size} -> at most {proposer.max_k})")


__all__ = ["check_draft_count", "demo_drafter_path", "dflash_folder", "fill_drafter", "is_packaged_drafter",
           "load_dflash", "load_dflash_checkpoint", "open_drafter_folder"]
