"""``edgespec bench prompts``: plain vs speculative decoding on the bench prompts, optionally beside transformers.

For each prompt it runs edgespec plain and edgespec with the configured drafter (with ``--tree``, that drafter with
tree verification too; with ``--compare-hf``, transformers' plain greedy ``generate`` and prompt-lookup generation
on the same checkpoint, in the same process), after one warm-up, and prints decode tok/s and acceptance length.
Decode speed counts the tokens after the first over the time after the first, for every runner alike.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from edgespec.bench.prompts import BenchPrompt, load_prompts
from edgespec.config import Settings
from edgespec.engine import Engine
from edgespec.plan import build_plan
from edgespec.speculative.parity import describe_divergence, tie_check

Runner = Callable[[], dict[str, Any]]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _run_edgespec(engine: Engine, ids: list[int], tokens: int, k: int | None,
                  tree: bool = False) -> dict[str, Any]:
    from edgespec.energy import EnergySpan
    from edgespec.speculative.acceptance import StrictGreedy

    session = engine.session
    held = session.cycles
    session.cycles = held if tree else held.chain          # the session's trees, or chains, this run
    span = EnergySpan(engine.energy)     # None on CPU: no energy figures
    try:
        res = session.generate(ids, max_tokens=tokens, policy=StrictGreedy(),
                               stop_ids=engine.tokenizer.stop_token_ids, k=k)
    finally:
        session.cycles = held
    used = span.stop()
    t = res.telemetry
    out = {"tokens": res.token_ids, "tok_s": t.decode_tok_s, "al": t.acceptance_length, "telemetry": t.to_dict()}
    if used is not None:
        out.update(joules_per_token=used.per_token(len(res.token_ids)), avg_watts=used.watts)
    return out


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Run transformers with torch's usual intra-op threads (edgespec's CPU path runs torch single-threaded and
    lets OpenBLAS use the cores; see edgespec.kernels.quant.linear), so the peer gets the setup it is tuned for."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_hf(model, ids: list[int], tokens: int, eos: list[int], lookup: int | None,
            threads: int) -> dict[str, Any]:
    inp = torch.tensor([ids])
    kw: dict[str, Any] = dict(do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup
    with torch.inference_mode(), _torch_threads(threads):
        t0 = time.perf_counter()
        model.generate(inp, max_new_tokens=1, min_new_tokens=1, **kw)
        t_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(inp, max_new_tokens=tokens, **kw)
        t_all = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    n = len(new)
    while new and new[-1] in eos:      # transformers keeps the stop token; edgespec drops it
        new.pop()
    return {"tokens": new, "tok_s": (n - 1) / max(t_all - t_first, 1e-9) if n > 1 else 0.0}


def _runners(engine: Engine, settings: Settings, args: argparse.Namespace, ids: list[int], hf,
             hf_threads: int) -> dict[str, Runner]:
    """Every runner of one prompt by name, plain first (the output the others must equal)."""
    cycles = engine.session.cycles
    runners: dict[str, Runner] = {
        "edgespec plain": lambda: _run_edgespec(engine, ids, args.tokens, 0),
        f"edgespec {settings.drafter}": lambda: _run_edgespec(engine, ids, args.tokens, None),
    }
    if cycles is not cycles.chain:       # a tree session: its trees too
        runners[f"edgespec {settings.drafter} {cycles.label}"] = lambda: _run_edgespec(engine, ids, args.tokens,
                                                                                        None, tree=True)
    if hf is not None:
        eos = engine.tokenizer.stop_token_ids
        runners["hf plain"] = lambda: _run_hf(hf, ids, args.tokens, eos, None, hf_threads)
        runners["hf prompt-lookup"] = lambda: _run_hf(hf, ids, args.tokens, eos, args.hf_lookup_tokens, hf_threads)
    return runners


def _bench_prompt(engine: Engine, pr: BenchPrompt, runners: dict[str, Runner], ids: list[int],
                  repeats: int) -> list[dict[str, Any]]:
    """One row per runner on one prompt: warm-up, ``repeats`` timed runs (median tok/s), same-as-plain (in bf16 a
    difference is checked for a tie flip), energy where metered; each row printed as it is done."""
    rows = []
    plain_tokens = None
    for name, fn in runners.items():
        fn()  # warm-up
        runs = [fn() for _ in range(max(1, repeats))]
        best = runs[0]
        tok_s = _median([r["tok_s"] for r in runs])
        if plain_tokens is None:
            plain_tokens = best["tokens"]
        same = best["tokens"] == plain_tokens
        row = {"prompt": pr.id, "runner": name, "tok_s": round(tok_s, 2), "al": best.get("al"),
               "tokens": len(best["tokens"]), "same_as_plain": same, "telemetry": best.get("telemetry")}
        verdict = str(same)
        if not same and name.startswith("edgespec") and engine.model.dtype != torch.float32:
            row.update(tie_check(engine.model, ids, plain_tokens, best["tokens"], engine.session.kv_fp8))
            verdict = f"False: {describe_divergence(row)}"
        if best.get("joules_per_token") is not None:
            row.update(joules_per_token=best["joules_per_token"], avg_watts=best["avg_watts"])
            verdict += f"  {best['joules_per_token']:.4f} J/token {best['avg_watts']:.0f} W"
        rows.append(row)
        al = f"{row['al']:.2f}" if row["al"] is not None else "-"
        print(f"{pr.id:<26} {name:<22} {tok_s:>8.1f} {al:>6} {len(best['tokens']):>6} {verdict}", flush=True)
    return rows


def _memory_meta(engine: Engine) -> dict[str, Any]:
    """Print the memory budget and the measured peak; return both for the JSON."""
    from edgespec.memory import format_bytes, peak_bytes

    budget = engine.model.memory_budget
    peak = peak_bytes(engine.device)
    print(f"memory budget: {budget.summary() if budget else 'n/a'}")
    kind = "CUDA allocator" if engine.device.type == "cuda" else "process peak RSS"
    print(f"measured peak: {format_bytes(peak)} ({kind})")
    return {"peak_memory_bytes": peak, "memory_budget": budget.to_dict() if budget else None}


def run_prompt_bench(args: argparse.Namespace, settings: Settings, hf_threads: int) -> int:
    """Every bench prompt through every runner; a table as it goes, the memory figures last, JSON to ``--out``.
    ``hf_threads``: torch's thread count before the engine set its CPU path (transformers runs with it)."""
    engine = Engine.load(build_plan(settings))
    hf = None
    if args.compare_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=engine.model.dtype).eval()
    print(f"device={engine.device} threads={torch.get_num_threads()} hf_threads={hf_threads} "
          f"model={engine.model_dir.name} drafter={settings.drafter} K={engine.session.k}")
    print(f"{'prompt':<26} {'runner':<22} {'tok/s':>8} {'AL':>6} {'tokens':>6} same-as-plain")
    rows = []
    for pr in load_prompts(args.prompts):
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": pr.user}], enable_thinking=pr.thinking)
        rows += _bench_prompt(engine, pr, _runners(engine, settings, args, ids, hf, hf_threads), ids, args.repeats)
    memory = _memory_meta(engine)
    if args.out:
        meta = {"device": str(engine.device), "cpu": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(), "hf_threads": hf_threads, "torch": torch.__version__,
                "model": str(engine.model_dir),
                "settings": {"drafter": settings.drafter, "k": engine.session.k, "dtype": str(engine.model.dtype)},
                "tokens": args.tokens, "repeats": args.repeats, **memory}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0
