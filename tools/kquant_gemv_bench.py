"""Per-matrix time of a GGUF file's K-quant products at 1..4 rows on CUDA: the CUDA-core GEMV
(``edgespec.kernels.quant.triton_kquant_gemv``) against the tensor-core tiles
(``edgespec.kernels.quant.triton_kquant``), next to
the byte limit (the matrix's bytes over the device-to-device copy bandwidth, measured in the same run).

Every distinct (format, out, in) of the file's packed weights is timed once on its own bytes, each call captured 20
times in one CUDA graph (``graph_time_us``: launch overhead out, as a served graph runs it); the weighted sum over
the file's matrices is the linear stack of one decode step. ``--sweep`` also times launch variants of the GEMV
(``BLOCK_N`` x ``WAVES`` x ``MIN_SB``) and prints the best per matrix. ``--launch K=V,..`` changes the GEMV's launch
defaults for the whole run, ``--whole`` then times the served decode step too (``python -m edgespec.bench.gguf_file``
in-process: the same launch).

    PYTHONPATH=.peer/llama.cpp/gguf-py python tools/kquant_gemv_bench.py --gguf .peer/models/Q4_K_M.gguf \\
        [--rows 1,4] [--sweep] [--launch BLOCK_N=32,WAVES=8] [--whole] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
from pathlib import Path

import torch

from edgespec.errors import ConfigError


def parse_launch(text: str) -> dict[str, int]:
    """``"BLOCK_N=32,WAVES=8"`` -> ``{"BLOCK_N": 32, "WAVES": 8}``; unknown keys and non-integers are named."""
    from edgespec.kernels.quant.triton_kquant_gemv import GEMV_LAUNCH
    keys = GEMV_LAUNCH[12]
    out: dict[str, int] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in keys or not value.lstrip("-").isdigit():
            raise ConfigError(f"--launch {item!r}: give KEY=INT with KEY one of {', '.join(keys)}")
        out[key] = int(value)
    return out


SWEEP = [{"BLOCK_N": b, "WAVES": w, "MIN_SB": s} for b, w, s in itertools.product((32, 64, 128), (2, 4, 8), (1, 2))]


def best_launches(matrices: list[dict]) -> dict[int, dict[str, int]]:
    """Per ggml type, the :data:`SWEEP` launch with the least time summed over the file's matrices of that type
    (each weighted by how many the file has), at one row."""
    kinds = {"gguf_q4_k": 12, "gguf_q5_k": 13, "gguf_q6_k": 14}
    sums: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in matrices:
        for i, t in enumerate(e.get("sweep", [])):
            sums[kinds[e["format"]]][i] += t["us"] * e["count"]
    return {kind: SWEEP[min(s, key=s.get)] for kind, s in sums.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", required=True, type=Path)
    p.add_argument("--rows", default="1,4", help="comma list of activation rows (1..4)")
    p.add_argument("--sweep", action="store_true", help="also time the GEMV launch variants")
    p.add_argument("--launch", default="", help="GEMV launch defaults for the whole run, KEY=INT,...")
    p.add_argument("--whole", action="store_true", help="then time the served decode step (bench.gguf_file)")
    p.add_argument("--whole-best", action="store_true",
                   help="with --sweep: then time the served step again with each ggml type on the sweep's launch "
                        "of the least weighted time at one row")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise ConfigError("kquant_gemv_bench needs a CUDA device")
    if not args.gguf.is_file():
        raise ConfigError(f"--gguf {args.gguf}: no such file")
    rows_list = [int(r) for r in args.rows.split(",") if r]
    from edgespec.arch.detect import select_hooks
    from edgespec.bench.gpu import measure_copy_bandwidth
    from edgespec.bench.timing import graph_time_us
    from edgespec.kernels import sm_count
    from edgespec.kernels.quant import triton_kquant_gemv as G
    from edgespec.kernels.quant.triton_kquant import kquant_matmul
    from edgespec.loading.gguf_model import load_gguf_target
    from edgespec.weights.base import PackedLinear, PackedWeight

    for launch in G.GEMV_LAUNCH.values():
        launch.update(parse_launch(args.launch))
    dev = torch.device("cuda")
    model, _ = load_gguf_target(args.gguf, dtype=torch.bfloat16, device=dev, max_positions=256)
    select_hooks("rtx", dev).choose_weight_kernels(model)
    count: collections.Counter = collections.Counter()
    first: dict[tuple, PackedWeight] = {}
    # the products of a step: every packed linear, and the output head (a packed embedding table when tied)
    products = [m.weight for m in model.modules() if isinstance(m, PackedLinear)]
    if all(w is not model.lm_head_weight for w in products):
        products.append(model.lm_head_weight)
    for m in products:
        if isinstance(m, PackedWeight) and m.format in ("gguf_q4_k", "gguf_q5_k", "gguf_q6_k"):
            key = (m.format, m.out_features, m.in_features)
            count[key] += 1
            first.setdefault(key, m)
    bw = measure_copy_bandwidth(dev)
    name = torch.cuda.get_device_name(dev)
    print(f"{args.gguf.name} on {name}: copy bandwidth {bw / 1e9:.0f} GB/s (read + written); GEMV launch per "
          f"ggml type {G.GEMV_LAUNCH}")
    print("format      out x in      count rows | gemv us  %limit | tiles us  %limit | limit us | best sweep")
    report: dict = {"device": name, "bandwidth_gbs": bw / 1e9, "launch": {str(k): dict(v) for k, v in
                                                                              G.GEMV_LAUNCH.items()}, "matrices": []}
    totals: collections.Counter = collections.Counter()
    with torch.inference_mode():
        for key in sorted(count):
            w = first[key]
            fmt, n, k = key
            limit_us = w.nbytes / bw * 1e6
            for rows in rows_list:
                x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
                gemv = graph_time_us(lambda w=w, x=x: G.kquant_gemv(w, x))
                tiles = graph_time_us(lambda w=w, x=x: kquant_matmul(w, x, config={"TILES": 1}))
                entry = {"format": fmt, "out": n, "in": k, "count": count[key], "rows": rows, "bytes": w.nbytes,
                         "gemv_us": gemv, "tiles_us": tiles, "limit_us": limit_us,
                         "split": G.kquant_gemv_config(int(w.ggml_type), n, k, sm_count(dev))["SPLIT_K"]}
                best = ""
                if args.sweep and rows == 1:
                    timed = [(graph_time_us(lambda w=w, x=x, c=c: G.kquant_gemv(w, x, launch=c)), c) for c in SWEEP]
                    entry["sweep"] = [{"us": t, **c} for t, c in timed]
                    t_best, c_best = min(timed, key=lambda tc: tc[0])
                    best = f"{t_best:.1f} us {c_best}"
                    totals[f"best_{rows}"] += t_best * count[key]
                totals[f"gemv_{rows}"] += gemv * count[key]
                totals[f"tiles_{rows}"] += tiles * count[key]
                totals[f"limit_{rows}"] += limit_us * count[key]
                report["matrices"].append(entry)
                print(f"{fmt:10s} {n:6d} x {k:5d} {count[key]:5d} {rows:4d} | {gemv:7.1f} {100 * limit_us / gemv:6.1f}"
                      f" | {tiles:8.1f} {100 * limit_us / tiles:6.1f} | {limit_us:8.1f} | {best}")
    for rows in rows_list:
        t = {k.split("_")[0]: v for k, v in totals.items() if k.endswith(f"_{rows}")}
        line = (f"stack at {rows} row(s): gemv {t['gemv'] / 1e3:.3f} ms ({100 * t['limit'] / t['gemv']:.1f}% of the "
                f"byte limit {t['limit'] / 1e3:.3f} ms), tiles {t['tiles'] / 1e3:.3f} ms")
        if "best" in t:
            line += f", per-matrix best of the sweep {t['best'] / 1e3:.3f} ms"
        print(line)
    report["totals_us"] = dict(totals)
    del model
    torch.cuda.empty_cache()
    from edgespec.bench import gguf_file
    if args.whole:
        gguf_file.main(["--gguf", str(args.gguf), "--context", "128"])
    if args.whole_best and args.sweep:
        report["best_launch"] = best_launches(report["matrices"])
        for kind, launch in report["best_launch"].items():
            G.GEMV_LAUNCH[kind].update(launch)
        print(f"the sweep's best launch per ggml type (weighted over the file's matrices, one row): "
              f"{report['best_launch']}")
        gguf_file.main(["--gguf", str(args.gguf), "--context", "128"])
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
