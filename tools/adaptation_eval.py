#!/usr/bin/env python3
"""Before/after of on-device adaptation: the acceptance length each drafter reaches, served by the engine, on the
held-out requests of a request log (the split `edgespec distill --from-log --holdout-every N` held out), and whether
each reply still equals the logged one (it must: the target verifies every draft).

    python tools/adaptation_eval.py LOG.jsonl GENERIC_DRAFTER ADAPTED_DRAFTER [...] [--holdout-every 5] [--n 8]
"""

from __future__ import annotations

import argparse
import sys

import torch

from edgespec.config import Settings
from edgespec.distill.data import Sequence_
from edgespec.distill.request_log import read_log
from edgespec.distill.train import is_held_out
from edgespec.engine import Engine, Request
from edgespec.plan import build_plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", help="request log (JSONL) the drafters were adapted on")
    p.add_argument("drafters", nargs="+", help="DFlash drafter folders to compare")
    p.add_argument("--model", default="demo")
    p.add_argument("--holdout-every", type=int, default=5, help="the split distill used (--holdout-every)")
    p.add_argument("--n", type=int, default=8, help="held-out requests to serve")
    args = p.parse_args(argv)
    held = [(prompt, output) for prompt, output in read_log(args.log)
            if is_held_out(Sequence_(torch.tensor(prompt + output), len(prompt), torch.empty(0)), args.holdout_every)]
    held = held[:args.n]
    if not held:
        print(f"{args.log}: no held-out request at --holdout-every {args.holdout_every}", file=sys.stderr)
        return 2
    engines = {d: Engine.load(build_plan(Settings(model=args.model, drafter="dflash", drafter_path=d))) for d in
               args.drafters}
    als: dict[str, list[float]] = {d: [] for d in args.drafters}
    same = True
    print(" | ".join(["request"] + args.drafters))
    for i, (prompt, output) in enumerate(held):
        cells = [f"{i}"]
        for d, engine in engines.items():
            out = engine.complete(Request(prompt_ids=prompt, max_tokens=len(output)))
            al = out.telemetry.acceptance_length
            als[d].append(al)
            same &= out.token_ids == output
            cells.append(f"AL {al:.2f}{'' if out.token_ids == output else ' DIFFERS'}")
        print(" | ".join(cells), flush=True)
    print(" | ".join(["mean"] + [f"AL {sum(v) / len(v):.2f}" for v in als.values()]))
    print(f"replies equal to the log: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
