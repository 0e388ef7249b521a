"""Build the proposer named by the settings, checked against the target before any device work."""

from __future__ import annotations

from edgespec.config import Settings
from edgespec.drafters.base import Proposer
from edgespec.drafters.ngram import NGramProposer
from edgespec.errors import ConfigError
from edgespec.models.decoder import TargetModel


def build_proposer(settings: Settings, model: TargetModel) -> Proposer | None:
    """``none`` -> None; ``ngram`` -> prompt lookup; ``dflash`` / ``mtp`` -> model-based drafters."""
    name = settings.drafter
    if name == "none":
        return None
    if name == "ngram":
        if settings.ngram_min_match > settings.ngram_max_match:
            raise ConfigError(f"ngram_min_match {settings.ngram_min_match} exceeds ngram_max_match "
                              f"{settings.ngram_max_match}")
        return NGramProposer(max_match=settings.ngram_max_match, min_match=settings.ngram_min_match,
                             lookback=settings.ngram_lookback, gate=settings.ngram_gate,
                             max_len=settings.max_seq_len + 64)
    if name == "dflash":
        from edgespec.drafters.dflash import load_dflash
        return _with_lookup(load_dflash(settings, model), settings, model)
    if name == "mtp":
        from edgespec.drafters.mtp import MTPProposer
        return _with_lookup(MTPProposer.from_target(model, max_seq_len=settings.max_seq_len), settings, model)
    raise ConfigError(f"drafter {name!r} is not one of none, ngram, dflash, mtp")


def _with_lookup(proposer: Proposer, settings: Settings, model: TargetModel) -> Proposer:
    """The model drafter, behind an n-gram lookup when ``lookup_min_match`` (or, left unset, the arch default of the
    model's device) is above 0 (edgespec.drafters.lookup)."""
    min_match = settings.lookup_min_match
    if min_match is None:
        from edgespec.arch.detect import select_hooks
        min_match = select_hooks(settings.arch, model.device).defaults.lookup_min_match
    if min_match <= 0:
        return proposer
    from edgespec.drafters.lookup import LookupFirstProposer
    return LookupFirstProposer(proposer, min_match=min_match, max_len=settings.max_seq_len + 64)
