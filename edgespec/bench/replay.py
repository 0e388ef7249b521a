"""Replay a stream's greedy outputs through a token-id drafter, without the model: exact AL, and what was proposed.

Under greedy verification the output is the plain output whatever the drafter proposes (the lossless tests check
it), so a cycle's verdict is the longest prefix of the draft that equals the next plain tokens, plus one token.
Replaying a recorded stream (prompt ids, plain output ids) through a drafter that drafts from token ids alone
(``ngram``, ``suffix``) thus gives the AL the engine would measure, in milliseconds instead of minutes, with every
proposal and its accepted length on record: the way to study a drafter and tune it (on a stream other than the
one the figures are measured on). :func:`collect` records a stream with the plain engine; :func:`replay` runs a
proposer over it the way :class:`~edgespec.speculative.session.SpecSession` drives one (begin, the first token
committed, propose, commit, the adaptive draft length) and the engine feeds the suffix cache (the output after
each request).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from edgespec.drafters.base import Proposer
from edgespec.errors import ConfigError
from edgespec.speculative.session import DraftLength, adapts


@dataclass
class Recorded:
    """One request of a recorded stream: its prompt ids, its plain output ids and the stop id that ended it (None
    when it ended on ``max_tokens``)."""

    prompt: list[int]
    output: list[int]
    stop: int | None
    max_tokens: int


@dataclass
class Cycle:
    """One replayed verify: where it started in the output, what was drafted, how many drafts were accepted."""

    pos: int
    draft: list[int]
    accepted: int


@dataclass
class Replayed:
    """A replayed request: its cycles (plain steps included, with an empty draft)."""

    cycles: list[Cycle] = field(default_factory=list)

    @property
    def drafts(self) -> int:
        return sum(1 for c in self.cycles if c.draft)

    @property
    def accepted(self) -> int:
        return sum(c.accepted for c in self.cycles)

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafting cycles, as the engine's telemetry counts it."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0


def verdict(draft: Sequence[int], truth: Sequence[int]) -> int:
    """Drafts accepted by greedy verification: the length of the longest common prefix.

    >>> verdict([5, 6, 9], [5, 6, 7, 8]), verdict([], [1]), verdict([1, 2], [1, 2])
    (2, 0, 2)
    """
    n = 0
    for d, t in zip(draft, truth, strict=False):
        if d != t:
            break
        n += 1
    return n


def replay_one(proposer: Proposer, req: Recorded, k: int, adaptive: bool) -> Replayed:
    """One request through ``proposer`` as the speculative session runs it (``adaptive``: the session's
    adaptive draft length, unless the proposer sizes its drafts itself)."""
    seq = req.output + ([req.stop] if req.stop is not None else [])
    out = Replayed()
    if not seq:
        return out
    proposer.begin(req.prompt, None)
    proposer.commit([seq[0]], 0, None)
    length = DraftLength(k, adapts(proposer, adaptive))
    pos = 1
    while pos < len(seq):
        room = min(length.k, req.max_tokens - pos - 1)
        draft: list[int] = []
        if room > 0:
            d = proposer.propose(seq[pos - 1], room)
            draft = [] if d is None else [int(t) for t in d.tokens[:room].tolist()]
        a = verdict(draft, seq[pos:])
        out.cycles.append(Cycle(pos, draft, a))
        length.update(len(draft), a)
        proposer.commit(seq[pos:pos + a + 1], a, None, len(draft))
        pos += a + 1
    return out


def replay(proposer: Proposer, stream: Sequence[Recorded], k: int, adaptive: bool,
           client: str = "replay") -> list[Replayed]:
    """Every request in order; a suffix drafter's cache learns each output after its request, as the engine's."""
    cache = getattr(proposer, "suffix_cache", None)
    results = []
    for req in stream:
        if cache is not None:
            cache.select(client)
        results.append(replay_one(proposer, req, k, adaptive))
        if cache is not None:
            cache.add_completion(req.prompt, req.output)
    return results


def summary(results: Sequence[Replayed]) -> float:
    """AL over several requests (accepted over drafting cycles, summed)."""
    drafts = sum(r.drafts for r in results)
    return 1.0 + sum(r.accepted for r in results) / drafts if drafts else 1.0


def save_stream(path: str | Path, stream: Sequence[Recorded], meta: dict) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "requests": [vars(r) for r in stream]}))


def load_stream(path: str | Path) -> list[Recorded]:
    """A stream :func:`save_stream` wrote (what :func:`collect` records)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recorded stream not found: {p}")
    try:
        data = json.loads(p.read_text())
        return [Recorded(list(r["prompt"]), list(r["output"]), r["stop"], int(r["max_tokens"]))
                for r in data["requests"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"{p} is not a recorded stream (prompt/output/stop/max_tokens per request): {e}") from None


def token_proposer(settings, vocab_size: int) -> tuple[Proposer, int]:
    """The ``ngram`` or ``suffix`` proposer ``settings`` describe, built as the engine's factory builds it (its own
    empty suffix cache), and its drafts per cycle (``num_draft_tokens`` or the drafter's default)."""
    from edgespec.drafters.ngram import NGramProposer
    from edgespec.drafters.suffix import SuffixProposer
    from edgespec.drafters.suffix_cache import SuffixCache

    s = settings
    proposer: Proposer
    if s.drafter == "ngram":
        proposer = NGramProposer(max_match=s.ngram_max_match, min_match=s.ngram_min_match, lookback=s.ngram_lookback,
                                 gate=s.ngram_gate, max_len=1 << 16)
    elif s.drafter == "suffix":
        cache = SuffixCache(int(s.suffix_cache_mb * (1 << 20)), s.suffix_max_depth, vocab_size)
        proposer = SuffixProposer(cache, max_depth=s.suffix_max_depth,
                                  max_match=min(s.suffix_max_match, s.suffix_max_depth - 1), min_match=1,
                                  factor=s.suffix_factor, min_prob=s.suffix_min_prob)
    else:
        raise ConfigError(f"replay drafts from token ids alone: ngram or suffix, not {s.drafter!r}")
    return proposer, s.num_draft_tokens or type(proposer).default_k


def collect(engine, texts: Sequence[str], max_tokens: int) -> list[Recorded]:
    """The plain engine's greedy outputs of ``texts`` (one user message each). A request that stopped records the
    tokenizer's first stop id as its last token (the completion drops the stop token; targets with several stop
    ids may have ended on another, which only the replay's final cycle would see)."""
    from edgespec.engine import Request

    stream = []
    for text in texts:
        req = Request(messages=[{"role": "user", "content": text}], max_tokens=max_tokens, cache_key="replay")
        prompt = engine.prompt_ids(req)
        c = engine.complete(req)
        stop = engine.tokenizer.stop_token_ids[0] if c.finish_reason == "stop" else None
        stream.append(Recorded(prompt, list(c.token_ids), stop, max_tokens))
    return stream
