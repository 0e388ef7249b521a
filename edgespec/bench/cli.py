"""``edgespec bench``: plain vs speculative decoding on the bench prompts, optionally beside transformers.

For each prompt it runs edgespec plain and edgespec with the configured drafter (and with ``--compare-hf``,
transformers' plain greedy ``generate`` and prompt-lookup generation on the same checkpoint, in the same process),
after one warm-up, and prints decode tok/s and acceptance length. Decode speed counts the tokens after the first
over the time after the first, for every runner alike.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from edgespec.bench.prompts import BenchPrompt, load_prompts
from edgespec.config import load_settings
from edgespec.speculative.parity import describe_divergence, tie_check


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", help="GPU sweep over random-weight model shapes instead of the prompt benchmark "
                   "(comma list of edgespec.loading.synthetic.SHAPES names)")
    p.add_argument("--compare-hf-shapes", default="qwen3.5-4b", help="with --shapes: shapes also run in transformers")
    p.add_argument("--context", type=int, default=512, help="with --shapes: KV context of decode and verify")
    p.add_argument("--kv", default="model,fp8", help="with --shapes: KV formats (none: no decode sweep)")
    p.add_argument("--attn-in-place", action="store_true", help="with --shapes: also time one attention call "
                   "inside a decode step at --context, FP8 vs model-dtype KV (edgespec.bench.attn_in_place)")
    p.add_argument("--sweep-out", default=".", help="with --shapes: folder for gpu_bench.json")
    p.add_argument("--formats", help="weight-format comparison instead of the prompt benchmark: comma list of "
                   "dense,fp8,nvfp4,int4 on one random shape (edgespec.bench.formats)")
    p.add_argument("--format-shape", default="smollm2-135m", help="with --formats: a SHAPES name or tiny:FAMILY")
    p.add_argument("--group-size", type=int, default=128, help="with --formats: int4 group size")
    p.add_argument("--format-prefill", default="", help="with --formats: comma list of prompt lengths whose "
                   "whole-model prefill rate is also timed (e.g. 512,2048)")
    p.add_argument("--format-iters", type=int, default=10, help="with --formats: decode steps per timing")
    p.add_argument("--format-verify-rows", type=int, default=16, help="with --formats: rows of the verify forward "
                   "also timed (a speculative cycle's; 1: none)")
    p.add_argument("--prompts", help="prompt set YAML (default: the packaged bench set)")
    p.add_argument("--tokens", type=int, default=128, help="max new tokens per prompt")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per prompt (median reported)")
    p.add_argument("--compare-hf", action="store_true", help="also run transformers plain and prompt lookup")
    p.add_argument("--hf-lookup-tokens", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    p.add_argument("--out", help="write every figure as JSON here")
    p.add_argument("--multi-turn", action="store_true", help="agent conversation: time to first token per turn with "
                   "and without prefix reuse")
    p.add_argument("--turns", type=int, default=4, help="with --multi-turn: conversation turns")
    p.add_argument("--history-tokens", type=int, default=3000, help="with --multi-turn: tokens of history in turn 0")
    p.add_argument("--tree", metavar="BUDGET", help="also run the drafter with tree verification of this node budget "
                   "(or auto), beside its chain, per prompt")
    p.add_argument("--random-model", metavar="SHAPE", help="bench random weights of this SHAPES name instead of "
                   "--model, written on first use into the cache (edgespec.bench.random_model)")
    p.add_argument("--sm-limit", type=int, default=0, help="CUDA: run every mode on a green context of this many SMs "
                   "(Thor has 20; Hopper grants multiples of 8), the granted count read back and printed")
    p.add_argument("--bench-tokenizer", default="demo", help="with --random-model: demo (the demo's BPE "
                   "tokenizer), byte, or a folder with tokenizer.json (tools/make_bench_model.py --tokenizer-only)")


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _run_edgespec(engine, ids: list[int], tokens: int, k: int | None, tree: int | None = None) -> dict[str, Any]:
    from edgespec.speculative.acceptance import StrictGreedy

    budget, engine.session.tree_budget = engine.session.tree_budget, tree      # chain (None) or tree, this run
    try:
        res = engine.session.generate(ids, max_tokens=tokens, policy=StrictGreedy(),
                                      stop_ids=engine.tokenizer.stop_token_ids, k=k)
    finally:
        engine.session.tree_budget = budget
    t = res.telemetry
    return {"tokens": res.token_ids, "tok_s": t.decode_tok_s, "al": t.acceptance_length,
            "telemetry": t.to_dict()}


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Run transformers with torch's usual intra-op threads (edgespec's CPU path runs torch single-threaded and
    lets OpenBLAS use the cores; see edgespec.kernels.linear), so the peer gets the setup it is tuned for."""
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


