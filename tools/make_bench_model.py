"""Write a random-weight checkpoint of a published shape plus a chat tokenizer (for profile/bench runs).

    python tools/make_bench_model.py qwen3.5-4b /tmp/q35-4b [--mtp] [--dtype bfloat16] [--tokenizer demo]
    python tools/make_bench_model.py --tokenizer-only bench-tokenizer    # the demo's BPE tokenizer files alone

Shapes: edgespec.bench.shapes.SHAPES, or tiny:FAMILY (a test shape). ``--tokenizer``: ``byte`` (default
for a model, a 261-id byte-level tokenizer), ``demo`` (the demo's SmolLM2 BPE tokenizer; needs the demo package) or
a folder holding tokenizer.json. ``--tokenizer-only`` writes just the tokenizer files (the demo's by default): copy
that folder to a machine without the demo package and name it with ``--tokenizer`` (or ``edgespec bench
--bench-tokenizer``) there. Speed does not depend on weight values; acceptance of model-based drafters on random
weights does, so figures from such a model measure cost, not acceptance.
"""

from __future__ import annotations

import argparse
import sys

from edgespec.bench.random_model import copy_tokenizer, tokenizer_source, write_bench_model
from edgespec.bench.shapes import SHAPES, write_chat_tokenizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", nargs="?", help=f"one of {', '.join(sorted(SHAPES))}, or tiny:FAMILY")
    ap.add_argument("out")
    ap.add_argument("--mtp", action="store_true", help="add one MTP layer (Qwen3.5 shapes)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--tokenizer", help="byte, demo or a folder with tokenizer.json (default: byte for a model, "
                    "demo with --tokenizer-only)")
    ap.add_argument("--tokenizer-only", action="store_true", help="write only the tokenizer files into OUT")
    args = ap.parse_args()
    if args.tokenizer_only:
        src = tokenizer_source(args.tokenizer or "demo")
        if src is None:
            write_chat_tokenizer(args.out)
        else:
            copy_tokenizer(src, args.out)
    elif args.shape is None:
        ap.error("a shape is needed unless --tokenizer-only")
    else:
        write_bench_model(args.shape, args.out, args.tokenizer or "byte", args.dtype, args.mtp)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
