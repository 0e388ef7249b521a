"""Build the proposer named by the settings, checked against the target before any device work."""

from __future__ import annotations

from pathlib import Path

from edgespec.config import Settings
from edgespec.drafters.base import Proposer
from edgespec.drafters.ngram import NGramProposer
from edgespec.drafters.suffix import SuffixProposer
from edgespec.drafters.suffix_cache import SuffixCache
from edgespec.errors import ConfigError
from edgespec.models.decoder import TargetModel


def build_proposer(settings: Settings, model: TargetModel) -> Proposer | None:
    """``none`` -> None; ``ngram`` -> prompt lookup; ``suffix`` -> suffix tries over the request and earlier
    outputs; ``dflash`` / ``mtp`` -> model-based drafters."""
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
    if name == "suffix":
        return build_suffix(settings, model, min_match=1)
    if name == "dflash":
        from edgespec.drafters.dflash import load_dflash
        return _with_lookup(load_dflash(settings, model), settings, model)
    if name == "mtp":
        from edgespec.drafters.mtp import MTPProposer
        return _with_lookup(MTPProposer.from_target(model, max_seq_len=settings.max_seq_len), settings, model)
    raise ConfigError(f"drafter {name!r} is not one of none, ngram, suffix, dflash, mtp")


def _with_lookup(proposer: Proposer, settings: Settings, model: TargetModel) -> Proposer:
    """The model drafter, behind an n-gram lookup when ``lookup_min_match`` is above 0 (edgespec.drafters.lookup;
    the default 3 sped up every bench prompt of the demo on a CPU and on an H200 but the JSON plan, which it left
    even: docs/benchmarks.md)."""
    if settings.lookup_min_match <= 0:
        return proposer
    from edgespec.drafters.lookup import LookupFirstProposer
    lookup = None
    if settings.lookup_drafter == "suffix":
        lookup = build_suffix(settings, model, min_match=settings.lookup_min_match)
    return LookupFirstProposer(proposer, min_match=settings.lookup_min_match, max_len=settings.max_seq_len + 64,
                               lookup=lookup)


def build_suffix(settings: Settings, model: TargetModel, min_match: int) -> SuffixProposer:
    """The suffix drafter of the settings, its cache sized by ``suffix_cache_mb`` (and persisted next to the
    request log with ``suffix_persist``)."""
    if settings.suffix_persist and not settings.request_log:
        raise ConfigError("suffix_persist keeps the suffix cache next to the request log: set request_log too")
    path = None
    if settings.suffix_persist:
        log = Path(settings.request_log).expanduser()
        path = log.with_name(log.name + ".suffix.jsonl")
    max_match = min(settings.suffix_max_match, settings.suffix_max_depth - 1)
    cache = SuffixCache(int(settings.suffix_cache_mb * (1 << 20)), settings.suffix_max_depth,
                        model.config.vocab_size, path)
    return SuffixProposer(cache, max_depth=settings.suffix_max_depth, max_match=max(max_match, min_match),
                          min_match=min_match, factor=settings.suffix_factor, min_prob=settings.suffix_min_prob)
