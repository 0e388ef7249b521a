"""A frequency-ranked draft vocabulary (FR-Spec): the drafter's head scores only the N most frequent token ids.

On a CPU the draft head costs per head row and draft row: the demo drafter's 15 draft rows over the 49k-token head
cost more than a target decode step. Drafted tokens are nearly always frequent ones, so scoring only the N most
frequent ids (8k-16k) keeps almost every proposal while the head reads and multiplies a fraction of its rows.
Speculation stays lossless: the target verifies every draft; only which drafts it is asked to verify can change
(a token outside the subset is never proposed).

The ranking ships with the drafter as ``draft_vocab.json`` beside ``config.json``::

    {"source": "<how the ranking was made>", "ids": [most frequent id, next, ...]}

``edgespec distill`` writes it from the token counts of its training sequences (:func:`rank_by_counts`). Ids the
file does not rank come after the ranked ones in id order (a BPE vocabulary numbers its merges roughly by
frequency), so any N up to the vocabulary size is served.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from edgespec.errors import CheckpointError, ConfigError

VOCAB_FILE = "draft_vocab.json"


def rank_by_counts(token_lists: Iterable[Iterable[int]], source: str) -> dict[str, Any]:
    """The ``draft_vocab.json`` content for ``token_lists``: every id seen, most frequent first (ties: lower id
    first, so the ranking does not depend on the order the lists come in)."""
    counts: Counter[int] = Counter()
    for tokens in token_lists:
        counts.update(int(t) for t in tokens)
    ids = sorted(counts, key=lambda t: (-counts[t], t))
    return {"source": source, "tokens_counted": sum(counts.values()), "ids": ids}


def write_draft_vocab(folder: Path, content: dict[str, Any]) -> Path:
    """Write ``content`` (see :func:`rank_by_counts`) as ``folder/draft_vocab.json``."""
    path = Path(folder) / VOCAB_FILE
    path.write_text(json.dumps(content, separators=(",", ":")))
    return path


def load_draft_ids(folder: str | Path, n: int, vocab: int) -> torch.Tensor:
    """The ``n`` most frequent token ids ``[n]`` int64 of the drafter in ``folder`` (its ``draft_vocab.json``;
    ids the file leaves out follow in id order), for a head of ``vocab`` rows.

    Raises :class:`ConfigError` for an ``n`` outside ``1 .. vocab`` and :class:`CheckpointError`, naming the file,
    for a missing or unreadable file, a missing ``ids`` list, entries that are not integers, out-of-range ids and
    repeated ids.
    """
    if not 0 < n <= vocab:
        raise ConfigError(f"draft_vocab {n}: give a number of token ids from 1 to the head's {vocab} (0: the full "
                          "head)")
    path = Path(folder) / VOCAB_FILE
    if not path.is_file():
        raise CheckpointError(f"draft_vocab {n} needs the drafter's token ranking {path}, which is missing "
                              "(edgespec distill writes it; set draft_vocab 0 for the full head)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    ids = raw.get("ids") if isinstance(raw, dict) else None
    if not isinstance(ids, list) or not ids:
        raise CheckpointError(f"{path}: needs a non-empty list 'ids' of token ids, most frequent first")
    bad = [x for x in ids if not isinstance(x, int) or isinstance(x, bool)]
    if bad:
        raise CheckpointError(f"{path}: 'ids' holds {len(bad)} entries that are not integers, e.g. {bad[0]!r}")
    outside = [x for x in ids if not 0 <= x < vocab]
    if outside:
        raise CheckpointError(f"{path}: token ids {outside[:5]} are outside the head's vocabulary 0..{vocab - 1} "
                              "(a ranking made for another tokenizer?)")
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        repeated = next(x for x in ids if x in seen or seen.add(x))
        raise CheckpointError(f"{path}: token id {repeated} is ranked more than once")
    ranked = torch.tensor(ids[:n], dtype=torch.long)
    if len(ranked) < n:     # the unranked ids, in id order
        rest = torch.ones(vocab, dtype=torch.bool)
        rest[ranked] = False
        ranked = torch.cat([ranked, rest.nonzero().flatten()[:n - len(ranked)]])
    return ranked


__all__ = ["VOCAB_FILE", "load_draft_ids", "rank_by_counts", "write_draft_vocab"]
