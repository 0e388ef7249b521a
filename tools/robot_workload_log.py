#!/usr/bin/env python3
"""Write a synthetic robot workload request log: the demo (or any) model answers varied robot requests through the
Engine with ``request_log`` set, exactly as ``edgespec serve`` would log them. Input for
``edgespec distill --from-log`` (docs/drafters.md, on-device adaptation).

    python tools/robot_workload_log.py --out robot_log.jsonl --n 24 --tokens 96 [--model demo] [--seed 7]
"""

from __future__ import annotations

import argparse
import sys
import time

from edgespec.config import Settings
from edgespec.distill.workload import robot_prompts, site_prompts
from edgespec.engine import Engine, Request
from edgespec.plan import build_plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSONL request log to write (appended)")
    p.add_argument("--model", default="demo")
    p.add_argument("--drafter", default="dflash", help="drafter serving the requests (never changes the output)")
    p.add_argument("--n", type=int, default=24, help="requests")
    p.add_argument("--tokens", type=int, default=96, help="max tokens per reply")
    p.add_argument("--seed", type=int, default=7, help="workload seed (the demo drafter's data used seed 0)")
    p.add_argument("--workload", choices=("robot", "site"), default="robot",
                   help="robot: the generic robot workload the demo drafter was trained on; site: one warehouse "
                   "cell's own traffic (its item names, locations and JSON schema), new to that drafter")
    args = p.parse_args(argv)
    engine = Engine.load(build_plan(Settings(model=args.model, drafter=args.drafter, request_log=args.out,
                                           max_tokens=args.tokens)))
    t0 = time.time()
    make = site_prompts if args.workload == "site" else robot_prompts
    for i, text in enumerate(make(args.n, seed=args.seed)):
        out = engine.complete(Request(messages=[{"role": "user", "content": text}], max_tokens=args.tokens))
        print(f"{i + 1}/{args.n} {time.time() - t0:.0f}s {out.telemetry.summary()}", file=sys.stderr, flush=True)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
