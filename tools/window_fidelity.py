#!/usr/bin/env python3
"""Context fidelity of a DFlash drafter: acceptance length with the per-token window W=128 (the default) against a
window that covers the whole context, on robot prompts of 1-2k tokens (a long event log, then a request).

    python tools/window_fidelity.py [--model demo] [--drafter-path DIR] [--windows 128,2304] [--tokens 64]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from edgespec.config import Settings
from edgespec.engine import Engine, Request
from edgespec.plan import build_plan

_EVENTS = ["picked up the {c} {o} from the {p}", "placed the {c} {o} on the {p}", "moved to the {p}",
           "detected an obstacle near the {p}", "battery at {n} percent", "gripper force set to {n} newtons",
           "waiting for the {c} {o} to arrive at the {p}", "scanned the {p}: {n} objects found"]
_C = ["red", "blue", "green", "yellow", "black"]
_O = ["cube", "cup", "bottle", "box", "bolt"]
_P = ["tray", "shelf A", "shelf B", "bin", "conveyor belt", "charging dock"]


def long_prompt(lines: int, seed: int) -> str:
    rng = random.Random(seed)
    log = "\n".join(f"[{i:04d}] robot " + rng.choice(_EVENTS).format(c=rng.choice(_C), o=rng.choice(_O),
                                                                       p=rng.choice(_P), n=rng.randint(5, 99))
                    for i in range(lines))
    return (f"Here is the robot's event log:\n{log}\n\nOutput a compact JSON list of the objects the robot "
            f"handled, with fields object, colour, last_location and count.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--drafter-path", default=None)
    p.add_argument("--windows", default="128,2304")
    p.add_argument("--lines", default="70,120", help="event-log lines per prompt (about 14 tokens each)")
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args(argv)
    windows = [int(w) for w in args.windows.split(",")]
    prompts = [long_prompt(int(n), seed=i) for i, n in enumerate(args.lines.split(","))]
    base = Settings(model=args.model, drafter="dflash", drafter_path=args.drafter_path, max_tokens=args.tokens,
                    max_seq_len=4096)
    outputs: dict[int, list[list[int]]] = {}
    print(f"{'prompt_tokens':>13} {'W':>6} {'AL':>6} {'tok/s':>7} {'s':>6}")
    for w in windows:
        engine = Engine.load(build_plan(base.with_overrides(window_size=w)))
        outputs[w] = []
        for text in prompts:
            t0 = time.time()
            out = engine.complete(Request(messages=[{"role": "user", "content": text}], max_tokens=args.tokens))
            outputs[w].append(out.token_ids)
            t = out.telemetry
            print(f"{out.prompt_tokens:>13} {w:>6} {t.acceptance_length:>6.2f} {t.decode_tok_s:>7.2f} "
                  f"{time.time() - t0:>6.1f}", flush=True)
    same = all(outputs[w] == outputs[windows[0]] for w in windows)
    print(f"outputs identical across windows (lossless): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
