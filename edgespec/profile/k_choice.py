"""K for a mixture-of-experts target, from acceptance x measured verify cost (``edgespec profile``'s K group).

On a dense target a verify of K+1 rows costs about one decode step whatever K is, so the profiler just measures a
few K. On an MoE target every verify row routes to its own k experts: the union a verify reads grows with K (8
experts per layer at one row, tens at 16 on a 256-expert layer), and a longer draft can cost more than its extra
accepted tokens bring. So for an MoE target the K group first predicts each K's rate from what was measured:

* ``AL(K)`` from the current best run's per-position acceptance (a chain run at K_run accepts draft i only with all
  before it, and its first K drafts are those a run at K would make: ``AL(K) = 1 + sum_{i<K} accepted_i / drafts``,
  for K <= K_run);
* the verify cost of K+1 rows measured on the target (a served verify forward, graphs as configured, each timed
  alone), with the expert union its routing touched;
* the draft cost per cycle of that run (a block drafter's is one forward whatever K; a chain drafter's grows with K),
  and the rest of the cycle (acceptance, rollback, emit);

``rate(K) = AL(K) / (verify(K + 1) + draft(K) + other)`` per second, and only the best predicted K and its runner-up
are then measured end to end (lossless check included) against the current best.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from edgespec.errors import ConfigError

BLOCK_DRAFTERS = ("dflash",)        # one drafter forward per cycle, whatever K


@dataclass(frozen=True)
class KPrediction:
    """One K's predicted cycle: AL, verify ms of K+1 rows, its expert union per layer, draft and other ms."""

    k: int
    al: float
    verify_ms: float
    union: float
    draft_ms: float
    other_ms: float

    @property
    def cycle_ms(self) -> float:
        return self.verify_ms + self.draft_ms + self.other_ms

    @property
    def tok_s(self) -> float:
        return self.al / self.cycle_ms * 1e3


def pooled_counts(measurements: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-position accepted counts, drafts, cycles and stage milliseconds summed over the prompts of one
    candidate's measurements (their ``telemetry``)."""
    pos: list[int] = []
    out: dict[str, Any] = {"drafts": 0, "cycles": 0, "stage_ms": {}}
    for m in measurements:
        t = m["telemetry"]
        out["drafts"] += t["drafts"]
        out["cycles"] += t["cycles"]
        for i, a in enumerate(t["accepted_per_pos"]):
            pos.extend([0] * (i + 1 - len(pos)))
            pos[i] += a
        for stage, ms in t["stage_ms"].items():
            out["stage_ms"][stage] = out["stage_ms"].get(stage, 0.0) + ms
    out["accepted_per_pos"] = pos
    return out


def al_by_k(counts: Mapping[str, Any], k_run: int) -> dict[int, float]:
    """``{K: AL(K)}`` for K = 1..k_run from pooled chain-run counts (see the module doc)."""
    drafts = counts["drafts"]
    if not drafts:
        raise ConfigError("no drafts were made: the acceptance of shorter drafts cannot be read from this run")
    pos = list(counts["accepted_per_pos"]) + [0] * k_run
    return {k: 1.0 + sum(pos[:k]) / drafts for k in range(1, k_run + 1)}


def predict(counts: Mapping[str, Any], k_run: int, drafter: str, verify: Mapping[int, tuple[float, float]]
            ) -> list[KPrediction]:
    """Each K of ``verify`` (``{K: (verify ms of K+1 rows, expert union)}``, K <= k_run) predicted from a run at
    ``k_run``, best first."""
    cycles = counts["cycles"]
    if not cycles:
        raise ConfigError("the run has no verify cycles: nothing to predict from")
    stage = counts["stage_ms"]
    draft_cycle = stage.get("draft", 0.0) / cycles
    other = sum(ms for s, ms in stage.items() if s not in ("draft", "verify", "prefill")) / cycles
    al = al_by_k(counts, k_run)
    out = []
    for k, (verify_ms, union) in verify.items():
        if k > k_run:
            continue
        draft = draft_cycle if drafter in BLOCK_DRAFTERS else draft_cycle * k / k_run
        out.append(KPrediction(k, al[k], verify_ms, union, draft, other))
    return sorted(out, key=lambda p: -p.tok_s)


def measure_verify(engine, rows: int, context: int = 128, iters: int = 20) -> tuple[float, float]:
    """Milliseconds of one served verify forward of ``rows`` rows on ``engine`` (built with K = rows - 1, so its
    graph has that size) at ``context`` prompt tokens, rolled back after each, and the expert union per layer its
    routing touched (0.0 for a dense target)."""
    from edgespec.kernels import device_sync
    from edgespec.models.moe import attach_routing_log

    s = engine.session
    model, cache, hooks = s.model, s.cache, s.hooks
    log = attach_routing_log(model)
    gen = torch.Generator().manual_seed(rows)
    vocab = model.config.vocab_size
    cache.reset()
    hooks.prefill(model, cache, torch.randint(0, vocab, (context,), generator=gen).to(model.device),
                  s.prefill_chunk, s.taps)
    toks = torch.randint(0, vocab, (rows,), generator=gen).to(model.device)
    start = cache.length

    def step() -> None:
        hooks.verify(model, cache, toks, s.taps, s.rollback)
        s.rollback.rollback(model, cache, start, toks, 1, s.taps)
        cache.length = start

    step()                                      # warm-up (and graph replay on the device)
    if log is not None:
        log.clear()
    cuda = model.device.type == "cuda"
    device_sync() if cuda else None
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    device_sync() if cuda else None
    ms = (time.perf_counter() - t0) * 1e3 / iters
    union = log.mean_union(rows) if log is not None else 0.0
    cache.reset()
    return ms, union
