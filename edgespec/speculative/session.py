"""The speculative session: prefill, then propose -> verify -> accept -> commit/rollback until a stop.

One session owns one preallocated cache and serves requests one after another (batch 1). With no proposer, or
when the proposer has nothing to offer, a cycle is a plain decode step, so plain generation is the same loop.
What a cycle drafts and how it verifies, accepts and commits it is the session's cycle strategy
(:mod:`edgespec.speculative.strategy`: chains or draft trees); the loop around it is one for all. The session never
asks which kind a layer is: caches, taps and rollback go through the arch hooks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from edgespec.arch.base import ArchHooks
from edgespec.cache.prefix import PrefixCache
from edgespec.drafters.base import Proposer
from edgespec.errors import PromptTooLongError, RequestError
from edgespec.kernels import device_sync
from edgespec.models.decoder import ForwardOutput, TargetModel
from edgespec.models.multimodal import VisionPrompt
from edgespec.speculative.acceptance import AcceptancePolicy
from edgespec.speculative.chain_cycle import ChainCycles
from edgespec.speculative.cycle import Cycle, TokenConstraint, mask_logits
from edgespec.speculative.plan import SessionPlan, draft_tokens
from edgespec.speculative.strategy import CycleStrategy, session_cycles
from edgespec.speculative.telemetry import RequestTelemetry


@dataclass
class GenerationResult:
    """Tokens produced for one request, why it ended, and its telemetry."""

    token_ids: list[int]
    finish_reason: str                      # "stop" | "length" | "cancelled"
    telemetry: RequestTelemetry = field(default_factory=RequestTelemetry)


# Callback fed each batch of newly emitted tokens; returning True stops generation (a stop string was hit).
TokenSink = Callable[[list[int]], bool]


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

    def __init__(self, model: TargetModel, hooks: ArchHooks, proposer: Proposer | None, k: int,
                 plan: SessionPlan) -> None:
        """``k``: drafts per cycle (0 without a proposer; :func:`draft_tokens` resolves and checks it); ``plan``:
        the resolved knobs. Allocates the cache and builds (captures) the static forwards."""
        self.model, self.hooks, self.proposer, self.plan = model, hooks, proposer, plan
        self.k = k
        self.rollback = plan.rollback
        self.taps: tuple[int, ...] = tuple(proposer.taps) if proposer is not None else ()
        self.cache = hooks.new_cache(model, plan.max_len, plan.kv_fp8, plan.rollback, max_rows=k + 1)
        from edgespec.models.moe import attach_routing_log
        self.routing = attach_routing_log(model)      # MoE targets: expert unions per forward (telemetry)
        hooks.prepare(model, self.cache, k + 1, self.taps, plan.rollback, plan.cuda_graphs, plan.graph_prefill_max)
        # What each cycle drafts and how it verifies it (chains, or the plan's draft trees). A bench may set it to
        # ``cycles.chain`` between requests (the cache keeps the trees' room).
        self.cycles: CycleStrategy[Any] = session_cycles(ChainCycles(model, self.cache, hooks, plan.rollback,
                                                                     self.taps), plan, proposer)

    @classmethod
    def with_defaults(cls, model: TargetModel, hooks: ArchHooks, proposer: Proposer | None = None, *,
                      k: int | None = None, **knobs) -> SpecSession:
        """A session whose knobs not given (see :meth:`SessionPlan.resolve`) take the arch defaults of ``hooks``:
        for tests and tools that build a session without an engine."""
        return cls(model, hooks, proposer, draft_tokens(k, proposer), SessionPlan.resolve(hooks.defaults, **knobs))

    # The resolved knobs, read by benchmarks and tools.
    @property
    def kv_fp8(self) -> bool:
        return self.plan.kv_fp8

    @property
    def prefill_chunk(self) -> int:
        return self.plan.prefill_chunk

    @property
    def cuda_graphs(self) -> bool:
        return self.plan.cuda_graphs

    @property
    def adaptive_k(self) -> bool:
        return self.plan.adaptive_k

    @property
    def rollback_strategy(self) -> str:
        return self.plan.rollback.name

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
                 prefix: PrefixCache | None = None, vision: VisionPrompt | None = None) -> GenerationResult:
        """Generate up to ``max_tokens`` tokens after ``prompt_ids``; stop ids end generation (and are dropped).

        ``k`` lowers the drafts per cycle for this request (0 = plain decoding); it cannot exceed the session's K,
        which sized the checkpoint slots. With ``prefix`` (the record of what this session's cache holds) the
        request resumes from the longest prompt prefix still in the cache instead of an empty one. ``vision``: the
        images among ``prompt_ids`` (their rows keyed by pixel digest in the prefix cache; the tower runs, under
        stage ``vision``, only for images the resumed prefix does not hold).
        """
        self.check_request(len(prompt_ids), max_tokens, k)
        k = self.k if k is None else k
        device, proposer = self.model.device, self.proposer
        sync = device_sync if self.plan.stage_timing == "device" and device.type == "cuda" else None
        tel = RequestTelemetry(drafter=self.drafter_name, prompt_tokens=len(prompt_ids), sync=sync)
        if self.routing is not None:
            self.routing.clear()
        out = Emitter(max_tokens, stop_ids, policy, on_tokens, constraint)
        start = 0
        keys = prompt_ids if vision is None else vision.keys(prompt_ids)
        if prefix is None:
            self.cache.reset()
        else:
            # A drafter that cannot resume (resume_rows None) gets a full prefill; DFlash needs its window's rows.
            start = prefix.begin(keys, self.resume_rows)
        policy.begin(prompt_ids)
        if vision is not None:
            with tel.stage("vision"):
                tel.vision = vision.encode_from(start).to_dict()

        with tel.stage("prefill"):
            prefill = self._prefill(prompt_ids, start, prefix, keys, vision, cancelled)
            if prefill is None:          # paused between slices: the cache keeps the rows done
                return GenerationResult([], "cancelled", tel)
            logits = prefill.logits[-1]
            if constraint is not None:
                logits = mask_logits(logits[None], constraint.row_masks([], logits.shape[-1], device))[0]
            first = policy.next_token(logits)
        t_first = time.perf_counter()
        if proposer is not None:
            with tel.stage("draft"):
                proposer.begin(prompt_ids, prefill)
                proposer.commit([first], 0, None)
        length = DraftLength(k, adapts(proposer, self.adaptive_k))
        finish = self._cycles(out, policy, constraint, cancelled, length, tel, out.emit([first]))
        tel.decode_ms = (time.perf_counter() - t_first) * 1000.0
        tel.generated_tokens = len(out.tokens)
        if self.routing is not None:      # decode steps and verifies only, not the prefill
            tel.expert_union = {r: round(u, 2) for r, u in self.routing.summary().items() if r <= self.k + 1}
        if prefix is not None:
            prefix.finished(list(keys) + out.tokens)
        return GenerationResult(out.tokens, finish, tel)

    def _prefill(self, prompt_ids: Sequence[int], start: int, prefix: PrefixCache | None, keys: Sequence,
                 vision: VisionPrompt | None, cancelled: Callable[[], bool] | None = None) -> ForwardOutput | None:
        """Fill the cache with the prompt from ``start`` (the prefix already in the cache); logits of the last row,
        hidden/taps of every row prefilled. ``keys``: the prefix cache's key of every prompt row.

        With ``cancelled`` a text prompt's prefill runs in slices of ``prefill_chunk`` tokens and asks between them:
        True pauses it and returns None, the cache (and ``prefix``, which a later request resumes from) keeping the
        rows done. A slice is one chunk of the unsliced prefill, so the rows are the same either way. A prompt with
        images prefills whole (an image's rows are one forward)."""
        ids = list(prompt_ids)
        cut = None if prefix is None else prefix.split(keys, start)
        # Pause at the last turn boundary so the next turn can resume a hybrid model's state there.
        pieces = [(start, len(ids))] if cut is None else [(start, cut), (cut, len(ids))]
        sliced = cancelled is not None and vision is None
        outs: list[ForwardOutput] = []
        for n, (a, b) in enumerate(pieces):
            last = n == len(pieces) - 1
            for s, e in self._slices(a, b, sliced):
                if sliced and s > start and cancelled():
                    self._pause_prefill(keys, prefix)
                    return None
                rows = torch.tensor(ids[s:e], dtype=torch.long, device=self.model.device)
                outs.append(self._prefill_rows(rows, s, e, vision, logits=last and e == b))
            if not last:
                assert prefix is not None and cut is not None
                prefix.mark(keys, cut)
        if prefix is not None:
            prefix.prefilled(keys)
        taps = [out.taps for out in outs]
        joined_taps = None if any(t is None for t in taps) else torch.cat(taps)
        return ForwardOutput(outs[-1].logits, torch.cat([out.hidden for out in outs]), joined_taps)

    def _slices(self, a: int, b: int, sliced: bool) -> list[tuple[int, int]]:
        """``[a, b)`` in ``prefill_chunk`` slices (one piece unless ``sliced``). A remainder short enough for a
        graphed resumed prefill joins the slice before it, so the rows match the unsliced prefill's."""
        step = self.prefill_chunk
        if not sliced or b - a <= step:
            return [(a, b)]
        out = [(s, min(b, s + step)) for s in range(a, b, step)]
        if len(out) > 1 and out[-1][1] - out[-1][0] <= self.plan.graph_prefill_max:
            out[-2:] = [(out[-2][0], b)]
        return out

    def _pause_prefill(self, keys: Sequence, prefix: PrefixCache | None) -> None:
        """A prefill paused between slices: tell the prefix record what the cache holds (a snapshot for a hybrid
        model), so the request, continued later, resumes there."""
        if prefix is not None and self.cache.length > 0:
            prefix.mark(keys, self.cache.length)

    def _prefill_rows(self, tokens: torch.Tensor, first: int, stop: int, vision: VisionPrompt | None,
                      logits: bool = True) -> ForwardOutput:
        """Prefill prompt rows ``first:stop`` (``tokens``). With images among them the forward takes their tokens
        and every row's M-RoPE position; text rows sit at cache index + the rope delta of the image before them,
        which the cache keeps for the rows after."""
        model, hooks, cache = self.model, self.hooks, self.cache
        images = None if vision is None else vision.rows(first, stop)
        if vision is not None and images is None:
            cache.set_rope_delta(vision.delta_at(first))
        if images is None:
            out = hooks.prefill(model, cache, tokens, self.prefill_chunk, self.taps, logits=logits)
        else:
            out = hooks.prefill(model, cache, tokens, self.prefill_chunk, self.taps, logits=logits, images=images)
        if vision is not None:
            cache.set_rope_delta(vision.delta_at(stop))
        return out

    def _cycles(self, out: Emitter, policy: AcceptancePolicy, constraint: TokenConstraint | None,
                cancelled: Callable[[], bool] | None, draft_len: DraftLength, tel: RequestTelemetry,
                finish: str | None) -> str:
        """Propose -> verify -> accept -> emit until a finish reason (``finish``: the first token's); leaves the
        proposer committed up to the last cycle."""
        cache, proposer = self.cache, self.proposer
        cycles = self.cycles.for_request(constraint)
        # The proposer's commit of a cycle runs at the start of the next cycle's draft stage, right before its
        # propose (and before any other forward, as the commit contract needs): one burst of drafter work per cycle
        # (the window append, then the block) instead of two stages around the emit.
        pending: Cycle | None = None
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
            t_cycle = time.perf_counter()
            if proposer is not None and (room > 0 or pending is not None):
                with tel.stage("draft"):
                    if pending is not None:
                        pending.commit_to(proposer)
                        pending = None
                    if room > 0:
                        draft = cycles.propose(proposer, last, room, constraint)
            t_verify = time.perf_counter()
            cycle = cycles.verify(last, draft, policy, constraint, tel)
            cycles.record_cost(cycle, t_verify - t_cycle, time.perf_counter() - t_verify)
            tel.record_cycle(cycle.drafted, cycle.verdict.accepted)
            draft_len.update(cycle.depth, cycle.verdict.accepted)
            if proposer is not None:
                pending = cycle
            with tel.stage("other"):
                finish = out.emit(cycle.verdict.tokens)
        if pending is not None:
            # The last cycle's commit, so the proposer ends in step with the cache (as after every cycle).
            with tel.stage("draft"):
                pending.commit_to(proposer)
        return finish


def adapts(proposer: Proposer | None, adaptive_k: bool) -> bool:
    """Whether the session adapts the draft length (:class:`DraftLength`): ``adaptive_k``, unless the proposer
    sizes its drafts itself (``Proposer.sizes_drafts``)."""
    return adaptive_k and not (proposer is not None and proposer.sizes_drafts)


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
