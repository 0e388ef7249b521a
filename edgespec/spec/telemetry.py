"""Acceptance and timing telemetry, per request and cumulative, as plain objects the server and profiler read.

Acceptance length follows vLLM: ``1 + accepted / drafts`` where ``drafts`` counts verify cycles that carried at
least one draft token; it includes the bonus token. Per-position rate ``i`` = accepted_per_pos[i] / drafts.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

STAGES = ("prefill", "draft", "verify", "accept", "other")


@dataclass
class RequestTelemetry:
    """Counters and stage times of one request."""

    drafter: str = "none"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cycles: int = 0                  # target forwards after prefill (verify cycles + plain decode steps)
    drafts: int = 0                  # cycles that verified at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    stage_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    decode_ms: float = 0.0           # wall time from the first token to the last

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def per_position_rate(self) -> list[float]:
        return [a / self.drafts for a in self.accepted_per_pos] if self.drafts else []

    @property
    def decode_tok_s(self) -> float:
        # The first token comes out of prefill; decode speed counts the tokens produced after it.
        n = self.generated_tokens - 1
        return n / (self.decode_ms / 1000.0) if n > 0 and self.decode_ms > 0 else 0.0

    def record_cycle(self, n_drafted: int, n_accepted: int) -> None:
        self.cycles += 1
        if n_drafted == 0:
            return
        self.drafts += 1
        self.draft_tokens += n_drafted
        self.accepted_tokens += n_accepted
        if len(self.accepted_per_pos) < n_drafted:
            self.accepted_per_pos.extend([0] * (n_drafted - len(self.accepted_per_pos)))
        for i in range(n_accepted):
            self.accepted_per_pos[i] += 1

    @contextmanager
    def stage(self, name: str):
        # Device work is asynchronous: without a sync a stage's time is its launch time and the one host sync of
        # the cycle absorbs the rest. ``stage_timing: device`` sets ``_sync`` so each stage is timed whole
        # (profiling only: the extra syncs cost a few microseconds each).
        sync = getattr(self, "_sync", None)
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if sync is not None:
                sync()
            self.stage_ms[name] += (time.perf_counter() - t0) * 1000.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(acceptance_length=round(self.acceptance_length, 4), acceptance_rate=round(self.acceptance_rate, 4),
                 per_position_rate=[round(x, 4) for x in self.per_position_rate],
                 decode_tok_s=round(self.decode_tok_s, 2))
        d["stage_ms"] = {k: round(v, 3) for k, v in self.stage_ms.items()}
        return d

    def summary(self) -> str:
        s = self.stage_ms
        return (f"drafter={self.drafter} tokens={self.generated_tokens} cycles={self.cycles} "
                f"AL={self.acceptance_length:.2f} accept={self.acceptance_rate:.0%} "
                f"decode={self.decode_tok_s:.1f} tok/s prefill={s['prefill']:.0f}ms draft={s['draft']:.0f}ms "
                f"verify={s['verify']:.0f}ms accept={s['accept']:.0f}ms other={s['other']:.0f}ms")


@dataclass
class CumulativeTelemetry:
    """Totals over every request served (the /metrics counters read this)."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, r: RequestTelemetry) -> None:
        self.requests += 1
        self.prompt_tokens += r.prompt_tokens
        self.generated_tokens += r.generated_tokens
        self.drafts += r.drafts
        self.draft_tokens += r.draft_tokens
        self.accepted_tokens += r.accepted_tokens
        if len(self.accepted_per_pos) < len(r.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (len(r.accepted_per_pos) - len(self.accepted_per_pos)))
        for i, a in enumerate(r.accepted_per_pos):
            self.accepted_per_pos[i] += a

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0
