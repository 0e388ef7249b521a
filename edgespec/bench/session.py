"""``edgespec bench session``: a stream of robot requests through one loaded model, AL and tok/s per drafter.

A per-prompt bench measures each request alone; a deployment serves a stream, and a drafter that learns from
earlier outputs (``suffix``) only shows its worth there. Every drafter gets its own engine on the same loaded
model (each its own cache); each request runs on every engine in turn, so machine load hits all columns alike,
and every answer is checked against plain decoding. The stream is generated (:func:`robot_stream`, robot
requests worded unlike the distillation workload) or replayed from a request log (its prompt ids).

Figures are split into the first ``--session-first`` requests (a fresh deployment: nothing learnt yet) and the
rest (steady state). AL = 1 + accepted / drafts over the requests; tok/s = generated tokens after the first of
each request over their decode time (the bench's usual decode speed, summed over requests).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgespec.bench.modes import COLUMNS, DRAFTERS, PEERS
from edgespec.bench.robot_stream import robot_stream
from edgespec.config import Settings
from edgespec.engine import Engine, Request
from edgespec.errors import ConfigError
from edgespec.plan import build_plan
from edgespec.speculative.telemetry import AcceptanceCounts, RequestTelemetry

CLIENT = "session-bench"      # one client: the whole stream shares one suffix-cache partition


@dataclass
class Column:
    """What one drafter's engine did over a range of requests."""

    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    tokens: int = 0          # generated tokens after each request's first
    decode_s: float = 0.0
    draft_ms: float = 0.0
    cycles: int = 0
    same: int = 0
    requests: int = 0

    def add(self, tel: RequestTelemetry, same: bool) -> None:
        self.counts.add_counts(tel)
        self.tokens += max(0, tel.generated_tokens - 1)
        self.decode_s += tel.decode_ms / 1000.0
        self.draft_ms += tel.stage_ms.get("draft", 0.0)
        self.cycles += tel.cycles
        self.same += int(same)
        self.requests += 1

    @property
    def tok_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self, plain_tok_s: float) -> dict[str, Any]:
        return {"al": round(self.counts.acceptance_length, 3), "tok_s": round(self.tok_s, 2),
                "x_plain": round(self.tok_s / plain_tok_s, 3) if plain_tok_s else None,
                "draft_ms_per_cycle": round(self.draft_ms / self.cycles, 4) if self.cycles else None,
                "same_as_plain": f"{self.same}/{self.requests}"}


def parse_drafters(spec: str) -> list[str]:
    """``plain`` first, then the named drafters in order; unknown names are an error naming them."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in COLUMNS]
    if bad or not names:
        raise ConfigError(f"--session-drafters {spec!r}: {', '.join(bad) or 'empty'} not among "
                          f"{', '.join(COLUMNS)}")
    return ["plain"] + list(dict.fromkeys(names))


def _peer_engine(settings: Settings, base: Engine, name: str) -> Engine | None:
    """The engine of peer ``name``: the engine of the drafter it stands beside, its proposer swapped for the peer's
    (same taps, K and draft sizing, so the session, its cache and verify stay as they are). None, after saying
    why, when the peer's library is not installed."""
    from edgespec.bench.peer_arctic import ArcticSuffixProposer, arctic_available

    reason = arctic_available()
    if reason is not None:
        print(f"session: no {name} column: {reason}")
        return None
    engine = Engine.around(build_plan(settings.with_overrides(**DRAFTERS[PEERS[name]]), base.device), base.model,
                           base.tokenizer, base.model_dir)
    peer = ArcticSuffixProposer(max_depth=engine.plan.drafter.suffix.max_depth)
    ours = engine.proposer
    if peer.taps != ours.taps or peer.sizes_drafts != ours.sizes_drafts or engine.session.k > peer.max_k:
        raise ConfigError(f"peer {name} cannot stand in for {ours.name}: taps, draft sizing or K differ")
    engine.proposer = engine.session.proposer = engine.suffix_cache = peer
    return engine


def session_requests(args: argparse.Namespace) -> list[Request]:
    """The stream: the request log's prompts, or ``--session-requests`` generated robot requests."""
    if args.session_log:
        from edgespec.distill.request_log import read_log
        out = [Request(prompt_ids=prompt, max_tokens=args.tokens, cache_key=CLIENT)
               for prompt, _ in read_log(args.session_log)]
        if not out:
            raise ConfigError(f"request log {args.session_log} holds no request to replay")
        return out
    if args.session_requests < 1:
        raise ConfigError(f"--session-requests {args.session_requests} must be >= 1")
    return [Request(messages=[{"role": "user", "content": text}], max_tokens=args.tokens, cache_key=CLIENT)
            for text in robot_stream(args.session_requests, args.session_seed)]


