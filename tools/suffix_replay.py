"""Record a robot-request stream's plain outputs once, then replay them through the n-gram or suffix drafter.

    python tools/suffix_replay.py collect --seed 1 --requests 24 --tokens 128 --out stream1.json   # the demo, CPU
    python tools/suffix_replay.py run stream1.json --drafter suffix --log proposals.txt          # milliseconds

``run`` prints AL per request and for the first / steady requests (as ``edgespec bench session`` splits them);
``--log`` writes every cycle: the position, the draft, how much of it was accepted and the tokens that came
(edgespec.bench.replay). Tune on a stream of another seed than the one the figures are measured on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.bench.replay import collect, load_stream, replay, save_stream, summary, token_proposer  # noqa: E402
from edgespec.bench.robot_stream import robot_stream  # noqa: E402
from edgespec.config import Settings  # noqa: E402


def _collect(args: argparse.Namespace) -> None:
    from edgespec.engine import Engine
    from edgespec.plan import build_plan

    engine = Engine.load(build_plan(Settings(model=args.model, drafter="none", max_tokens=args.tokens)))
    texts = robot_stream(args.requests, args.seed)
    stream = collect(engine, texts, args.tokens)
    save_stream(args.out, stream, {"seed": args.seed, "requests": args.requests, "tokens": args.tokens,
                                   "model": args.model})
    print(f"{len(stream)} requests, {sum(len(r.output) for r in stream)} output tokens -> {args.out}")


def _run(args: argparse.Namespace) -> None:
    stream = load_stream(args.stream)
    knobs = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set or [])}
    settings = Settings(model="demo", drafter=args.drafter, **knobs)
    proposer, k = token_proposer(settings, args.vocab)
    adaptive = settings.adaptive_k is not False            # on by default on the CPU (arch/base.py)
    results = replay(proposer, stream, k, adaptive)
    first, steady = results[:args.first], results[args.first:]
    for i, r in enumerate(results):
        print(f"{i:>3} AL {r.acceptance_length:.2f} ({r.drafts} drafts, {r.accepted} accepted)")
    print(f"first ({len(first)}): AL {summary(first):.3f}; steady ({len(steady)}): AL {summary(steady):.3f}")
    if args.log:
        with open(args.log, "w") as f:
            for i, (req, r) in enumerate(zip(stream, results, strict=True)):
                seq = req.output + ([req.stop] if req.stop is not None else [])
                for c in r.cycles:
                    f.write(f"{i} {c.pos} drafted={c.draft} accepted={c.accepted} came={seq[c.pos:c.pos + 8]}\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--model", default="demo")
    c.add_argument("--seed", type=int, default=1)
    c.add_argument("--requests", type=int, default=24)
    c.add_argument("--tokens", type=int, default=128)
    c.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("stream")
    r.add_argument("--drafter", choices=("ngram", "suffix"), default="suffix")
    r.add_argument("--first", type=int, default=4)
    r.add_argument("--vocab", type=int, default=49152)
    r.add_argument("--set", nargs="*", metavar="KNOB=VALUE", help="settings overrides (suffix_factor=1.5 ...)")
    r.add_argument("--log")
    args = p.parse_args()
    _collect(args) if args.cmd == "collect" else _run(args)


if __name__ == "__main__":
    main()
