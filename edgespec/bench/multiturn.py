"""``edgespec bench multi-turn``: an agent conversation, time to first token per turn with and without prefix reuse.

Two engines share one loaded model (each has its own cache): one resumes every turn from its cached prefix, the
other prefills the whole conversation each time, as every request did before prefix reuse. Each turn runs on both,
interleaved, so machine load affects both columns alike; the answers must be identical. Turn 0 carries a long
history (``--history-tokens``, an earlier log of the robot's session); each later turn adds the previous answer and
a short instruction (about 50 tokens).

TTFT here = chat-template rendering and tokenisation + prefill (which ends with the first token chosen): the
engine-side time a client waits for its first token, without HTTP.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

import torch

from edgespec.bench.prompts import load_prompts
from edgespec.engine import Engine, Request
from edgespec.errors import ConfigError
from edgespec.speculative.parity import describe_divergence, tie_check

INSTRUCTIONS = [
    "The gripper reports the cup is slipping. Re-grip it with more force, then place it on the left shelf and "
    "confirm the final pose of the arm in one sentence.",
    "Now the operator asks for the red block. Find it on the table, pick it up carefully and put it in the bin "
    "next to the sink; say what you did.",
    "A person walked into the workspace. Stop the current motion, wait until the area is clear, and tell me how "
    "you decided that it was safe to continue.",
    "Battery is at twenty percent. Finish the current task, park the arm in its home position and summarise the "
    "tasks completed during this session.",
]


def history_text(engine: Engine, tokens: int, prompts_path: str | None) -> str:
    """An earlier session log of about ``tokens`` tokens, built from the bench prompt set. Each line's tokens are
    counted once (re-encoding the growing log on every line was quadratic in its length); merges across line ends
    make the sum approximate, which "about" allows."""
    pieces = [f"[{i:03d}] operator: {p.user}\n" for i, p in enumerate(load_prompts(prompts_path))]
    counts = [max(1, len(engine.tokenizer.encode(piece))) for piece in pieces]
    parts, total, i = [], 0, 0
    while total < tokens:
        parts.append(pieces[i % len(pieces)])
        total += counts[i % len(pieces)]
        i += 1
    return "".join(parts)


def _turn(engine: Engine, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    ids = engine.prompt_ids(Request(messages=messages))
    template_ms = (time.perf_counter() - t0) * 1000.0
    c = engine.complete(Request(prompt_ids=ids, max_tokens=max_tokens))
    prefill_ms = c.telemetry.stage_ms.get("prefill", 0.0)
    return {"ttft_ms": template_ms + prefill_ms, "prefill_ms": prefill_ms, "prompt": c.prompt_tokens,
            "cached": c.cached_tokens, "tokens": c.token_ids, "text": c.text, "ids": ids}


def run_multi_turn(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    """Run the scenario, print one row per turn, return every figure."""
    if engine.prefix is None:
        raise ConfigError("--multi-turn compares with and without prefix reuse: leave prefix_reuse on")
    plan = engine.plan
    fresh = Engine.around(replace(plan, requests=replace(plan.requests, prefix_reuse=False)), engine.model,
                          engine.tokenizer, engine.model_dir)
    # Warm-up, untimed: a short conversation of two turns on both engines, so kernel compilation and CUDA-graph
    # capture of the fresh and the resumed prefill paths fall outside the timed turns (a first resumed prefill on
    # a GPU compiled for seconds).
    warm = [{"role": "system", "content": "Warm-up. " + history_text(engine, min(256, args.history_tokens),
                                                                      args.prompts)}]
    for turn in range(2):
        warm.append({"role": "user", "content": INSTRUCTIONS[turn]})
        for e in (engine, fresh):
            out = _turn(e, warm, args.tokens)
        warm.append({"role": "assistant", "content": out["text"]})
    history = history_text(engine, args.history_tokens, args.prompts)
    system = ("You control a 6-axis robot arm in a kitchen. Keep answers short. Session log so far:\n" + history)
    messages = [{"role": "system", "content": system}]
    print(f"multi-turn: device={engine.device} model={engine.model_dir.name} drafter={engine.session.drafter_name} "
          f"tokenizer={engine.tokenizer.vocab_size} ids answer<={args.tokens} tokens")
    print(f"{'turn':>4} {'prompt':>7} {'new':>5} {'ttft reuse ms':>14} {'ttft fresh ms':>14} {'ratio':>7} same")
    rows = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": INSTRUCTIONS[turn % len(INSTRUCTIONS)]})
        a = _turn(engine, messages, args.tokens)
        b = _turn(fresh, messages, args.tokens)
        same = a["tokens"] == b["tokens"]
        ratio = a["ttft_ms"] / max(b["ttft_ms"], 1e-9)
        row = {"turn": turn, "prompt_tokens": a["prompt"], "new_tokens": a["prompt"] - a["cached"],
               "ttft_reuse_ms": round(a["ttft_ms"], 2), "ttft_fresh_ms": round(b["ttft_ms"], 2),
               "prefill_reuse_ms": round(a["prefill_ms"], 2), "prefill_fresh_ms": round(b["prefill_ms"], 2),
               "ratio": round(ratio, 4), "same_output": same}
        verdict = "yes" if same else "NO"
        if not same and engine.model.dtype != torch.float32:
            # bf16/fp16: a resumed and a whole prefill run different kernel shapes; name a tie flip as such
            row.update(tie_check(fresh.model, b["ids"], b["tokens"], a["tokens"], fresh.session.kv_fp8))
            verdict = f"NO: {describe_divergence(row)}"
        rows.append(row)
        print(f"{turn:>4} {a['prompt']:>7} {a['prompt'] - a['cached']:>5} {a['ttft_ms']:>14.1f} {b['ttft_ms']:>14.1f} "
              f"{ratio:>7.3f} {verdict}")
        messages.append({"role": "assistant", "content": a["text"]})
    follow = rows[1:]
    if follow:
        new = sorted(r["new_tokens"] for r in follow)
        ratios = sorted(r["ratio"] for r in follow)
        if all(r["same_output"] for r in rows):
            answers = "identical"
        elif all(r["same_output"] or r.get("tie_flip") for r in rows):
            answers = "identical up to bf16 tie flips"
        else:
            answers = "DIFFER"
        print(f"follow-up turns: new tokens {new[0]}-{new[-1]} after a {rows[0]['prompt_tokens']}-token turn 0; "
              f"ttft ratio {ratios[0]:.3f}-{ratios[-1]:.3f} (median {ratios[len(ratios) // 2]:.3f}); "
              f"answers {answers}")
    return {"multi_turn": rows}
