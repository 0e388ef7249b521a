"""Decode speed of a GGUF file as edgespec serves it (``python -m edgespec.bench.gguf_file --gguf FILE``): the
file's blocks loaded natively (:func:`edgespec.loading.gguf_model.load_gguf_target`), each packed weight on the
product the arch hooks choose (on CUDA: the K-quant Triton products of ``edgespec.kernels.quant.triton_kquant``), the
decode step captured as a CUDA graph and timed at ``--context`` tokens, as ``edgespec bench --formats`` times its
random models (llama-bench's tg128 ends at context 128). ``tools/peer_llamacpp.sh`` runs it on the very file
llama-bench reads (the Q4_K_M row of the peer table).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch

from edgespec.bench.formats import bench_format
from edgespec.errors import ConfigError


def type_mix(model: torch.nn.Module) -> dict[str, int]:
    """Packed layers per weight format (a Q4_K_M file: Q4_K and Q6_K)."""
    from edgespec.weights.base import PackedWeight
    return dict(collections.Counter(m.format for m in model.modules() if isinstance(m, PackedWeight)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", required=True, type=Path, help="the GGUF file (llama or qwen3 architecture)")
    p.add_argument("--context", type=int, default=128, help="context length of the timed decode step")
    p.add_argument("--iters", type=int, default=50, help="decode steps per timing")
    p.add_argument("--prefill", default="", help="comma list of prompt lengths whose prefill rate is also timed")
    p.add_argument("--verify-rows", type=int, default=16, help="rows of the timed verify forward")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    args = p.parse_args(argv)
    if not args.gguf.is_file():
        raise ConfigError(f"--gguf {args.gguf}: no such file")
    try:
        prefill = [int(n) for n in args.prefill.split(",") if n]
    except ValueError:
        raise ConfigError(f"--prefill {args.prefill!r}: expected a comma list of prompt lengths") from None
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from edgespec.loading.gguf_model import load_gguf_target

    mix: dict[str, int] = {}

    def build(max_len: int):
        model, _ = load_gguf_target(args.gguf, dtype=dtype, device=device, max_positions=max_len)
        mix.update(type_mix(model))
        return model

    r = bench_format({}, f"gguf:{args.gguf.name}", device, dtype, args.context, 0, args.iters, prefill,
                     args.verify_rows, build=build)
    r["packed_formats"] = mix
    print(json.dumps(r), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    formats = ", ".join(f"{k} x{v}" for k, v in sorted(mix.items()))
    prefill_rates = "".join(f", pp{n} {v:.0f} tok/s" for n, v in r["prefill_tok_s"].items())
    print(f"edgespec {args.gguf.name} on {device} ({name}): decode {r['decode_tok_s']:.1f} tok/s at context "
          f"{args.context} ({r['decode_ms']:.3f} ms), verify{args.verify_rows} {r['verify_ms']:.3f} ms, "
          f"{r['fast_kernels']} of {sum(mix.values())} packed weights on a fast kernel ({formats}), weights/token "
          f"{r['weight_bytes_per_token'] / 1e6:.1f} MB{prefill_rates}")
    if args.out:
        args.out.write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
