"""Build the proposer a drafter plan names, checked against the target before any device work."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from edgespec.drafters.base import Proposer
from edgespec.drafters.ngram import NGramProposer
from edgespec.drafters.plan import DrafterPlan
from edgespec.errors import ConfigError
from edgespec.models.decoder import TargetModel


def build_proposer(plan: DrafterPlan, model: TargetModel,
                   choose_kernels: Callable[[nn.Module], int] | None = None) -> Proposer | None:
    """``none`` -> None; ``ngram`` -> prompt lookup; ``dflash`` / ``mtp`` -> model-based drafters.
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
    if name == "dflash":
        from edgespec.drafters.dflash import load_dflash
        return _with_lookup(load_dflash(plan, model, choose_kernels), plan)
    if name == "mtp":
        from edgespec.drafters.mtp import MTPProposer
        return _with_lookup(MTPProposer.from_target(model, max_seq_len=plan.max_seq_len), plan)
    raise ConfigError(f"drafter {name!r} is not one of none, ngram, dflash, mtp")


def _with_lookup(proposer: Proposer, plan: DrafterPlan) -> Proposer:
    """The model drafter, behind an n-gram lookup when ``lookup_min_match`` is above 0 (edgespec.drafters.lookup;
    why the default is 3: docs/benchmarks.md, "The shipped demo DFlash drafter")."""
    if plan.lookup_min_match <= 0:
        return proposer
    from edgespec.drafters.lookup import LookupFirstProposer
    return LookupFirstProposer(proposer, min_match=plan.lookup_min_match, max_len=plan.max_seq_len + 64)
