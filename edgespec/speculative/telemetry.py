"""Acceptance and timing telemetry: counted once, published by separate sinks.

Counting. :class:`AcceptanceCounts` is the one place that counts verify cycles and accepted drafts (per request
in :class:`RequestTelemetry`, summed over requests in :class:`CumulativeTelemetry`). The formulas follow vLLM:

- ``drafts``: verify cycles that carried at least one draft token (plain decode steps are not drafts);
- acceptance length = ``1 + accepted_tokens / drafts`` (it counts the bonus token; 1.0 with no drafts);
- acceptance rate = ``accepted_tokens / draft_tokens``;
- per-position rate ``i`` = ``accepted_per_pos[i] / drafts`` (draft ``i`` accepted, 0-based);
- decode tok/s = ``(generated_tokens - 1) / decode time`` (the first token comes out of prefill).

Draft trees add their own counts: tree verifies, their nodes and sibling accepts, and per node class (on the chain
of first choices or beside it, by depth) the candidate nodes of known fate, their summed joint draft probability,
the right ones, the verified ones and the accepted ones (:mod:`edgespec.speculative.tree_stats`): right / joint is
the drafter's calibration, and right nodes that were not verified are what a wider tree would have added.

Publishing. The sinks only read the counts: :func:`log_summary` (one log line), :func:`telemetry_dict` (the JSON
of ``edgespec generate --json`` and of the profiler), and the server's Prometheus counters
(``edgespec.serving.metrics.ServerMetrics.observe``), where the same formulas read, in PromQL,
``1 + rate(edgespec:spec_decode_num_accepted_tokens_total[5m]) / rate(edgespec:spec_decode_num_drafts_total[5m])``
and ``rate(edgespec:spec_decode_num_accepted_tokens_per_pos_total{position="i"}[5m]) /
rate(edgespec:spec_decode_num_drafts_total[5m])``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from edgespec.speculative.tree_stats import NodeStats

STAGES = ("prefill", "draft", "verify", "accept", "other")


@dataclass
class AcceptanceCounts:
    """Draft and acceptance counters; the formulas over them are in the module docstring."""

    drafts: int = 0                  # cycles that verified at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # [i]: cycles whose draft i was accepted

    def record(self, n_drafted: int, n_accepted: int) -> None:
        """Count one verify cycle of ``n_drafted`` drafts of which the first ``n_accepted`` were accepted."""
        if n_drafted == 0:
            return
        self.drafts += 1
        self.draft_tokens += n_drafted
        self.accepted_tokens += n_accepted
        self._grow(n_drafted)
        for i in range(n_accepted):
            self.accepted_per_pos[i] += 1

    def add_counts(self, other: AcceptanceCounts) -> None:
        """Add another set of counts (a finished request) to these."""
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self._grow(len(other.accepted_per_pos))
        for i, a in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += a

    def _grow(self, n: int) -> None:
        if len(self.accepted_per_pos) < n:
            self.accepted_per_pos.extend([0] * (n - len(self.accepted_per_pos)))

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def per_position_rate(self) -> list[float]:
        return [a / self.drafts for a in self.accepted_per_pos] if self.drafts else []


@dataclass
class RequestTelemetry(AcceptanceCounts):
    """Counters and stage times of one request.

    ``sync`` (``stage_timing: device``): called before and after every stage, so each stage is timed whole.
    Device work is asynchronous: without a sync a stage's time is its launch time and the one host sync of the
    cycle absorbs the rest (profiling only: the extra syncs cost a few microseconds each).
    """

    drafter: str = "none"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cycles: int = 0                  # target forwards after prefill (verify cycles + plain decode steps)
    stage_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    decode_ms: float = 0.0           # wall time from the first token to the last
    # Tree verification (draft_tree): verifies of a tree, its nodes, and cycles whose accepted path took a child that
    # was not its parent's first choice (a chain of first choices would have lost it). Their draft_tokens are nodes.
    tree_cycles: int = 0
    tree_nodes: int = 0
    tree_sibling_accepts: int = 0
    # What became of every candidate tree node, by class (chain or side, depth): edgespec.speculative.tree_stats.
    node_stats: NodeStats = field(default_factory=NodeStats)
    sync: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    # MoE targets: rows of a decode/verify forward -> mean distinct experts it read per layer (its weight bytes)
    expert_union: dict[int, float] = field(default_factory=dict)
    # Prompts with images (edgespec.models.multimodal.VisionStats): images, their rows, and how many the tower
    # encoded, the encoder cache held or the prefix cache held already; the tower's time is stage ``vision``.
    vision: dict[str, Any] | None = None

    @property
    def decode_tok_s(self) -> float:
        n = self.generated_tokens - 1
        return n / (self.decode_ms / 1000.0) if n > 0 and self.decode_ms > 0 else 0.0

    def record_cycle(self, n_drafted: int, n_accepted: int) -> None:
        """Count one target forward after prefill (``n_drafted == 0``: a plain decode step)."""
        self.cycles += 1
        self.record(n_drafted, n_accepted)

    def record_tree(self, nodes: int, sibling: bool) -> None:
        """Count one tree verify of ``nodes`` nodes (besides :meth:`record_cycle` with its accepted depth)."""
        self.tree_cycles += 1
        self.tree_nodes += nodes
        self.tree_sibling_accepts += int(sibling)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Add the wall time of the ``with`` body to stage ``name``."""
        if self.sync is not None:
            self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self.stage_ms[name] = self.stage_ms.get(name, 0.0) + (time.perf_counter() - t0) * 1000.0

    def to_dict(self) -> dict[str, Any]:
        return telemetry_dict(self)

    def summary(self) -> str:
        return log_summary(self)


