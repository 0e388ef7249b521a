"""Coordinate-descent search over the profiler's knob groups, within a time budget, resumable.

The full product of the knobs (4 drafters x 5 K x 6 window x 5 relaxed x 2 KV x 2 rollback x 2 graphs x 4 chunk)
is thousands of candidates; on the device each costs (prompts x repeats) generations. The knobs are nearly
independent once the drafter is fixed, so the search varies one group at a time from the arch defaults and keeps
the best value of each group before moving to the next (drafter first: every later group depends on it).
A challenger must beat the current best by ``min_gain`` to replace it: timing noise alone must not flip a knob.

Greedy output is checked against plain decoding on every prompt: a strict candidate whose output differs is
disqualified (a bug or a numerics problem on this device, never a speed-up); relaxed-thinking candidates are
marked lossy and only measured with ``--allow-lossy``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from edgespec.errors import EdgespecError
from edgespec.profile.measure import Bench, PromptCase, first_diff
from edgespec.profile.results import ResultStore, measurement_key, reference_key
from edgespec.profile.space import (
    GROUPS,
    Candidate,
    SpaceContext,
    candidate_key,
    candidate_label,
    describe,
    is_lossy,
    start_candidate,
)
from edgespec.progress import Progress
from edgespec.speculative.parity import TIE_REGRET, divergence_regret

OBJECTIVES = ("decode", "e2e")


@dataclass
class ProfileOptions:
    """How much to measure and how to judge it (the command-line flags of ``edgespec profile``)."""

    tokens: int = 128                 # max new tokens per generation
    repeats: int = 3                  # timed generations per (candidate, prompt); medians are kept
    warmup: int = 1                   # untimed generations per candidate before its first measurement
    objective: str = "decode"         # decode: decode tok/s; e2e: tokens / (prefill + decode) time
    min_gain: float = 0.02            # relative improvement a challenger needs to replace the current best
    allow_lossy: bool = False
    groups: list[str] = field(default_factory=lambda: list(GROUPS))
    values: dict[str, list[Any]] = field(default_factory=dict)
    budget_s: float | None = 600.0    # None = no limit


@dataclass
class CandidateResult:
    """A candidate and its measurements (one per prompt, in prompt order), with its verdict."""

    candidate: Candidate
    label: str
    group: str                        # the group that proposed it first ("start" for the starting point)
    status: str = "pending"           # ok | disqualified | skipped | failed | incomplete
    note: str | None = None
    measurements: list[dict[str, Any]] = field(default_factory=list)

    @property
    def key(self) -> str:
        return candidate_key(self.candidate)

    @property
    def lossy(self) -> bool:
        return is_lossy(self.candidate)

    @property
    def decode_tok_s(self) -> float:
        """Decode tokens over decode time, pooled over the prompts (a prompt that stops early weighs less)."""
        n = sum(max(m["generated_tokens"] - 1, 0) for m in self.measurements)
        s = sum(m["decode_ms"] for m in self.measurements) / 1000.0
        return n / s if s > 0 else 0.0

    @property
    def e2e_tok_s(self) -> float:
        n = sum(m["generated_tokens"] for m in self.measurements)
        s = sum(m["ttft_ms"] + m["decode_ms"] for m in self.measurements) / 1000.0
        return n / s if s > 0 else 0.0

    @property
    def acceptance_length(self) -> float:
        ms = self.measurements
        return sum(m["acceptance_length"] for m in ms) / len(ms) if ms else 0.0

    @property
    def ttft_ms(self) -> float:
        ms = self.measurements
        return sum(m["ttft_ms"] for m in ms) / len(ms) if ms else 0.0

    @property
    def peak_memory_bytes(self) -> int:
        return max((m["peak_memory_bytes"] for m in self.measurements), default=0)

    @property
    def same_as_plain(self) -> bool:
        return all(m["same_as_plain"] for m in self.measurements)

    def score(self, objective: str) -> float:
        return self.e2e_tok_s if objective == "e2e" else self.decode_tok_s

    def summary(self, objective: str) -> dict[str, Any]:
        return {"label": self.label, "group": self.group, "status": self.status, "note": self.note,
                "lossy": self.lossy, "candidate": self.candidate, "settings": describe(self.candidate),
                "score": round(self.score(objective), 3), "decode_tok_s": round(self.decode_tok_s, 3),
                "e2e_tok_s": round(self.e2e_tok_s, 3), "acceptance_length": round(self.acceptance_length, 4),
                "ttft_ms": round(self.ttft_ms, 3), "peak_memory_bytes": self.peak_memory_bytes,
                "same_as_plain": self.same_as_plain if self.measurements else None,
                "prompts_measured": len(self.measurements)}


@dataclass
class GroupStep:
    """One group of the search: what it tried and what it kept."""

    group: str
    note: str | None = None
    tried: list[str] = field(default_factory=list)      # candidate keys
    winner: str | None = None                          # candidate key kept after the group


@dataclass
class SearchOutcome:
    """Everything the report needs."""

    start: Candidate
    final: CandidateResult | None
    results: list[CandidateResult]
    steps: list[GroupStep]
    status: str                                        # complete | budget | interrupted
    stop_note: str | None
    notes: list[str]


def choose(results: Sequence[CandidateResult], incumbent: CandidateResult, metric: str, objective: str,
           min_gain: float) -> CandidateResult:
    """The group's winner: the best eligible result if it beats the incumbent by ``min_gain``."""
    eligible = [r for r in results if r.status == "ok"]
    if not eligible:
        return incumbent
    if metric == "ttft":
        best = min(eligible, key=lambda r: r.ttft_ms)
        if incumbent.status != "ok":
            return best
        return best if best.ttft_ms < incumbent.ttft_ms * (1.0 - min_gain) else incumbent
    best = max(eligible, key=lambda r: r.score(objective))
    if incumbent.status != "ok":
        return best
    return best if best.score(objective) > incumbent.score(objective) * (1.0 + min_gain) else incumbent


