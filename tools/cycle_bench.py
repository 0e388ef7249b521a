"""Split of one speculative cycle on a GPU: draft / verify / accept+rollback / other, with device-synced stages.

    python tools/cycle_bench.py [--shape qwen3.5-27b] [--k 15] [--tokens 128] [--format int4]
                                [--drafter-weights model,int4] [--sm-limit 16]

Builds the target shape with random weights on the GPU (``--format``: dense bf16, or fp8/nvfp4/int4 linear layers
as ``edgespec bench formats`` builds them) and a random 5-layer DFlash drafter of the published layout for it
(edgespec.bench.random_drafter), served once per ``--drafter-weights`` entry (the checkpoint's bf16, or quantized
at load), then runs the session with ``stage_timing=device``. Random drafts are
rejected, so every cycle verifies K+1 rows and rolls back: the worst case for cycle overheads. The same split is
printed for the n-gram drafter. ``--sm-limit N`` runs it all on a green context of N SMs
(``edgespec.bench.sm_limit``), made current before the model is built; the SM count actually granted is printed and
recorded as ``sms`` (what ``tools/thor_projection.py`` interpolates to Thor's 20). Writes cycle_bench.json to $OUT
when set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from edgespec.arch.detect import select_hooks  # noqa: E402
from edgespec.bench.formats import FORMATS, format_model  # noqa: E402
from edgespec.bench.gpu import random_model, sm_clock_mhz, weight_bytes_per_token  # noqa: E402
from edgespec.bench.random_drafter import write_dflash_drafter  # noqa: E402
from edgespec.bench.shapes import SHAPES, config_dict  # noqa: E402
from edgespec.bench.sm_limit import limit_sms  # noqa: E402
from edgespec.drafters.dflash import load_dflash_checkpoint  # noqa: E402
from edgespec.drafters.ngram import NGramProposer  # noqa: E402
from edgespec.kernels import sm_count  # noqa: E402
from edgespec.memory import module_bytes  # noqa: E402
from edgespec.speculative.acceptance import StrictGreedy  # noqa: E402
from edgespec.speculative.session import SpecSession  # noqa: E402
from edgespec.weights.base import PackedWeight  # noqa: E402
from edgespec.weights.requantize import quantize_lm_head  # noqa: E402


def nbytes(t: torch.Tensor | PackedWeight) -> int:
    return t.nbytes if isinstance(t, PackedWeight) else t.numel() * t.element_size()


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
    ap.add_argument("--format", default="dense", choices=FORMATS, help="the target's linear layers")
    ap.add_argument("--drafter-weights", default="model", help="comma list of drafter_weights to serve the DFlash "
                    "drafter in, one run each (model, fp8, int4, nvfp4)")
    ap.add_argument("--lm-head", default="model", choices=("model", "fp8", "int4", "nvfp4"),
                    help="the target's output projection (lm_head_weights)")
    ap.add_argument("--max-len", type=int, default=2048, help="cache length (the peak memory figure includes it)")
    ap.add_argument("--kv", choices=("auto", "fp8", "model"), default="auto", help="KV cache format")
    ap.add_argument("--sm-limit", type=int, default=0, help="run on a green context of this many SMs (Thor: 20)")
    args = ap.parse_args()
    device = torch.device("cuda")
    limit = None
    if args.sm_limit:
        try:
            limit = limit_sms(args.sm_limit, device)    # before anything else runs on the GPU
        except (ValueError, RuntimeError) as e:
            ap.error(str(e))
        print(limit.describe(), flush=True)
    if args.format == "dense":
        model = random_model(args.shape, device, torch.bfloat16, max_len=args.max_len)
    else:
        model = format_model(config_dict(**SHAPES[args.shape]), args.format, device, torch.bfloat16, args.max_len)
    quantize_lm_head(model, args.lm_head)
    load_peak = torch.cuda.max_memory_allocated(device)     # building the target and packing its head
    prompt = torch.randint(0, 1000, (256,)).tolist()
    kv_fp8 = None if args.kv == "auto" else args.kv == "fp8"
    verify_bytes = weight_bytes_per_token(model)      # a verify reads every matrix once, one embedding row a token
    out = {"shape": args.shape, "device": torch.cuda.get_device_name(device), "k": args.k, "format": args.format,
           "lm_head": args.lm_head,
           "sms": sm_count(device), "sm_clock_mhz": sm_clock_mhz(),
           "sm_limit": {"requested": limit.requested, "granted": limit.granted,
                        "device_sms": limit.device_sms} if limit else None,
           "target_weight_bytes": module_bytes(model), "verify_bytes": verify_bytes,
           "head_bytes": nbytes(model.lm_head_weight), "max_len": args.max_len, "load_peak_GB": load_peak / 1e9}
    print(f"{out['device']} ({out['sms']} SMs, {out['sm_clock_mhz']} MHz): {args.shape} target {args.format} "
          f"(lm_head {args.lm_head}), "
          f"{verify_bytes / 1e9:.2f} GB read per verify, load peak {load_peak / 1e9:.1f} GB", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        write_dflash_drafter(tmp, config_dict(**SHAPES[args.shape]), num_layers=5, dtype=torch.bfloat16)
        runs = [f"dflash-{w}" for w in args.drafter_weights.split(",") if w] + ["ngram"]
        for name in runs:
            if name == "ngram":
                proposer = NGramProposer()
            else:
                proposer = load_dflash_checkpoint(tmp, model, window_size=128, cuda_graphs=True,
                                                  weights=name.split("-", 1)[1])
                # a draft forward reads the drafter and the head it multiplies by (the target's, when borrowed)
                head = proposer._head_weight
                out[f"{name}_drafter_bytes"] = module_bytes(proposer.drafter)
                out[f"{name}_head_bytes"] = nbytes(head) if head is model.lm_head_weight else 0
                out[f"{name}_draft_bytes"] = out[f"{name}_drafter_bytes"] + out[f"{name}_head_bytes"]
                print(f"{name}: {out[f'{name}_drafter_bytes'] / 1e9:.2f} GB of drafter weights, "
                      f"{out[f'{name}_draft_bytes'] / 1e9:.2f} GB read per draft", flush=True)
            k = min(args.k, proposer.max_k)
            torch.cuda.reset_peak_memory_stats()
            session = SpecSession.with_defaults(model, select_hooks("auto", device), proposer, k=k,
                                                max_len=args.max_len,
                                                cuda_graphs=True, stage_timing="device", rollback=args.rollback,
                                                kv_fp8=kv_fp8)
            out["rollback"] = session.rollback_strategy
            session.generate(prompt, max_tokens=16, policy=StrictGreedy())          # warm-up
            res = session.generate(prompt, max_tokens=args.tokens, policy=StrictGreedy())
            out[name] = {**split(res.telemetry), "peak_GB": torch.cuda.max_memory_allocated() / 1e9,
                         "kv_fp8": session.kv_fp8}
            print(name, json.dumps({k: round(v, 4) for k, v in out[name].items()}), flush=True)
            del session, proposer
            torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "cycle_bench.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
