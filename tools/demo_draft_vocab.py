"""Rank the demo drafter's draft vocabulary (``draft_vocab.json``, edgespec.drafters.draft_vocab) from the demo
model's own greedy answers to the distillation's task requests (``edgespec.distill.tasks``: sixteen domains kept
apart from the session bench's robot stream and the bench prompts), counted per token id.

    python tools/demo_draft_vocab.py [--requests 64] [--tokens 128] [--out edgespec/data/drafters/smollm2-135m-dflash]

The answers are decoded with n-gram speculation (output identical to plain greedy, faster on the CPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.config import Settings  # noqa: E402
from edgespec.distill.tasks import task_prompts  # noqa: E402
from edgespec.drafters.dflash import demo_drafter_path  # noqa: E402
from edgespec.drafters.draft_vocab import rank_by_counts, write_draft_vocab  # noqa: E402
from edgespec.engine import Engine, Request  # noqa: E402
from edgespec.plan import build_plan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=demo_drafter_path())
    args = ap.parse_args()
    engine = Engine.load(build_plan(Settings(model="demo", drafter="ngram", device="cpu")))
    answers = []
    for text, _ in task_prompts(args.requests, seed=args.seed):
        done = engine.complete(Request(messages=[{"role": "user", "content": text}], max_tokens=args.tokens))
        answers.append(done.token_ids)
    content = rank_by_counts(answers, f"token counts of the demo model's greedy answers ({args.tokens} tokens at "
                                      f"most) to task_prompts({args.requests}, seed={args.seed}) of "
                                      "edgespec.distill.tasks (tools/demo_draft_vocab.py); unranked ids follow "
                                      "in id order (BPE merge order)")
    path = write_draft_vocab(args.out, content)
    print(f"{path}: {len(content['ids'])} ids ranked from {content['tokens_counted']} tokens")


if __name__ == "__main__":
    main()