@dataclass
class CumulativeTelemetry(AcceptanceCounts):
    """Totals over every request served."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0

    def add(self, r: RequestTelemetry) -> None:
        self.requests += 1
        self.prompt_tokens += r.prompt_tokens
        self.generated_tokens += r.generated_tokens
        self.add_counts(r)


# -- sinks ----------------------------------------------------------------------------------------------------------

def telemetry_dict(t: RequestTelemetry) -> dict[str, Any]:
    """One request's counts and derived rates as plain JSON values (rates rounded)."""
    tree = {} if not (t.tree_cycles or t.node_stats.cycles) else {
        "tree_cycles": t.tree_cycles, "tree_nodes": t.tree_nodes, "tree_sibling_accepts": t.tree_sibling_accepts,
        "tree_candidate_cycles": t.node_stats.cycles, "tree_node_stats": t.node_stats.to_dict()}
    return tree | {
        "drafter": t.drafter, "prompt_tokens": t.prompt_tokens, "generated_tokens": t.generated_tokens,
        "cycles": t.cycles, "drafts": t.drafts, "draft_tokens": t.draft_tokens,
        "accepted_tokens": t.accepted_tokens, "accepted_per_pos": list(t.accepted_per_pos),
        "stage_ms": {k: round(v, 3) for k, v in t.stage_ms.items()}, "decode_ms": t.decode_ms,
        "acceptance_length": round(t.acceptance_length, 4), "acceptance_rate": round(t.acceptance_rate, 4),
        "per_position_rate": [round(x, 4) for x in t.per_position_rate], "decode_tok_s": round(t.decode_tok_s, 2),
        **({"expert_union": {str(r): u for r, u in t.expert_union.items()}} if t.expert_union else {}),
        **({"vision": dict(t.vision)} if t.vision else {}),
    }


def log_summary(t: RequestTelemetry) -> str:
    """One request as one log line."""
    s = t.stage_ms
    tree = (f"tree_nodes/cycle={t.tree_nodes / t.tree_cycles:.1f} sibling_accepts={t.tree_sibling_accepts} "
            if t.tree_cycles else "")
    return tree + (f"drafter={t.drafter} tokens={t.generated_tokens} cycles={t.cycles} "
            f"AL={t.acceptance_length:.2f} accept={t.acceptance_rate:.0%} "
            f"decode={t.decode_tok_s:.1f} tok/s prefill={s['prefill']:.0f}ms draft={s['draft']:.0f}ms "
            f"verify={s['verify']:.0f}ms accept={s['accept']:.0f}ms other={s['other']:.0f}ms"
            + "".join(f" experts@{r}={u:.1f}" for r, u in t.expert_union.items())
            + (f" images={t.vision['images']} encoded={t.vision['encoded']} "
               f"vision={s.get('vision', 0.0):.0f}ms" if t.vision else ""))
