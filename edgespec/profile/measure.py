"""Measuring one candidate on one prompt: decode tok/s, acceptance length, time to first token, peak memory.

The target model and tokenizer are loaded once (:class:`Bench`); each candidate gets its own
:class:`~edgespec.engine.Engine` built around them, exactly as ``Engine.load`` builds the served one (same
hook selection, proposer factory, session and acceptance policy), so what is measured is what the tuned YAML
will run. Building an engine allocates only the candidate's cache and drafter, never the weights again.
"""

from __future__ import annotations

import gc
import hashlib
import resource
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edgespec.bench.prompts import BenchPrompt
from edgespec.config import Settings
from edgespec.engine import Engine
from edgespec.errors import ConfigError
from edgespec.plan import build_plan
from edgespec.speculative.acceptance import AcceptancePolicy, StrictGreedy
from edgespec.speculative.parity import first_divergence
from edgespec.speculative.sampling import SamplingParams
from edgespec.speculative.session import GenerationResult


@dataclass(frozen=True)
class PromptCase:
    """One prompt of the set, rendered with the model's chat template."""

    id: str
    ids: tuple[int, ...]
    thinking: bool
    sha: str            # fingerprint of the prompt text: an edited prompt must not reuse old measurements


def prompt_sha(p: BenchPrompt) -> str:
    return hashlib.sha1(f"{p.thinking}\x00{p.user}".encode()).hexdigest()[:10]


def tokens_sha(tokens: Sequence[int]) -> str:
    return hashlib.sha1(",".join(map(str, tokens)).encode()).hexdigest()[:12]

# One definition of "where two greedy streams part" for the whole project.
first_diff = first_divergence


class Bench:
    """The target model loaded once, and the per-candidate engines built around it."""

    def __init__(self, base: Settings) -> None:
        # Load through Engine.load so device, dtype, demo-model conversion and the tokenizer check are the served
        # path's; with no drafter, so a base config naming an unbuildable drafter still loads.
        loader = Engine.load(build_plan(base.with_overrides(drafter="none", num_draft_tokens=None,
                                                          acceptance="strict")))
        self.base = base
        self.model = loader.model
        self.tokenizer = loader.tokenizer
        self.model_dir: Path = loader.model_dir
        self.device: torch.device = loader.device
        self.arch: str = loader.hooks.name
        self.defaults = loader.hooks.defaults
        self.has_state: bool = bool(getattr(loader.session.cache, "has_state", False))
        self.is_moe: bool = bool(getattr(loader.model.config, "is_moe", False))    # K from verify cost (k_choice)
        del loader
        self.release()

    # -- prompts -------------------------------------------------------------------------------------------------
    def encode(self, prompts: Sequence[BenchPrompt], tokens: int) -> list[PromptCase]:
        """Render every prompt; fail before any measurement when one cannot fit ``max_seq_len``."""
        cases = []
        for p in prompts:
            ids = self.tokenizer.encode_chat([{"role": "user", "content": p.user}], enable_thinking=p.thinking)
            if len(ids) + tokens > self.base.max_seq_len:
                raise ConfigError(f"prompt {p.id!r} has {len(ids)} tokens; with --tokens {tokens} it needs "
                                  f"max_seq_len >= {len(ids) + tokens} (is {self.base.max_seq_len})")
            cases.append(PromptCase(p.id, tuple(ids), p.thinking, prompt_sha(p)))
        return cases

    # -- engines -------------------------------------------------------------------------------------------------
    def open(self, candidate: dict[str, Any]) -> Engine:
        """An engine for ``candidate``; raises ConfigError (or ImportError) when it cannot be built here."""
        plan = build_plan(self.base.with_overrides(**candidate), self.device)
        return Engine.around(plan, self.model, self.tokenizer, self.model_dir)

    def release(self) -> None:
        """Return a dropped engine's cache to the allocator before the next one is built."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- runs ----------------------------------------------------------------------------------------------------
    def run(self, engine: Engine, case: PromptCase, tokens: int, *, plain: bool = False
            ) -> tuple[GenerationResult, AcceptancePolicy]:
        """One greedy generation; ``plain`` = no drafts and strict acceptance (the reference output)."""
        policy: AcceptancePolicy = StrictGreedy() if plain else engine.policy_for(SamplingParams())
        res = engine.session.generate(list(case.ids), max_tokens=tokens, policy=policy,
                                      stop_ids=engine.tokenizer.stop_token_ids, k=0 if plain else None)
        return res, policy

    def measure(self, engine: Engine, case: PromptCase, tokens: int, repeats: int) -> dict[str, Any]:
        """``repeats`` timed generations of ``case``; medians of the timings, counters of the first run."""
        reset_peak_memory(self.device)
        runs = [self.run(engine, case, tokens) for _ in range(max(1, repeats))]
        peak, peak_kind = peak_memory(self.device)
        first, policy = runs[0]
        tel = first.telemetry
        tok_s = [r.telemetry.decode_tok_s for r, _ in runs]
        return {
            "decode_tok_s": round(statistics.median(tok_s), 3),
            "decode_tok_s_runs": [round(x, 3) for x in tok_s],
            "acceptance_length": round(tel.acceptance_length, 4),
            "acceptance_rate": round(tel.acceptance_rate, 4),
            "ttft_ms": round(statistics.median(r.telemetry.stage_ms["prefill"] for r, _ in runs), 3),
            "decode_ms": round(statistics.median(r.telemetry.decode_ms for r, _ in runs), 3),
            "prompt_tokens": len(case.ids),
            "generated_tokens": tel.generated_tokens,
            "finish_reason": first.finish_reason,
            "output_sha": tokens_sha(first.token_ids),
            "stable_across_repeats": all(r.token_ids == first.token_ids for r, _ in runs),
            "relaxed_accepts": int(getattr(policy, "relaxed_accepts", 0)),
            "peak_memory_bytes": peak,
            "peak_memory_kind": peak_kind,
            "resolved": {"drafter": engine.session.drafter_name, "k": engine.session.k,
                         "kv_fp8": bool(engine.session.kv_fp8), "rollback": engine.session.rollback_strategy,
                         "prefill_chunk": engine.session.prefill_chunk,
                         "cuda_graphs": bool(getattr(engine.session, "cuda_graphs", False))},
            "telemetry": tel.to_dict(),
            "_token_ids": list(first.token_ids),   # for the greedy check; not written to the results file
        }


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """Peak bytes since :func:`reset_peak_memory` on CUDA; on CPU the process RSS high-water mark.

    The RSS high-water mark cannot be reset, so on CPU it only ever grows over a run: an upper bound for each
    candidate, not a per-candidate figure.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(rss if sys.platform == "darwin" else rss * 1024), "rss_high_water"