class Profiler:
    """Runs the search: ``run()`` measures, appending each measurement to the store as it goes."""

    def __init__(self, bench: Bench, cases: Sequence[PromptCase], store: ResultStore, options: ProfileOptions,
                 progress: Progress | None = None, started: float | None = None) -> None:
        self.bench, self.cases, self.store, self.opt = bench, list(cases), store, options
        self.started = time.monotonic() if started is None else started
        self.progress = progress or Progress(0, options.budget_s, started=self.started)
        self.start = start_candidate(bench.base, bench.defaults)
        self.current = self.start
        self.results: dict[str, CandidateResult] = {}
        self.steps: list[GroupStep] = []
        self.notes: list[str] = []
        self.exhausted = False
        self.k_predicted: tuple[int, ...] | None = None      # MoE targets: set before the K group
        self.status = "running"
        self.stop_note: str | None = None

    # -- budget and context --------------------------------------------------------------------------------------
    def out_of_budget(self) -> bool:
        if self.opt.budget_s is not None and time.monotonic() - self.started >= self.opt.budget_s:
            self.exhausted = True
        return self.exhausted

    def context(self) -> SpaceContext:
        cur = self.results.get(candidate_key(self.current))
        resolved_k = cur.measurements[0]["resolved"]["k"] if cur and cur.measurements else None
        return SpaceContext(device_type=self.bench.device.type, allow_lossy=self.opt.allow_lossy,
                            has_state=self.bench.has_state, thinking_prompts=any(c.thinking for c in self.cases),
                            longest_prompt=max(len(c.ids) for c in self.cases), values=self.opt.values,
                            resolved_k=resolved_k, k_predicted=self.k_predicted)

    def _refresh_total(self, groups: Sequence[str]) -> None:
        """Estimate the measurements left: the remaining groups planned from the current best."""
        ctx = self.context()
        todo = {} if candidate_key(self.start) in self.results else {candidate_key(self.start): 1}
        for name in groups:
            for c in GROUPS[name].plan(self.current, ctx).candidates:
                if candidate_key(c) not in self.results:
                    todo[candidate_key(c)] = 1
        self.progress.set_total(self.progress.done + len(todo) * len(self.cases))

    # -- search --------------------------------------------------------------------------------------------------
    def run(self) -> SearchOutcome:
        """Search every selected group (or until the budget is spent). KeyboardInterrupt propagates: every
        finished measurement is already in the results file, and :meth:`outcome` reports the partial state."""
        groups = self.opt.groups
        self._refresh_total(groups)
        self.evaluate(self.start, "start")
        self.status = "complete"
        for i, name in enumerate(groups):
            if self.out_of_budget():
                self.status, self.stop_note = "budget", f"time budget spent before group {name!r}"
                break
            group = GROUPS[name]
            if name == "k":
                self.predict_moe_k()
            plan = group.plan(self.current, self.context())
            step = GroupStep(name, plan.note)
            self.steps.append(step)
            if plan.note:
                self.progress.message(f"[{name}] {plan.note}")
            self._refresh_total(groups[i:])
            tried = []
            for cand in plan.candidates:
                tried.append(self.evaluate(cand, name))
                step.tried.append(candidate_key(cand))
                if self.exhausted:
                    break
            incumbent = self.results[candidate_key(self.current)]
            winner = choose(tried, incumbent, group.metric, self.opt.objective, self.opt.min_gain)
            self.current = winner.candidate
            step.winner = winner.key
            if self.exhausted:
                self.status, self.stop_note = "budget", f"time budget spent during group {name!r}"
                break
        return self.outcome()

    def outcome(self, status: str | None = None) -> SearchOutcome:
        """The search so far (also after an interruption)."""
        if status is not None:
            self.status = status
        for r in self.results.values():
            if r.status == "pending":        # interrupted mid-candidate
                r.status = "incomplete"
        final = self.results.get(candidate_key(self.current))
        if final is None or final.status != "ok":
            # The current best never measured cleanly (e.g. the base config's drafter cannot be built here):
            # fall back to the best candidate that did.
            ok = [r for r in self.results.values() if r.status == "ok"]
            final = max(ok, key=lambda r: r.score(self.opt.objective)) if ok else None
        return SearchOutcome(self.start, final, list(self.results.values()), self.steps, self.status,
                             self.stop_note, self.notes)

    def predict_moe_k(self) -> None:
        """MoE target: predict each K's rate from the current best run's acceptance and the verify cost of K+1
        rows measured on the target (:mod:`edgespec.profile.k_choice`); the K group then measures the best two.
        Dense targets, no drafter or no clean run yet: nothing (the K group measures its usual values)."""
        from edgespec.profile.k_choice import measure_verify, pooled_counts, predict
        from edgespec.profile.space import K_VALUES

        cur = self.results.get(candidate_key(self.current))
        drafter = self.current["drafter"]
        if not getattr(self.bench, "is_moe", False) or drafter == "none" or cur is None or cur.status != "ok":
            return
        k_run = cur.measurements[0]["resolved"]["k"]
        values = self.opt.values.get("num_draft_tokens", K_VALUES.get(drafter, (2, 4, 8)))
        verify = {}
        try:
            for k in sorted({k for k in values if k <= k_run} | {k_run}):
                engine = self.bench.open({**self.current, "num_draft_tokens": k})
                verify[k] = measure_verify(engine, k + 1)
                del engine
                self.bench.release()
            preds = predict(pooled_counts(cur.measurements), k_run, drafter, verify)
        except (EdgespecError, ImportError) as e:
            self.notes.append(f"MoE K prediction skipped: {e}")
            return
        self.k_predicted = tuple(p.k for p in preds)
        self.notes.append("MoE target, K from AL x measured verify cost (run at K=" + str(k_run) + "): " + "; ".join(
            f"K={p.k}: AL {p.al:.2f}, verify {p.verify_ms:.2f} ms (expert union {p.union:.1f}/layer), draft "
            f"{p.draft_ms:.2f} ms -> {p.tok_s:.1f} tok/s" for p in preds))
        self.progress.message(self.notes[-1])

    # -- one candidate -------------------------------------------------------------------------------------------
    def evaluate(self, cand: Candidate, group: str) -> CandidateResult:
        """Measure ``cand`` on every prompt not yet in the results file; return its verdict."""
        key = candidate_key(cand)
        res = self.results.get(key)
        if res is not None and res.status != "incomplete":
            return res                       # the incumbent comes back in every group: measured once
        if res is None:
            res = self.results[key] = CandidateResult(cand, candidate_label(cand, self.start), group)
            found = [self.store.get(measurement_key(key, c.id, c.sha)) for c in self.cases]
            res.measurements = [m for m in found if m is not None]
            self.progress.skip(len(res.measurements))
        done = {m["prompt"] for m in res.measurements}
        pending = [c for c in self.cases if c.id not in done]
        if pending and not self.out_of_budget():
            self._measure(res, pending)
        order = {c.id: i for i, c in enumerate(self.cases)}
        res.measurements.sort(key=lambda m: order[m["prompt"]])
        if res.status not in ("skipped", "failed"):
            res.status = self._verdict(res)
        return res

    def _verdict(self, res: CandidateResult) -> str:
        if len(res.measurements) < len(self.cases):
            return "incomplete"
        differ = [m for m in res.measurements if not m["same_as_plain"]]
        if differ:
            first = min(m["first_diff"] for m in differ)
            what = (f"greedy output differs from plain decoding on {len(differ)}/{len(res.measurements)} "
                    f"prompt(s), first at token {first}")
            if not res.lossy:
                res.note = f"{what}: a lossless configuration must not change it"
                return "disqualified"
            res.note = f"lossy by choice: {what}"
        return "ok"

    def _measure(self, res: CandidateResult, pending: Sequence[PromptCase]) -> None:
        label = f"{res.group}: {res.label}"
        engine = None
        try:
            engine = self.bench.open(res.candidate)
            for i, case in enumerate(pending):
                if self.out_of_budget():
                    break
                t0 = time.monotonic()
                if i == 0:
                    for _ in range(self.opt.warmup):
                        self.bench.run(engine, case, self.opt.tokens)
                ref = self._reference(engine, res.candidate, case)
                m = self.bench.measure(engine, case, self.opt.tokens, self.opt.repeats)
                out_ids = m.pop("_token_ids")
                if ref is None:              # no drafter: this run is plain decoding, it is the reference
                    ref = self._save_reference(res.candidate, case, out_ids, m)
                diff = first_diff(out_ids, ref)
                # bf16/fp16: a verify of K+1 rows may flip a near-tie that a one-row decode resolves the other
                # way; that is rounding, not a bug, when the regret at the first divergence is tiny.
                regret = None if diff is None else divergence_regret(
                    engine.model, case.ids, ref, out_ids, bool(engine.session.kv_fp8))
                same = diff is None or (engine.model.dtype != torch.float32 and regret <= TIE_REGRET)
                rec = self.store.add({"type": "measurement", "key": measurement_key(res.key, case.id, case.sha),
                                      "candidate": res.candidate, "prompt": case.id, "prompt_sha": case.sha,
                                      "same_as_plain": same, "first_diff": diff, "regret_at_diff": regret,
                                      "lossy": res.lossy,
                                      "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **m})
                res.measurements.append(rec)
                self.progress.step(f"{label} | {case.id} {m['decode_tok_s']:.1f} tok/s "
                                   f"AL {m['acceptance_length']:.2f}", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - one broken candidate (OOM, kernel error) must not end a long run
            if engine is None and isinstance(e, (EdgespecError, ImportError)):
                # Cannot be built here: dflash without drafter_path, mtp without MTP weights, relaxed thinking
                # without <think> tokens, K above the drafter's maximum...
                res.status, res.note = "skipped", str(e)
                self.progress.message(f"skip {res.label}: {e}")
                self.progress.set_total(self.progress.total - len(pending))
            else:
                res.status, res.note = "failed", f"{type(e).__name__}: {e}"
                self.progress.message(f"failed {res.label}: {res.note}")
        finally:
            engine = None
            self.bench.release()

    def _ref_key(self, cand: Candidate, case: PromptCase) -> str:
        return reference_key(cand["kv_dtype"], cand["cuda_graphs"], cand["prefill_chunk"], case.id, case.sha)

    def _reference(self, engine: Any, cand: Candidate, case: PromptCase) -> list[int] | None:
        """Plain greedy output of ``case`` with the candidate's KV format and kernels (None: measure it)."""
        rec = self.store.get(self._ref_key(cand, case))
        if rec is not None:
            return rec["token_ids"]
        if cand["drafter"] == "none":
            return None
        out, _ = self.bench.run(engine, case, self.opt.tokens, plain=True)
        tel = out.telemetry
        return self._save_reference(cand, case, out.token_ids, {"decode_tok_s": round(tel.decode_tok_s, 3),
                                                                 "ttft_ms": round(tel.stage_ms["prefill"], 3)})

    def _save_reference(self, cand: Candidate, case: PromptCase, token_ids: list[int],
                        m: dict[str, Any]) -> list[int]:
        self.store.add({"type": "reference", "key": self._ref_key(cand, case), "prompt": case.id,
                        "prompt_sha": case.sha, "kv_dtype": cand["kv_dtype"], "cuda_graphs": cand["cuda_graphs"],
                        "prefill_chunk": cand["prefill_chunk"], "token_ids": list(token_ids),
                        "decode_tok_s": m["decode_tok_s"], "ttft_ms": m["ttft_ms"]})
        return list(token_ids)
