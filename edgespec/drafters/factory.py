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
        return _with_lookup(load_dflash(settings, model), settings)
    if name == "mtp":
        from edgespec.drafters.mtp import MTPProposer
        return _with_lookup(MTPProposer.from_target(model, max_seq_len=settings.max_seq_len), settings)
    raise ConfigError(f"drafter {name!r} is not one of none, ngram, dflash, mtp")


def _with_lookup(proposer: Proposer, settings: Settings) -> Proposer:
    """The model drafter, behind an n-gram lookup when ``lookup_min_match`` is above 0 (edgespec.drafters.lookup;
    the default 3 sped up every bench prompt of the demo on a CPU and on an H200 but the JSON plan, which it left
    even: docs/benchmarks.md)."""
    if settings.lookup_min_match <= 0:
        return proposer
    from edgespec.drafters.lookup import LookupFirstProposer
    return LookupFirstProposer(proposer, min_match=settings.lookup_min_match, max_len=settings.max_seq_len + 64)
