"""Split of one speculative cycle on a GPU: draft / verify / accept+rollback / other, with device-synced stages.

    python tools/cycle_bench.py [--shape qwen3.5-27b] [--k 15] [--tokens 128]

Builds the target shape with random weights on the GPU and a random 5-layer DFlash drafter of the published
layout for it (tools/make_drafter.py), then runs the session with ``stage_timing=device``. Random drafts are
rejected, so every cycle verifies K+1 rows and rolls back: the worst case for cycle overheads. The same split is
printed for the n-gram drafter. Writes cycle_bench.json to $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_drafter import write_dflash_drafter  # noqa: E402

from edgespec.arch.detect import select_hooks  # noqa: E402
from edgespec.bench.gpu import random_model  # noqa: E402
from edgespec.drafters.dflash import load_dflash_checkpoint  # noqa: E402
from edgespec.drafters.ngram import NGramProposer  # noqa: E402
from edgespec.loading.synthetic import SHAPES, config_dict  # noqa: E402
from edgespec.speculative.acceptance import StrictGreedy  # noqa: E402
from edgespec.speculative.session import SpecSession  # noqa: E402


def split(tel) -> dict[str, float]:
    s = tel.stage_ms
    cycles = max(tel.cycles, 1)
    core = s["draft"] + s["verify"] + s["accept"]
    total = core + s["other"]
    return {"cycles": tel.cycles, "acceptance_length": tel.acceptance_length,
            "draft_ms_per_cycle": s["draft"] / cycles, "verify_ms_per_cycle": s["verify"] / cycles,
            "accept_rollback_ms_per_cycle": s["accept"] / cycles, "other_ms_per_cycle": s["other"] / cycles,
            "draft_over_verify": s["draft"] / max(s["verify"], 1e-9),
            "accept_rollback_share": s["accept"] / max(total, 1e-9), "other_share": s["other"] / max(total, 1e-9),
            "decode_tok_s": tel.decode_tok_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="qwen3.5-27b", choices=sorted(SHAPES))
    ap.add_argument("--k", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rollback", default=None, help="rollback strategy (default: the arch default)")
    args = ap.parse_args()
    device = torch.device("cuda")
    model = random_model(args.shape, device, torch.bfloat16, max_len=2048)
    prompt = torch.randint(0, 1000, (256,)).tolist()
    out = {"shape": args.shape, "device": torch.cuda.get_device_name(device), "k": args.k}
    with tempfile.TemporaryDirectory() as tmp:
        write_dflash_drafter(tmp, config_dict(**SHAPES[args.shape]), num_layers=5, dtype=torch.bfloat16)
        proposers = {"dflash": load_dflash_checkpoint(tmp, model, window_size=128, cuda_graphs=True),
                     "ngram": NGramProposer()}
        for name, proposer in proposers.items():
            k = min(args.k, proposer.max_k)
            session = SpecSession(model, select_hooks("auto", device), proposer, k=k, max_len=2048,
                                  cuda_graphs=True, stage_timing="device", rollback=args.rollback)
            out["rollback"] = session.rollback_strategy
            session.generate(prompt, max_tokens=16, policy=StrictGreedy())          # warm-up
            res = session.generate(prompt, max_tokens=args.tokens, policy=StrictGreedy())
            out[name] = split(res.telemetry)
            print(name, json.dumps({k: round(v, 4) for k, v in out[name].items()}), flush=True)
            del session
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "cycle_bench.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
