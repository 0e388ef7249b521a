"""The engine: one loaded model + tokenizer + speculative session, answering text and chat requests.

This is what the CLI, the server and the profiler drive. It owns the only device state (weights and the
preallocated cache), so requests must be served one at a time (the server queues them).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from edgespec.cache.prefix import PrefixCache
from edgespec.drafters.factory import build_proposer
from edgespec.energy import EnergyReading, EnergySpan, open_meter
from edgespec.errors import ConfigError, ImageError, RequestError
from edgespec.kernels import options as kernel_options
from edgespec.kernels.quant.linear import configure_cpu
from edgespec.loading.checkpoint import load_target
from edgespec.loading.images import ImageRef, ProcessorConfig, load_image
from edgespec.loading.resumable_encoder import ResumableEncoder
from edgespec.loading.tokenizer import ChatTokenizer
from edgespec.model_id import served_model_id
from edgespec.models.multimodal import ImageEncoder, VisionPrompt
from edgespec.plan import RuntimePlan
from edgespec.speculative.acceptance import AcceptancePolicy, RejectionSampling, RelaxedThinking, StrictGreedy
from edgespec.speculative.plan import draft_tokens
from edgespec.speculative.sampling import SamplingParams
from edgespec.speculative.session import GenerationResult, SpecSession, TokenConstraint
from edgespec.speculative.telemetry import CumulativeTelemetry, RequestTelemetry


@dataclass
class Request:
    """One generation request: chat ``messages`` or a raw ``prompt`` (or pre-tokenised ``prompt_ids``)."""

    messages: Sequence[Mapping[str, Any]] | None = None
    prompt: str | None = None
    prompt_ids: Sequence[int] | None = None
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    enable_thinking: bool | None = None
    tools: Sequence[Mapping[str, Any]] | None = None   # rendered by the chat template (OpenAI tool objects)
    num_draft_tokens: int | None = None           # per-request K (<= the engine's K); 0 disables drafting
    constraint: TokenConstraint | None = None
    on_text: Callable[[str], None] | None = None  # streaming: called with each new piece of text
    cancelled: Callable[[], bool] | None = None
    # Checked at every cycle boundary: True pauses the generation (finish ``preempted``, state kept in ``partial``)
    # so another request can run; ``complete`` called again with the same request continues it.
    preempt: Callable[[], bool] | None = None
    # Whose request this is (API key, prompt_cache_key or user): the prefix cache is reused only within one key,
    # and the suffix drafter's cache of earlier outputs is partitioned by it.
    cache_key: str | None = None
    partial: Partial | None = None
    # Images of the chat messages, in the order their ``{"type": "image"}`` parts appear (vision-language models):
    # data: URLs, encoded bytes or file paths, each with the request field it came from.
    images: Sequence[ImageRef] = ()
    # Set by Engine.check: the images preprocessed and placed in the expanded prompt ids.
    vision: VisionPrompt | None = None


@dataclass
class Partial:
    """A generation paused at a cycle boundary: what :meth:`Engine.complete` needs to continue it exactly (the
    detokenizer keeps a stop string split by the pause, the policy keeps a seeded sampler's stream)."""

    prompt_ids: list[int]
    tokens: list[int]
    pieces: list[str]
    detok: Any
    policy: AcceptancePolicy
    telemetry: RequestTelemetry | None
    cached_tokens: int
    energy: EnergyReading | None = None


@dataclass
class Completion:
    """Result of one request."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    telemetry: RequestTelemetry
    reasoning_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens resumed from the cache (prefix reuse), not prefilled
    energy: EnergyReading | None = None   # device energy over the generation (None without a meter: CPU)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class Engine:
    """A ready-to-serve model. Build with :meth:`load` from a :class:`~edgespec.plan.RuntimePlan` (or :meth:`around`
    a model already loaded); the plan is all it reads: no Settings, no environment."""

    def __init__(self, plan: RuntimePlan, model, tokenizer: ChatTokenizer, model_dir: Path) -> None:
        kernel_options.install(plan.kernels)      # the drafter and session below may run kernels
        self.plan = plan
        requests = plan.requests
        self.model = model
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.device = model.device
        self.hooks = plan.new_hooks()      # the engine's one hook set: it picks the drafter's kernels too
        self.proposer = build_proposer(plan.drafter, model, self.hooks.choose_weight_kernels)
        session_plan = plan.session
        # A checkpoint that asks for an FP8 KV cache (ModelOpt kv_cache_quant_algo, compressed-tensors
        # kv_cache_scheme) gets one under kv_dtype auto; its scales are computed per token and head as rows are
        # written. Known only once the model is loaded, after the plan was resolved.
        if plan.model.kv_dtype == "auto" and getattr(model, "checkpoint_kv_cache", None) == "fp8":
            session_plan = replace(session_plan, kv_fp8=True)
        self.session = SpecSession(model, self.hooks, self.proposer,
                                   draft_tokens(plan.drafter.num_draft_tokens, self.proposer), session_plan)
        # The suffix drafter's (or suffix lookup's) cache of earlier outputs: fed every completion, per client.
        self.suffix_cache = getattr(self.proposer, "suffix_cache", None)
        # Prefix reuse: what the session's cache holds between requests (see edgespec.cache.prefix).
        # Turns start at the chat template's own turn token (ChatML's <|im_start|>, Llama 3's <|start_header_id|>).
        turn = [t for t in (tokenizer.turn_token_id,) if t is not None]
        self.prefix = PrefixCache(self.session.cache, turn_ids=turn) if requests.prefix_reuse else None
        # With prefix reuse the rest of a follow-up turn scales with its new tokens; so does its tokenisation.
        self.encoder = (ResumableEncoder(tokenizer.tokenizer, tokenizer.turn_markers.opener)
                        if requests.prefix_reuse else None)
        self.think_ids = tokenizer.think_token_ids
        if requests.acceptance.mode == "relaxed_thinking" and self.think_ids is None:
            raise ConfigError("acceptance relaxed_thinking needs <think> and </think> tokens, and the tokenizer of "
                              f"{model_dir} has none")
        self.totals = CumulativeTelemetry()
        # Images (a checkpoint with a vision tower): the tower behind its cache of recent frames, the processor's
        # resize rules and the request limits.
        self.image_encoder = self.image_processor = None
        if getattr(model, "visual", None) is not None:
            self.image_encoder = ImageEncoder(model.visual, self.device, max_cached=requests.image_cache)
            self.image_processor = ProcessorConfig.from_folder(model_dir, model.config.vision,
                                                               requests.image_max_pixels)
        self.image_limits = requests.image_limits
        self._prefix_key: str | None = None     # the client key whose tokens the prefix cache holds
        # Joules per request (NVML on a discrete GPU, INA3221 rails on a Jetson, none on CPU; edgespec.energy).
        self.energy = open_meter(self.device) if requests.energy_meter else None
        self.model_id = served_model_id(plan.model.source, requests.served_model_name)
        self.request_log = None
        if requests.request_log is not None:
            from edgespec.distill.request_log import RequestLog
            log = requests.request_log
            self.request_log = RequestLog(log.path, log.max_bytes, log.keep)

    @classmethod
    def around(cls, plan: RuntimePlan, model, tokenizer: ChatTokenizer, model_dir: Path) -> Engine:
        """An engine of ``plan`` over a model already loaded (benchmarks that try several plans on one model:
        ``build_plan(settings, model.device)``); the plan's model part is not loaded again."""
        if plan.device.type != model.device.type:
            raise ConfigError(f"the plan is for {plan.device}, the loaded model is on {model.device}: build the "
                              "plan for the model's device")
        return cls(plan, model, tokenizer, model_dir)

    @classmethod
    def load(cls, plan: RuntimePlan) -> Engine:
        """Load the model and tokenizer ``plan`` names and build the engine that serves them."""
        kernel_options.install(plan.kernels)      # before any kernel runs (loading packs weights with some)
        device, dtype, source = plan.device, plan.dtype, plan.model
        gguf = None
        if source.source == "demo":
            from edgespec.convert.gguf import demo_gguf_path, ensure_demo_model
            gguf = demo_gguf_path() if source.gguf_weights == "packed" else None
            model_dir = ensure_demo_model() if gguf is None else None
        elif source.source.endswith(".gguf"):
            from edgespec.convert.gguf import convert_gguf
            from edgespec.loading.gguf_meta import gguf_metadata_folder
            gguf = Path(source.source).expanduser()
            if source.gguf_weights == "fp32":
                model_dir = convert_gguf(gguf, gguf_metadata_folder(gguf).with_name(gguf.stem + "-fp32"))
                gguf = None
        else:
            model_dir = Path(source.source).expanduser()
        from edgespec.loading.weights import checkpoint_bytes
        drafter_bytes = 0
        if plan.drafter.name == "dflash":
            drafter_bytes = checkpoint_bytes(plan.drafter.dflash_path)
        if gguf is not None:
            # The file's Q4/Q8 blocks served as they are (edgespec.loading.gguf_model).
            from edgespec.loading.gguf_model import load_gguf_target
            model, model_dir = load_gguf_target(gguf, dtype=dtype, device=device,
                                                max_positions=source.max_seq_len, drafter_bytes=drafter_bytes)
        else:
            model = load_target(model_dir, dtype=dtype, device=device, max_positions=source.max_seq_len,
                                kv_fp8=source.kv_dtype == "fp8", drafter_bytes=drafter_bytes,
                                vision=source.vision)
        if source.lm_head_weights != "model":
            from edgespec.weights.requantize import quantize_lm_head
            quantize_lm_head(model, source.lm_head_weights)
        if device.type == "cpu" and dtype == torch.float32 and source.cpu_blas:
            # OpenBLAS GEMVs, torch single-threaded (see edgespec.kernels.quant.linear); beside the GGUF products' own
            # pool, OpenBLAS itself single-threaded too (a dense drafter's products on BLAS, the target's on it).
            configure_cpu(own_pool=gguf is not None)
        tokenizer = ChatTokenizer.from_folder(model_dir)
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ConfigError(f"tokenizer of {model_dir} has {tokenizer.vocab_size} tokens but the model's "
                              f"vocab_size is {model.config.vocab_size}")
        return cls(plan, model, tokenizer, model_dir)

    # -- requests -----------------------------------------------------------------------------------------------
    def prompt_ids(self, req: Request) -> list[int]:
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        if req.messages is not None:
            thinking = self.plan.requests.enable_thinking if req.enable_thinking is None else req.enable_thinking
            extra = {"tools": list(req.tools)} if req.tools else {}
            # Control tokens typed in user or tool text stay text (ChatTokenizer.shield).
            messages, shielded = self.tokenizer.shield(req.messages)
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      enable_thinking=thinking, **extra)
            if shielded:
                return self.tokenizer.encode_shielded(text, shielded)
            if self.encoder is not None:
                return self.encoder.encode(text, owner=req.cache_key)
            return self.tokenizer.encode(text)
        if req.prompt is not None:
            return self.tokenizer.encode(req.prompt, add_special_tokens=True)
        raise RequestError("request has neither messages nor prompt")

    def policy_for(self, sampling: SamplingParams) -> AcceptancePolicy:
        if not sampling.greedy:
            return RejectionSampling(sampling, sampling.generator(self.device))
        knobs = self.plan.requests.acceptance
        if knobs.mode == "relaxed_thinking":
            return RelaxedThinking(*self.think_ids, top_k=knobs.top_k, delta=knobs.delta, margin=knobs.margin)
        return StrictGreedy()

    def check(self, req: Request) -> list[int]:
        """Validate a request and tokenise its prompt, before any device work. A request with images gets them
        decoded, preprocessed and placed (``req.vision``); the ids returned are the expanded prompt's."""
        if req.images and req.vision is None:
            self._check_images(req)
        ids = self.prompt_ids(req)
        if req.images and req.vision is None:
            req.vision = VisionPrompt.place(ids, [self._load_image(ref) for ref in req.images], self.image_encoder)
        if req.vision is not None:
            ids = req.vision.ids
        self.session.check_request(len(ids), req.max_tokens, req.num_draft_tokens)
        return ids

    def _check_images(self, req: Request) -> None:
        """The images a request may send: a model with a vision tower, at most ``max_images``."""
        if self.image_encoder is None:
            why = "its vision tower is switched off (vision: false)" if getattr(self.model.config, "vision", None) \
                and not self.plan.model.vision else "it is a text-only model (no vision tower in the checkpoint)"
            raise ImageError(f"model {self.model_id} does not take images: {why}", req.images[0].where)
        if len(req.images) > self.image_limits.max_images:
            raise ImageError(f"{len(req.images)} images in one request; this server takes at most "
                             f"{self.image_limits.max_images} (max_images)", req.images[-1].where)

    def _load_image(self, ref: ImageRef):
        return load_image(ref.data, self.image_processor, self.image_limits, ref.where)

    def complete(self, req: Request) -> Completion:
        """Run one request to the end (streaming through ``req.on_text`` if given), or until ``req.preempt`` pauses
        it (finish ``preempted``, ``req.partial`` set; call again to continue)."""
        part = req.partial
        resumed = part is not None
        if part is None:
            ids = self.check(req)
            part = Partial(ids, [], [], self.tokenizer.detokenizer(stop=req.stop, prompt_ids=ids),
                           self.policy_for(req.sampling), None, -1)
        ids, detok, pieces = part.prompt_ids, part.detok, part.pieces

        def on_tokens(tokens: list[int]) -> bool:
            text = detok.add(tokens)
            if text:
                pieces.append(text)
                if req.on_text is not None:
                    req.on_text(text)
            return detok.stop_hit is not None

        preempted = False

        def stop() -> bool:
            nonlocal preempted
            if req.cancelled is not None and req.cancelled():
                return True
            if req.preempt is not None and req.preempt():
                preempted = True
                return True
            return False

        self._claim_prefix(req.cache_key)
        t0 = time.perf_counter()
        if self.suffix_cache is not None:
            self.suffix_cache.select(req.cache_key)
        span = EnergySpan(self.energy)
        if resumed and req.cancelled is not None and req.cancelled():
            # A paused request ended before it continued (its deadline, a drain): no device work, it ends here.
            result = GenerationResult([], "cancelled", RequestTelemetry(drafter=self.session.drafter_name,
                                                                       prompt_tokens=len(ids)))
        else:
            result = self.session.generate(
                ids + part.tokens, max_tokens=req.max_tokens - len(part.tokens), policy=part.policy,
                stop_ids=self.tokenizer.stop_token_ids, on_tokens=on_tokens, cancelled=stop,
                constraint=req.constraint, k=req.num_draft_tokens, prefix=self.prefix,
                vision=req.vision)
        part.energy = _added_energy(part.energy, span.stop())   # the tokens are on the host: device work done
        result.telemetry.stage_ms["total"] = (time.perf_counter() - t0) * 1000.0
        if part.telemetry is None:       # the first segment's telemetry is the request's (its prompt, its prefill)
            part.telemetry = result.telemetry
        else:
            _merge_telemetry(part.telemetry, result.telemetry)
        part.tokens += result.token_ids
        if part.cached_tokens < 0:   # the first segment's reuse is the request's
            part.cached_tokens = 0 if self.prefix is None else self.prefix.last_reused
        tel = part.telemetry
        if preempted and result.finish_reason == "cancelled":
            req.partial = part
            return Completion("".join(pieces), list(part.tokens), "preempted", len(ids), tel,
                              cached_tokens=part.cached_tokens, energy=part.energy)
        req.partial = None
        tail = detok.finish()
        if tail:
            pieces.append(tail)
            if req.on_text is not None:
                req.on_text(tail)
        if self.suffix_cache is not None:
            self.suffix_cache.add_completion(ids, part.tokens)
        self.totals.add(tel)
        done = Completion("".join(pieces), part.tokens, result.finish_reason, len(ids), tel,
                          reasoning_tokens=self._reasoning_tokens(ids, part.tokens),
                          cached_tokens=part.cached_tokens, energy=part.energy)
        if self.request_log is not None:
            try:
                self.request_log.log_completion(ids, part.tokens, done.text, result.finish_reason,
                                                self.session.drafter_name, tel.acceptance_length)
            except OSError as e:   # a full disk must not fail the request the robot is waiting for
                print(f"edgespec: request log {self.request_log.path} not written: {e}", file=sys.stderr)
        return done

    def _claim_prefix(self, key: str | None) -> None:
        """Reuse the prefix cache only for the client that filled it: another key starts from an empty cache, so
        neither ``cached_tokens`` nor the prefill time tells one client anything about another's prompt."""
        if self.prefix is not None and key != self._prefix_key:
            self.prefix.clear()
        self._prefix_key = key

    def _reasoning_tokens(self, prompt: list[int], out: list[int]) -> int:
        """Tokens generated inside a think block (OpenAI's completion_tokens_details.reasoning_tokens)."""
        if self.think_ids is None:
            return 0
        open_id, close_id = self.think_ids
        inside = False
        for t in reversed(prompt):
            if t in (open_id, close_id):
                inside = t == open_id
                break
        n = 0
        for t in out:
            if t == open_id:
                inside = True
            elif t == close_id:
                inside = False
            elif inside:
                n += 1
        return n


def _added_energy(before: EnergyReading | None, used: EnergyReading | None) -> EnergyReading | None:
    """A request's energy so far plus one segment's (None: not measured)."""
    if used is None:
        return before
    before = before or EnergyReading(0.0, 0.0)
    return EnergyReading(before.joules + used.joules, before.seconds + used.seconds)


def _merge_telemetry(total: RequestTelemetry, seg: RequestTelemetry) -> None:
    """Add one segment of a preempted request to its running telemetry (counts, cycles, stage and decode times)."""
    total.add_counts(seg)
    total.cycles += seg.cycles
    total.generated_tokens += seg.generated_tokens
    total.decode_ms += seg.decode_ms
    for name, ms in seg.stage_ms.items():
        total.stage_ms[name] = total.stage_ms.get(name, 0.0) + ms
