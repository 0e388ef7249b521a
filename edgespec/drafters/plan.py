"""Which proposer to build and with what, resolved from the settings and the arch defaults (``edgespec.plan``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NGramKnobs:
    """The n-gram proposer's matching knobs (``ngram_*`` settings)."""

    max_match: int = 4
    min_match: int = 1
    lookback: int = 4096
    gate: float = 0.1


@dataclass(frozen=True)
class SuffixKnobs:
    """The suffix drafter's knobs (``suffix_*`` settings) and the file its cache persists in (None: memory only)."""

    cache_mb: float = 16.0
    max_depth: int = 24
    max_match: int = 12
    factor: float = 0.5
    min_prob: float = 0.5
    persist_path: Path | None = None


@dataclass(frozen=True)
class DrafterPlan:
    """The drafter ``edgespec.drafters.factory.build_proposer`` builds: its name and every knob it takes, with the
    arch defaults already applied (window size and seeding, CUDA graphs)."""

    name: str                          # none | ngram | suffix | dflash | mtp
    max_seq_len: int                   # the target's cache length: sizes the drafters' histories
    num_draft_tokens: int | None       # drafts per cycle asked for; None: the drafter's own default
    dflash_path: str | None = None     # DFlash checkpoint folder (drafter_path, or the packaged demo drafter)
    dflash_packaged: bool = False      # the packaged demo drafter, served because the model is the demo
    weights: str = "model"             # the DFlash drafter's weight format (drafter_weights)
    dflash_selector: bool = True       # a DFlash2 drafter drafts its selector's path (dflash_selector)
    draft_vocab: int = 0               # a DFlash drafter scores its N most frequent token ids (0: the full head)
    window_size: int = 128
    window_seed: bool = True
    cuda_graphs: bool = False
    ngram: NGramKnobs = NGramKnobs()
    lookup_min_match: int = 3          # dflash/mtp behind a lookup from this match length (0: none)
    lookup_drafter: str = "ngram"      # that lookup: ngram (this request) or suffix (also earlier outputs)
    suffix: SuffixKnobs = SuffixKnobs()
