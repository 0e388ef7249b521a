"""``edgespec bench --device cpu --peer llama.cpp`` (``edgespec bench peer``): edgespec against llama.cpp on the same
GGUF, on this CPU, with the same threads, interleaved.

``--llama-bench`` names the binary (``tools/peer_llamacpp_cpu.sh`` builds one from the ``llama-cpp-python``
source distribution, cached under ``$EDGESPEC_PEER_DIR``, default ``~/.cache/edgespec/peer``). Each repeat runs
``llama-bench`` (prompt ``pp`` and decode ``tg`` speed) and then edgespec on the same file: prefill of a prompt of
the same length, plain greedy decode, n-gram speculation and (the demo GGUF: its packaged drafter) DFlash
speculation behind the n-gram lookup, on the robot navigation and repeated-text bench prompts; and the DFlash
draft step alone (the lookup off) against a plain target step. Medians over the repeats are printed with the load
average seen during the run, the ratios against the targets (plain >= llama.cpp decode, n-gram >= 1.5x, prefill >=
llama.cpp prompt, draft step <= 1/3 of a target step, peak RSS <= 400 MiB), and the bandwidth limit of this
machine: the bytes one decode step reads over the memory read bandwidth measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import torch

PROMPTS = ("robot_navigation_plan", "repeated_text_stress")
RSS_TARGET_MIB = 400
DRAFT_STEP_TARGET = 1 / 3     # the DFlash draft step, as a share of a plain target step


def read_bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """Memory read bandwidth (GB/s) of one numpy reduction over ``mib`` MiB (beyond any cache), best of
    ``repeats``."""
    a = np.ones(mib * (1 << 20) // 4, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def llama_bench(binary: str, gguf: Path, prompt: int, tokens: int, threads: int) -> dict[str, float]:
    """``{"pp": tok/s, "tg": tok/s}`` from one llama-bench run (one repetition each)."""
    out = subprocess.run([binary, "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(tokens),
                          "-r", "1", "-o", "json"], capture_output=True, text=True, check=True).stdout
    result = {}
    for row in json.loads(out):
        kind = "pp" if row.get("n_prompt", 0) > 0 else "tg"
        result[kind] = float(row["avg_ts"])
    return result


def edgespec_run(engine, prompt_len: int, tokens: int) -> dict[str, float]:
    """Prefill tok/s of ``prompt_len`` tokens; plain and n-gram decode tok/s (and AL) on :data:`PROMPTS`."""
    from edgespec.bench.prompts import load_prompts
    from edgespec.speculative.acceptance import StrictGreedy

    model = engine.model
    ids = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(prompt_len + 1)
    t0 = time.perf_counter()
    model.forward(ids, cache, logits="last")
    out: dict[str, float] = {"pp": prompt_len / (time.perf_counter() - t0)}
    prompts = {p.id: p for p in load_prompts(None)}
    for pid in PROMPTS:
        chat = engine.tokenizer.encode_chat([{"role": "user", "content": prompts[pid].user}])
        for name, k in (("plain", 0), ("ngram", None)):
            res = engine.session.generate(chat, max_tokens=tokens, policy=StrictGreedy(),
                                          stop_ids=engine.tokenizer.stop_token_ids, k=k)
            out[f"{pid}/{name}"] = res.telemetry.decode_tok_s
            if k is None:
                out[f"{pid}/al"] = res.telemetry.acceptance_length
    return out


def _check_inputs(args: argparse.Namespace) -> None:
    """The GGUF and the llama-bench binary exist (and the counts are positive) before anything is loaded."""
    from edgespec.errors import ConfigError

    if not Path(args.gguf).is_file():
        raise ConfigError(f"--gguf {args.gguf}: no such file")
    if not (Path(args.llama_bench).is_file() and os.access(args.llama_bench, os.X_OK)):
        raise ConfigError(f"--llama-bench {args.llama_bench}: no executable there (tools/peer_llamacpp_cpu.sh "
                          "builds one)")
    for flag in ("repeats", "prompt", "tokens", "threads"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag} {getattr(args, flag)} must be 1 or more")


def _interleaved_runs(args: argparse.Namespace, engine) -> list[dict[str, Any]]:
    """Warm-up of both sides, then ``--repeats`` rounds of llama-bench followed by edgespec, each printed."""
    edgespec_run(engine, args.prompt, 16)   # warm-up (first products, page cache)
    llama_bench(args.llama_bench, args.gguf, 8, 8, args.threads)
    runs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        lc = llama_bench(args.llama_bench, args.gguf, args.prompt, args.tokens, args.threads)
        load1 = os.getloadavg()[0]
        es = edgespec_run(engine, args.prompt, args.tokens)
        runs.append({"llama.cpp": lc, "edgespec": es, "load1": [load1, os.getloadavg()[0]]})
        print(f"repeat {r + 1}: llama.cpp {json.dumps({k: round(v, 1) for k, v in lc.items()})} | edgespec "
              f"{json.dumps({k: round(v, 2) for k, v in es.items()})} | load {load1:.2f}", flush=True)
    return runs


def _summary(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats, printed against llama.cpp with the targets (plain >= 1.0x and n-gram >= 1.5x its
    decode, the RSS and draft-step bounds above), each met or MISSED."""
    def med(side: str, key: str) -> float:
        return median(run[side][key] for run in runs)

    lc_tg, lc_pp = med("llama.cpp", "tg"), med("llama.cpp", "pp")
    loads = [x for run in runs for x in run["load1"]]
    print(f"\nmedians of {args.repeats} interleaved repeats; load average (1 min) {min(loads):.2f}-{max(loads):.2f}; "
          f"threads {args.threads}")
    print(f"{'':34} {'tok/s':>8} {'vs llama.cpp':>13} target")
    print(f"{'llama.cpp prompt (pp' + str(args.prompt) + ')':34} {lc_pp:>8.1f}")
    print(f"{'llama.cpp decode (tg' + str(args.tokens) + ')':34} {lc_tg:>8.1f}")
    pp = med("edgespec", "pp")
    print(f"{'edgespec prefill':34} {pp:>8.1f} {pp / lc_pp:>12.2f}x >= 1.00x {'met' if pp >= lc_pp else 'MISSED'}")
    summary: dict[str, Any] = {"llama.cpp": {"pp": lc_pp, "tg": lc_tg}, "edgespec": {"pp": pp}}
    for pid in PROMPTS:
        for name, target in (("plain", 1.0), ("ngram", 1.5)):
            v = med("edgespec", f"{pid}/{name}")
            summary["edgespec"][f"{pid}/{name}"] = v
            label = f"edgespec {name} {pid}"
            extra = f" AL {med('edgespec', pid + '/al'):.2f}" if name == "ngram" else ""
            print(f"{label:34} {v:>8.1f} {v / lc_tg:>12.2f}x >= {target:.2f}x "
                  f"{'met' if v >= target * lc_tg else 'MISSED'}{extra}")
    return summary


