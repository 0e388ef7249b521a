"""The speculative session: prefill, then propose -> verify -> accept -> commit/rollback until a stop.

One session owns one preallocated cache and serves requests one after another (batch 1). With no proposer, or
when the proposer has nothing to offer, a cycle is a plain decode step, so plain generation is the same loop.
The session never asks which kind a layer is: caches, taps and rollback go through the arch hooks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from edgespec.arch.base import ROLLBACK_STRATEGIES, ArchHooks
from edgespec.cache.prefix import PrefixCache
from edgespec.drafters.base import Draft, Proposer
from edgespec.errors import ConfigError, PromptTooLongError, RequestError
from edgespec.models.decoder import ForwardOutput, TargetModel
from edgespec.speculative.acceptance import AcceptancePolicy, Verdict
from edgespec.speculative.telemetry import RequestTelemetry


class TokenConstraint(Protocol):
    """A grammar matcher driving constrained decoding (JSON mode). Implemented in ``edgespec.serving.grammar``."""

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar accepts from the current state."""

    def row_masks(self, drafts: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
        """Allowed-token masks ``[len(drafts)+1, vocab_size]`` (bool) for the verify rows."""

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance by exactly the committed tokens."""

    def is_finished(self) -> bool:
        """True once the grammar has matched a complete value."""


@dataclass
class GenerationResult:
    """Tokens produced for one request, why it ended, and its telemetry."""

    token_ids: list[int]
    finish_reason: str                      # "stop" | "length" | "cancelled"
    telemetry: RequestTelemetry = field(default_factory=RequestTelemetry)


# Callback fed each batch of newly emitted tokens; returning True stops generation (a stop string was hit).
TokenSink = Callable[[list[int]], bool]


@dataclass
class Cycle:
    """What one propose -> verify -> accept cycle carries from its verify to the emit and the proposer's commit.

    A cycle without a draft is a plain decode step (one row). Its commit to the proposer runs at the start of the
    next cycle's draft stage (see :meth:`SpecSession.generate`).
    """

    verdict: Verdict                 # accepted drafts, then tokens = accepted drafts + the next token
    forward: ForwardOutput           # the forward whose rows 0 .. accepted are in the cache: logits [rows, vocab]
    drafted: int                     # draft tokens verified (0: a plain decode step); rows = drafted + 1

    def commit_to(self, proposer: Proposer) -> None:
        proposer.commit(self.verdict.tokens, self.verdict.accepted, self.forward, self.drafted)


class Emitter:
    """The tokens of one request so far, and the rules that end it: stop ids, ``max_tokens``, the grammar, the
    caller's sink. :meth:`emit` takes each cycle's committed tokens and returns a finish reason or None."""

    def __init__(self, max_tokens: int, stop_ids: Sequence[int], policy: AcceptancePolicy,
                 on_tokens: TokenSink | None, constraint: TokenConstraint | None) -> None:
        self.max_tokens, self.stop_set, self.policy = max_tokens, set(stop_ids), policy
        self.on_tokens, self.constraint = on_tokens, constraint
        self.tokens: list[int] = []

    @property
    def room(self) -> int:
        return self.max_tokens - len(self.tokens)

    def emit(self, tokens: list[int]) -> str | None:
        """Append newly committed tokens (up to a stop id or ``max_tokens``); a finish reason when it must end."""
        finish = None
        for i, t in enumerate(tokens):
            if t in self.stop_set:
                tokens, finish = tokens[:i], "stop"
                break
        if len(self.tokens) + len(tokens) >= self.max_tokens and finish is None:
            tokens, finish = tokens[:self.room], "length"
        self.tokens.extend(tokens)
        self.policy.observe(tokens)
        if self.constraint is not None and tokens:
            self.constraint.commit(tokens)
            if finish is None and self.constraint.is_finished():
                finish = "stop"
        if self.on_tokens is not None and tokens and self.on_tokens(tokens):
            finish = "stop"
        return finish


class SpecSession:
    """Batch-1 generation loop over one target model, one proposer (or none) and one arch hook set."""

    def __init__(self, model: TargetModel, hooks: ArchHooks, proposer: Proposer | None = None, *,
                 k: int | None = None, kv_fp8: bool | None = None, rollback: str | None = None,
                 prefill_chunk: int | None = None, max_len: int = 4096, cuda_graphs: bool | None = None,
                 stage_timing: str = "host", adaptive_k: bool | None = None) -> None:
        d = hooks.defaults
        self.model, self.hooks, self.proposer = model, hooks, proposer
        self.k = 0 if proposer is None else (k or proposer.default_k)
        if proposer is not None and not (1 <= self.k <= proposer.max_k):
            raise ConfigError(f"num_draft_tokens {self.k} out of range 1..{proposer.max_k} for {proposer.name}")
        self.kv_fp8 = d.kv_fp8 if kv_fp8 is None else kv_fp8
        self.rollback_strategy = d.rollback if rollback in (None, "auto") else rollback
        if self.rollback_strategy not in ROLLBACK_STRATEGIES:
            raise ConfigError(f"rollback {self.rollback_strategy!r} is not one of {', '.join(ROLLBACK_STRATEGIES)}")
        self.prefill_chunk = prefill_chunk or d.prefill_chunk
        self.taps: tuple[int, ...] = tuple(proposer.taps) if proposer is not None else ()
        self.cache = hooks.new_cache(model, max_len, self.kv_fp8, self.rollback_strategy, max_rows=self.k + 1)
        self.cuda_graphs = d.cuda_graphs if cuda_graphs is None else cuda_graphs
        self.stage_timing = stage_timing
        self.adaptive_k = d.adaptive_k if adaptive_k is None else adaptive_k
        from edgespec.models.moe import attach_routing_log
        self.routing = attach_routing_log(model)      # MoE targets: expert unions per forward (telemetry)
        hooks.prepare(model, self.cache, self.k + 1, self.taps, self.rollback_strategy, self.cuda_graphs)

    @property
    def resume_rows(self) -> int | None:
        """Trailing prompt rows a prefix-reusing prefill must still compute (None: always prefill everything)."""
        return 0 if self.proposer is None else self.proposer.resume_rows

    @property
    def drafter_name(self) -> str:
        return "none" if self.proposer is None else self.proposer.name

    def check_request(self, n_prompt: int, max_tokens: int, k: int | None = None) -> None:
        """Raise before any device work when a request cannot run: empty or over-long prompt, max_tokens < 1, or
        a per-request K outside 0..K of this session (K sized the checkpoint slots)."""
        if max_tokens < 1:
            raise RequestError(f"max_tokens {max_tokens} must be >= 1")
        if k is not None and not (0 <= k <= self.k):
            raise RequestError(f"num_draft_tokens {k} out of range 0..{self.k} for this server")
        if n_prompt == 0:
            raise RequestError("prompt is empty")
        if n_prompt + 1 > self.cache.max_len:
            raise PromptTooLongError(
                f"prompt of {n_prompt} tokens does not fit max_seq_len {self.cache.max_len} (needs room for at "
                f"least one generated token)")

    def generate(self, prompt_ids: Sequence[int], *, max_tokens: int, policy: AcceptancePolicy,
                 stop_ids: Sequence[int] = (), on_tokens: TokenSink | None = None,
                 cancelled: Callable[[], bool] | None = None,
                 constraint: TokenConstraint | None = None, k: int | None = None,
                 prefix: PrefixCache | None = None) -> GenerationResult:
        """Generate up to ``max_tokens`` tokens after ``prompt_ids``; stop ids end generation (and are dropped).

        ``k`` lowers the drafts per cycle for this request (0 = plain decoding); it cannot exceed the session's K,
        which sized the checkpoint slots. With ``prefix`` (the record of what this session's cache holds) the
        request resumes from the longest prompt prefix still in the cache instead of an empty one.
        """
        self.check_request(len(prompt_ids), max_tokens, k)
        k = self.k if k is None else k
        model, hooks, cache, proposer = self.model, self.hooks, self.cache, self.proposer
        device = model.device
        sync = torch.cuda.synchronize if self.stage_timing == "device" and device.type == "cuda" else None
        tel = RequestTelemetry(drafter=self.drafter_name, prompt_tokens=len(prompt_ids), sync=sync)
        if self.routing is not None:
            self.routing.clear()
        out = Emitter(max_tokens, stop_ids, policy, on_tokens, constraint)
        start = 0
        if prefix is None:
            cache.reset()
        else:
            # A drafter that cannot resume (resume_rows None) gets a full prefill; DFlash needs its window's rows.
            start = prefix.begin(prompt_ids, self.resume_rows)
        policy.begin(prompt_ids)

        with tel.stage("prefill"):
            prompt = torch.tensor(list(prompt_ids)[start:], dtype=torch.long, device=device)
            cut = None if prefix is None else prefix.split(prompt_ids, start)
            if cut is None:
                prefill = hooks.prefill(model, cache, prompt, self.prefill_chunk, self.taps)
            else:
                # Pause at the last turn boundary so the next turn can resume a hybrid model's state there.
                head = hooks.prefill(model, cache, prompt[:cut - start], self.prefill_chunk, self.taps, logits=False)
                prefix.mark(prompt_ids, cut)
                prefill = _joined(head, hooks.prefill(model, cache, prompt[cut - start:], self.prefill_chunk,
                                                      self.taps))
            if prefix is not None:
                prefix.prefilled(prompt_ids)
            logits = prefill.logits[-1]
            if constraint is not None:
                logits = _masked(logits[None], constraint.row_masks([], logits.shape[-1], device))[0]
            first = policy.next_token(logits)
        t_first = time.perf_counter()
        if proposer is not None:
            with tel.stage("draft"):
                proposer.begin(prompt_ids, prefill)
                proposer.commit([first], 0, None)

        draft_len = DraftLength(k, self.adaptive_k)
        # The proposer's commit of a cycle runs at the start of the next cycle's draft stage, right before its
        # propose (and before any other forward, as the commit contract needs): one burst of drafter work per cycle
        # (the window append, then the block) instead of two stages around the emit.
        pending: Cycle | None = None
        finish = out.emit([first])
        while finish is None:
            if cancelled is not None and cancelled():
                finish = "cancelled"
                break
            room = min(draft_len.k, out.room - 1, cache.max_len - cache.length - 1)
            if cache.length + 1 > cache.max_len:
                finish = "length"
                break
            last = out.tokens[-1]
            draft = None
            if proposer is not None and (room > 0 or pending is not None):
                with tel.stage("draft"):
                    if pending is not None:
                        pending.commit_to(proposer)
                        pending = None
                    draft = self._propose(last, room, constraint) if room > 0 else None
            cycle = self._decode(last, policy, constraint, tel) if draft is None else \
                self._verify(last, draft, policy, constraint, tel)
            tel.record_cycle(cycle.drafted, cycle.verdict.accepted)
            draft_len.update(cycle.drafted, cycle.verdict.accepted)
            if proposer is not None:
                pending = cycle
            with tel.stage("other"):
                finish = out.emit(cycle.verdict.tokens)
        if pending is not None:
            # The last cycle's commit, so the proposer ends in step with the cache (as after every cycle).
            with tel.stage("draft"):
                pending.commit_to(proposer)
        tel.decode_ms = (time.perf_counter() - t_first) * 1000.0
        tel.generated_tokens = len(out.tokens)
        if self.routing is not None:      # decode steps and verifies only, not the prefill
            tel.expert_union = {r: round(u, 2) for r, u in self.routing.summary().items() if r <= self.k + 1}
        if prefix is not None:
            prefix.finished(list(prompt_ids) + out.tokens)
        return GenerationResult(out.tokens, finish, tel)

    def _propose(self, last: int, room: int, constraint: TokenConstraint | None) -> Draft | None:
        """The proposer's draft cut to ``room`` and to the grammar's valid prefix; None when nothing is left."""
        draft = self.proposer.propose(last, room)
        if draft is None:
            return None
        tokens = draft.tokens[:room]
        if constraint is not None:
            tokens = tokens[:constraint.valid_prefix(tokens.tolist())]
        return None if tokens.numel() == 0 else type(draft)(tokens.to(self.model.device), draft.probs)

    def _decode(self, last: int, policy: AcceptancePolicy, constraint: TokenConstraint | None,
                tel: RequestTelemetry) -> Cycle:
        """A cycle without drafts: one decode step and the next token."""
        device = self.model.device
        with tel.stage("verify"):
            step = self.hooks.decode(self.model, self.cache, torch.tensor([last], device=device), self.taps)
        with tel.stage("accept"):
            logits, greedy = step.logits, step.greedy          # [1, vocab], [2] or None
            if constraint is not None:
                logits, greedy = _masked(logits, constraint.row_masks([], logits.shape[-1], device)), None
            verdict = Verdict(0, [policy.next_token(logits[0], greedy)])
        return Cycle(verdict, step, 0)

    def _verify(self, last: int, draft: Draft, policy: AcceptancePolicy, constraint: TokenConstraint | None,
                tel: RequestTelemetry) -> Cycle:
        """Verify ``last`` + the draft in one forward, accept a prefix, roll the rest back."""
        model, cache, device = self.model, self.cache, self.model.device
        drafted = draft.tokens.shape[0]
        rows = torch.cat([torch.tensor([last], device=device), draft.tokens])     # [drafted + 1]
        start = cache.length
        with tel.stage("verify"):
            step = self.hooks.verify(model, cache, rows, self.taps)
        with tel.stage("accept"):
            logits, greedy = step.logits, step.greedy          # [drafted + 1, vocab], [drafted + 2] or None
            if constraint is not None:
                # The graph's verdict is of the unmasked logits: the grammar's masks change it.
                logits = _masked(logits, constraint.row_masks(draft.tokens.tolist(), logits.shape[-1], device))
                greedy = None
            verdict = policy.accept(logits, draft.tokens, draft.probs, greedy)
            replayed = self.hooks.rollback(model, cache, start, rows, verdict.accepted + 1, self.taps)
        return Cycle(verdict, replayed if replayed is not None else step, drafted)


class DraftLength:
    """Drafts asked for per cycle. Fixed at K, or adaptive: +2 after a cycle whose drafts were all accepted; after
    a rejection, one more than were accepted (the length that would just have paid); always within 1..K. Starts
    at K."""

    def __init__(self, k: int, adaptive: bool) -> None:
        self.max_k, self.adaptive, self.k = k, adaptive, k

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        self.k = min(self.max_k, self.k + 2) if accepted == drafted else max(1, min(self.k, accepted + 1))


def _joined(a: ForwardOutput, b: ForwardOutput) -> ForwardOutput:
    """One prefill's output from two consecutive pieces (logits of the last row, hidden/taps of every row)."""
    taps = None if a.taps is None or b.taps is None else torch.cat([a.taps, b.taps])
    return ForwardOutput(b.logits, torch.cat([a.hidden, b.hidden]), taps)


def _masked(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~mask[:logits.shape[0]], float("-inf"))