def run_bench(args: argparse.Namespace) -> int:
    from edgespec.engine import Engine

    if getattr(args, "sm_limit", 0):
        from edgespec.bench.sm_limit import limit_sms
        from edgespec.errors import ConfigError
        try:
            print(limit_sms(args.sm_limit).describe(), flush=True)   # before anything else runs on the GPU
        except (ValueError, RuntimeError) as e:
            raise ConfigError(str(e)) from e
    if args.formats:
        from edgespec.bench.formats import run_format_bench

        return run_format_bench(args)
    if args.shapes:
        from edgespec.bench.gpu import run_sweep

        args.compare_hf = args.compare_hf_shapes
        args.no_graphs = False
        return run_sweep(args)

    hf_threads = torch.get_num_threads()   # torch's default, before the engine configures its CPU path
    settings = load_settings(cli=args)
    if args.random_model:
        from edgespec.bench.random_model import bench_model
        settings = settings.with_overrides(model=str(bench_model(args.random_model, args.bench_tokenizer)))
    if settings.drafter == "none":
        settings = settings.with_overrides(drafter="ngram")
    if args.tree:
        settings = settings.with_overrides(draft_tree=args.tree)
    engine = Engine.from_settings(settings)
    tree = engine.session.tree_budget
    if args.multi_turn:
        from edgespec.bench.multiturn import run_multi_turn

        figures = run_multi_turn(engine, args)
        if args.out:
            Path(args.out).write_text(json.dumps(figures, indent=2))
        return 0
    prompts = load_prompts(args.prompts)
    hf = None
    if args.compare_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=engine.model.dtype).eval()
    eos = engine.tokenizer.stop_token_ids
    rows = []
    header = f"{'prompt':<26} {'runner':<22} {'tok/s':>8} {'AL':>6} {'tokens':>6} same-as-plain"
    print(f"device={engine.device} threads={torch.get_num_threads()} hf_threads={hf_threads} "
          f"model={engine.model_dir.name} drafter={settings.drafter} K={engine.session.k}")
    print(header)
    for pr in prompts:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": pr.user}], enable_thinking=pr.thinking)
        runners = {
            "edgespec plain": lambda ids=ids: _run_edgespec(engine, ids, args.tokens, 0),
            f"edgespec {settings.drafter}": lambda ids=ids: _run_edgespec(engine, ids, args.tokens, None),
        }
        if tree:
            runners[f"edgespec {settings.drafter} tree{tree}"] = lambda ids=ids: _run_edgespec(
                engine, ids, args.tokens, None, tree)
        if hf is not None:
            runners["hf plain"] = lambda ids=ids: _run_hf(hf, ids, args.tokens, eos, None, hf_threads)
            runners["hf prompt-lookup"] = lambda ids=ids: _run_hf(hf, ids, args.tokens, eos, args.hf_lookup_tokens,
                                                                 hf_threads)
        plain_tokens = None
        for name, fn in runners.items():
            fn()  # warm-up
            runs = [fn() for _ in range(max(1, args.repeats))]
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
            rows.append(row)
            al = f"{row['al']:.2f}" if row["al"] is not None else "-"
            print(f"{pr.id:<26} {name:<22} {tok_s:>8.1f} {al:>6} {len(best['tokens']):>6} {verdict}", flush=True)
    from edgespec.memory import format_bytes, peak_bytes
    budget = engine.model.memory_budget
    peak = peak_bytes(engine.device)
    print(f"memory budget: {budget.summary() if budget else 'n/a'}")
    kind = "CUDA allocator" if engine.device.type == "cuda" else "process peak RSS"
    print(f"measured peak: {format_bytes(peak)} ({kind})")
    if args.out:
        meta = {"device": str(engine.device), "cpu": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(), "hf_threads": hf_threads, "torch": torch.__version__,
                "model": str(engine.model_dir),
                "settings": {"drafter": settings.drafter, "k": engine.session.k, "dtype": str(engine.model.dtype)},
                "tokens": args.tokens, "repeats": args.repeats, "peak_memory_bytes": peak,
                "memory_budget": budget.to_dict() if budget else None}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


__all__ = ["BenchPrompt", "add_bench_arguments", "run_bench"]
