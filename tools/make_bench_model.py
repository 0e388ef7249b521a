"""Write a random-weight checkpoint of a published shape plus a byte-level chat tokenizer (for profile/bench runs).

    python tools/make_bench_model.py qwen3.5-4b /tmp/q35-4b [--mtp] [--dtype bfloat16]

Shapes: edgespec.loading.synthetic.SHAPES. Speed does not depend on weight values; acceptance of model-based
drafters on random weights does, so figures from such a model measure cost, not acceptance.
"""

from __future__ import annotations

import argparse
import sys

import torch

from edgespec.loading.synthetic import SHAPES, config_dict, write_chat_tokenizer, write_random_checkpoint


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--mtp", action="store_true", help="add one MTP layer (Qwen3.5 shapes)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    fields = dict(SHAPES[args.shape])
    if args.mtp:
        fields["mtp_num_hidden_layers"] = 1
    cfg = config_dict(**fields, eos_token_id=258)   # <|im_end|> of the byte tokenizer
    write_random_checkpoint(args.out, cfg, seed=0, with_mtp=args.mtp, dtype=getattr(torch, args.dtype))
    write_chat_tokenizer(args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