def run_peer(args: argparse.Namespace) -> int:
    """Entry of ``edgespec bench peer``: the interleaved runs, the medians against llama.cpp, the bandwidth limit
    of one decode step and the peak RSS; every figure to ``--out`` as JSON."""
    from edgespec.config import Settings
    from edgespec.engine import Engine
    from edgespec.plan import build_plan
    from edgespec.weights.base import is_packed

    _check_inputs(args)
    # Both sides run the same thread count: edgespec's GGUF products take it as their kernel option.
    engine = Engine.load(build_plan(Settings(model=str(args.gguf), drafter="ngram", max_seq_len=1024,
                                           gguf_threads=args.threads)))
    step_bytes = sum(m.nbytes for m in engine.model.modules() if is_packed(m))
    step_bytes += sum(p.numel() * p.element_size() for p in engine.model.parameters())
    runs = _interleaved_runs(args, engine)
    bw = read_bandwidth_gbs()
    summary = _summary(args, runs)
    limit = bw * 1e9 / step_bytes
    print(f"\nbytes one decode step reads (packed weights + dense parameters): {step_bytes / 1e6:.1f} MB; "
          f"read bandwidth (numpy sum of 256 MiB) {bw:.1f} GB/s -> bandwidth limit {limit:.0f} tok/s; "
          f"llama.cpp decode at {summary['llama.cpp']['tg'] / limit:.0%} of it")
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"edgespec peak RSS {rss:.0f} MiB (process: torch, tokenizer, model, caches)")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "medians": summary, "bandwidth_gbs": bw,
                                              "step_bytes": step_bytes, "threads": args.threads}, indent=2))
    return 0
