"""Build the proposer a drafter plan names, checked against the target before any device work."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from edgespec.drafters.base import Proposer
from edgespec.drafters.ngram import NGramProposer
from edgespec.drafters.plan import DrafterPlan
from edgespec.drafters.suffix import SuffixProposer
from edgespec.drafters.suffix_cache import SuffixCache
from edgespec.errors import ConfigError
from edgespec.models.decoder import TargetModel


def build_proposer(plan: DrafterPlan, model: TargetModel,
                   choose_kernels: Callable[[nn.Module], int] | None = None) -> Proposer | None:
    """``none`` -> None; ``ngram`` -> prompt lookup; ``suffix`` -> suffix tries over the request and earlier
    outputs; ``dflash`` (a DFlash or DFlash2 checkpoint) / ``mtp`` -> model-based drafters.
    ``choose_kernels``: the engine's hooks pick a quantized drafter's products (``ArchHooks.choose_weight_kernels``)."""
    name = plan.name
    if name == "none":
        return None
    if name == "ngram":
        ng = plan.ngram
        if ng.min_match > ng.max_match:
            raise ConfigError(f"ngram_min_match {ng.min_match} exceeds ngram_max_match {ng.max_match}")
        return NGramProposer(max_match=ng.max_match, min_match=ng.min_match, lookback=ng.lookback, gate=ng.gate,
                             max_len=plan.max_seq_len + 64)
    if name == "suffix":
        return build_suffix(plan, model, min_match=1)
    if name == "dflash":
        # DFlash and DFlash2 share the setting: the checkpoint's config.json says which network it holds.
        from edgespec.drafters.dflash2_loader import is_dflash2_folder
        if is_dflash2_folder(plan.dflash_path):
            from edgespec.drafters.dflash2_loader import load_dflash2
            return _with_lookup(load_dflash2(plan, model, choose_kernels), plan, model)
        from edgespec.drafters.dflash import load_dflash
        return _with_lookup(load_dflash(plan, model, choose_kernels), plan, model)
    if name == "mtp":
        from edgespec.drafters.mtp import MTPProposer
        return _with_lookup(MTPProposer.from_target(model, max_seq_len=plan.max_seq_len), plan, model)
    raise ConfigError(f"drafter {name!r} is not one of none, ngram, suffix, dflash, mtp")


def _with_lookup(proposer: Proposer, plan: DrafterPlan, model: TargetModel) -> Proposer:
    """The model drafter, behind an n-gram lookup when ``lookup_min_match`` is above 0 (edgespec.drafters.lookup;
    why the default is 3: docs/benchmarks.md, "The shipped demo DFlash drafter")."""
    if plan.lookup_min_match <= 0:
        return proposer
    from edgespec.drafters.lookup import LookupFirstProposer
    lookup = None
    if plan.lookup_drafter == "suffix":
        lookup = build_suffix(plan, model, min_match=plan.lookup_min_match)
    return LookupFirstProposer(proposer, min_match=plan.lookup_min_match, max_len=plan.max_seq_len + 64,
                               lookup=lookup)


def build_suffix(plan: DrafterPlan, model: TargetModel, min_match: int) -> SuffixProposer:
    """The suffix drafter of the plan, its cache sized by ``suffix_cache_mb`` (and persisted next to the request
    log with ``suffix_persist``)."""
    sx = plan.suffix
    max_match = min(sx.max_match, sx.max_depth - 1)
    cache = SuffixCache(int(sx.cache_mb * (1 << 20)), sx.max_depth, model.config.vocab_size, sx.persist_path)
    return SuffixProposer(cache, max_depth=sx.max_depth, max_match=max(max_match, min_match), min_match=min_match,
                          factor=sx.factor, min_prob=sx.min_prob)