def _peer_lines(figures: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Each peer's AL beside the drafter it stands beside, per range of requests, printed and returned."""
    out: dict[str, Any] = {}
    for peer, ours in PEERS.items():
        if peer not in names or ours not in names:
            continue
        for label in ("first", "steady"):
            if label not in figures:
                continue
            a, b = figures[label][ours]["al"], figures[label][peer]["al"]
            ratio = a / b if b else None
            out[f"{ours}/{peer} {label}"] = {"ours": a, "peer": b, "ratio": None if ratio is None else round(ratio, 3)}
            print(f"{ours} vs {peer} ({label}): AL {a:.2f} vs {b:.2f}"
                  + ("" if ratio is None else f" = {ratio:.3f}x"))
    return out


def run_session(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    """Run the stream on every drafter's engine, print a row per request and the two summaries, return all."""
    names = parse_drafters(args.session_drafters)
    if args.session_first < 0:
        raise ConfigError(f"--session-first {args.session_first} must be >= 0")
    requests = session_requests(args)
    base = Engine.load(build_plan(settings.with_overrides(**DRAFTERS["plain"])))
    engines = {"plain": base}
    for name in names[1:]:
        if name in PEERS:
            peer = _peer_engine(settings, base, name)
            if peer is not None:
                engines[name] = peer
            continue
        engines[name] = Engine.around(build_plan(settings.with_overrides(**DRAFTERS[name]), base.device),
                                      base.model, base.tokenizer, base.model_dir)
    names = [n for n in names if n in engines]
    # Warm-up, untimed, under another client key: kernels and first-call costs out of the first request, and
    # nothing of it in the stream's suffix-cache partition.
    for engine in engines.values():
        engine.complete(Request(messages=[{"role": "user", "content": "Say OK."}], max_tokens=8,
                                cache_key="warm-up"))
    print(f"session: device={base.device} model={base.model_dir.name} requests={len(requests)} "
          f"tokens<={args.tokens} first={args.session_first} K="
          + ",".join(f"{n}:{e.session.k}" for n, e in engines.items() if n != "plain"))
    print(f"{'req':>3} {'tok':>4} " + " ".join(f"{n + ' AL tok/s':>22}" for n in names))
    first = {n: Column() for n in names}
    steady = {n: Column() for n in names}
    rows = []
    for i, req in enumerate(requests):
        row: dict[str, Any] = {"request": i}
        plain_ids = None
        cells = []
        for name in names:
            c = engines[name].complete(req)
            if plain_ids is None:
                plain_ids = c.token_ids
            same = c.token_ids == plain_ids
            tel = c.telemetry
            (first if i < args.session_first else steady)[name].add(tel, same)
            row[name] = {"al": round(tel.acceptance_length, 3), "tok_s": round(tel.decode_tok_s, 2),
                         "tokens": len(c.token_ids), "same_as_plain": same}
            cells.append(f"{tel.acceptance_length:>10.2f} {tel.decode_tok_s:>7.1f}{'' if same else ' DIFF':<4}")
        rows.append(row)
        print(f"{i:>3} {len(plain_ids):>4} " + " ".join(f"{cell:>22}" for cell in cells), flush=True)
    figures: dict[str, Any] = {"rows": rows}
    for label, cols in (("first", first), ("steady", steady)):
        if not cols["plain"].requests:
            continue
        plain = cols["plain"].tok_s
        figures[label] = {n: col.to_dict(plain) for n, col in cols.items()}
        print(f"{label} ({cols['plain'].requests} requests): "
              + "; ".join(f"{n} AL {d['al']:.2f} {d['tok_s']:.1f} tok/s ({d['x_plain']:.2f}x plain, "
                          f"draft {d['draft_ms_per_cycle'] or 0:.2f} ms/cycle, same {d['same_as_plain']})"
                          for n, d in figures[label].items()))
    figures["peers"] = _peer_lines(figures, names)
    figures["suffix"] = {}
    for name, engine in engines.items():
        cache = engine.suffix_cache
        prop = engine.proposer if name == "suffix" else getattr(engine.proposer, "lookup", None)
        if cache is None or prop is None:
            continue
        per = prop.propose_s / prop.proposals * 1e6 if prop.proposals else 0.0
        figures["suffix"][name] = {"us_per_proposal": round(per, 1), "proposals": prop.proposals,
                                   "cache_bytes": cache.nbytes(), "cached_outputs": len(cache)}
        print(f"{name}: {per:.1f} us per proposal over {prop.proposals}; cache {cache.nbytes() / 2**20:.2f} MiB "
              f"for {len(cache)} outputs (budget {cache.max_bytes / 2**20:.0f} MiB)")
    if getattr(args, "out", None):
        Path(args.out).write_text(json.dumps({"session": figures}, indent=2))
    return figures
