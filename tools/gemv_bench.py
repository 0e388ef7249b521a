"""cuBLAS vs the Triton GEMV on the one-row products of a decode step (bf16, weights streamed from DRAM).

    python tools/gemv_bench.py [--shapes qwen3.5-4b,qwen3.5-27b] [--sweep]

For every distinct weight matrix of each model shape (merged projections, as served) it times ``F.linear`` and
``gemv_triton`` on one row, cycling through enough copies of the matrix to keep it out of L2, inside a CUDA graph,
and prints the weight bandwidth of each next to the copy bandwidth; then the decode step's matmul time both ways
(matrices weighted by how often a step uses them). ``--sweep`` also tries launch configurations per matrix and
reports the best. Writes gemv_bench.json to $OUT when set.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.bench.gpu import linear_shape_counts as matrix_counts  # noqa: E402
from edgespec.bench.gpu import measure_copy_bandwidth  # noqa: E402
from edgespec.bench.timing import graph_time_us as time_us  # noqa: E402
from edgespec.kernels import sm_count  # noqa: E402
from edgespec.kernels.quant.triton_gemv import gemv_config, gemv_triton, skinny_gemm_triton  # noqa: E402


def streamed_weights(n: int, k: int) -> list[torch.Tensor]:
    """Enough bf16 copies of an ``[n, k]`` matrix to exceed L2 many times over: cycling through them makes every
    product read its weights from DRAM, as a decode step does."""
    copies = max(2, (768 << 20) // (n * k * 2))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def per_matrix_us(ws: list[torch.Tensor], call) -> float:
    """Microseconds of ``call(w)`` per matrix, cycling through ``ws`` inside a CUDA graph."""
    def run() -> None:
        for w in ws:
            call(w)
    return time_us(run, reps=2) / len(ws)


def bench_matrix(n: int, k: int, sweep: bool, bw: float) -> dict:
    ws = streamed_weights(n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    nbytes = n * k * 2
    ref = F.linear(x, ws[0]).float()
    t_cublas = per_matrix_us(ws, lambda w: F.linear(x, w))
    configs = [gemv_config(n, k, sm_count(x.device))]
    if sweep:
        configs += [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": st}
                    for bn, bk, nw, st in itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8), (2, 4))]
    results = []
    for cfg in configs:
        try:
            err = ((gemv_triton(x, ws[0], config=cfg).float() - ref).norm() / ref.norm()).item()
            t = per_matrix_us(ws, lambda w, cfg=cfg: gemv_triton(x, w, config=cfg))
            results.append({**cfg, "us": t, "rel_err": err})
        except Exception as exc:       # e.g. a tile too large for the registers
            results.append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:60]}"})
    ok = [r for r in results if "us" in r and r["rel_err"] < 1e-2]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    default = results[0]
    ws.clear()
    torch.cuda.empty_cache()
    return {"N": n, "K": k, "MB": nbytes / 1e6, "cublas_us": t_cublas, "cublas_pct": nbytes / t_cublas / bw * 1e8,
            "triton_default": default, "triton_best": best,
            "default_pct": nbytes / default["us"] / bw * 1e8 if "us" in default else None,
            "best_pct": nbytes / best["us"] / bw * 1e8 if best else None}


SKINNY_SWEEP = [{"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}
                for bn, bk, sk in itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 3, 4, 6, 8))]


def bench_rows(n: int, k: int, rows: int, bw: float, sweep: bool = False) -> dict:
    """cuBLAS vs the skinny GEMM for ``rows`` rows (a verify) on one matrix, weights streamed from DRAM; the
    one-row GEMV beside them (a verify costs ``skinny / gemv`` decode steps on this matrix). ``sweep``: also the
    skinny launches of ``SKINNY_SWEEP`` (tile width, K slice, K split)."""
    ws = streamed_weights(n, k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, ws[0]).float()
    err = ((skinny_gemm_triton(x, ws[0]).float() - ref).norm() / ref.norm()).item()
    t_cublas = per_matrix_us(ws, lambda w: F.linear(x, w))
    t_skinny = per_matrix_us(ws, lambda w: skinny_gemm_triton(x, w))
    t_gemv = per_matrix_us(ws, lambda w: gemv_triton(x[:1], w))
    best = None
    if sweep:
        for cfg in SKINNY_SWEEP:
            if cfg["SPLIT_K"] > 1 and k // cfg["SPLIT_K"] < 2 * cfg["BLOCK_K"]:
                continue
            try:
                e = ((skinny_gemm_triton(x, ws[0], config=cfg).float() - ref).norm() / ref.norm()).item()
                t = per_matrix_us(ws, lambda w, cfg=cfg: skinny_gemm_triton(x, w, config=cfg))
            except Exception as exc:  # e.g. out of shared memory
                print(f"    {n}x{k} {cfg}: {type(exc).__name__}", flush=True)
                continue
            if e < 1e-2 and (best is None or t < best["us"]):
                best = {**cfg, "us": t}
    ws.clear()
    torch.cuda.empty_cache()
    nbytes = n * k * 2
    return {"N": n, "K": k, "rows": rows, "cublas_us": t_cublas, "skinny_us": t_skinny, "gemv_us": t_gemv,
            "rel_err": err, "skinny_best": best,
            "cublas_pct": nbytes / t_cublas / bw * 1e8, "skinny_pct": nbytes / t_skinny / bw * 1e8}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3.5-4b,qwen3.5-27b")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--rows", type=int, default=16, help="also compare cuBLAS and the skinny GEMM at this row count")
    ap.add_argument("--sweep-rows", action="store_true", help="also sweep the skinny GEMM's launches at --rows")
    ap.add_argument("--skip-gemv", action="store_true", help="leave out the one-row cuBLAS/GEMV comparison")
    ap.add_argument("--matrices", default="", help="extra NxK matrices for the --rows comparison (e.g. 6144x5120)")
    args = ap.parse_args()
    bw = measure_copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s  (% below = weight bytes / time / copy bandwidth)")
    report = {"device": torch.cuda.get_device_name(), "bandwidth_GBps": bw / 1e9, "shapes": {}}
    done: dict[tuple[int, int], dict] = {}
    for shape in [s for s in args.shapes.split(",") if s]:
        counts = matrix_counts(shape)
        totals = {"cublas": 0.0, "default": 0.0, "best": 0.0}
        print(f"\n{shape}: {'N x K':>14} {'uses':>4} {'MB':>7} {'cuBLAS':>8} {'triton':>8} {'best':>8}  best config")
        for (n, k), uses in sorted(counts.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[1]):
            if args.skip_gemv:
                break
            r = done.get((n, k)) or bench_matrix(n, k, args.sweep, bw)
            done[(n, k)] = r
            totals["cublas"] += uses * r["cublas_us"]
            totals["default"] += uses * r["triton_default"].get("us", float("nan"))
            totals["best"] += uses * (r["triton_best"]["us"] if r["triton_best"] else float("nan"))
            best_cfg = {key: r["triton_best"][key] for key in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")} \
                if r["triton_best"] else None
            print(f"  {n:>7}x{k:<6} {uses:>4} {r['MB']:>7.1f} {r['cublas_pct']:>7.1f}% "
                  f"{(r['default_pct'] or float('nan')):>7.1f}% {(r['best_pct'] or float('nan')):>7.1f}%  {best_cfg}",
                  flush=True)
        print(f"  matmul per decode step: cuBLAS {totals['cublas']:.0f} us, Triton default {totals['default']:.0f} us,"
              f" Triton best-per-matrix {totals['best']:.0f} us")
        report["shapes"][shape] = {"totals_us": totals,
                                   "matrices": [{**done[nk], "uses": u} for nk, u in counts.items() if nk in done]}
        if args.rows > 1:
            multi = {nk: bench_rows(*nk, args.rows, bw, args.sweep_rows) for nk in counts}
            cub = sum(u * multi[nk]["cublas_us"] for nk, u in counts.items())
            sk = sum(u * multi[nk]["skinny_us"] for nk, u in counts.items())
            gv = sum(u * multi[nk]["gemv_us"] for nk, u in counts.items())
            for (n, k), r in multi.items():
                b = r["skinny_best"]
                best = f"  best {b['us']:.1f} us {({key: b[key] for key in b if key != 'us'})}" if b else ""
                print(f"  {args.rows} rows {n:>7}x{k:<6} x{counts[(n, k)]:<3} gemv(1 row) {r['gemv_us']:6.1f} us  "
                      f"cuBLAS {r['cublas_us']:6.1f} us {r['cublas_pct']:>5.1f}%  skinny {r['skinny_us']:6.1f} us "
                      f"{r['skinny_pct']:>5.1f}%  rel err {r['rel_err']:.1e}{best}", flush=True)
            print(f"  matmul per {args.rows}-row verify: cuBLAS {cub:.0f} us, skinny GEMM {sk:.0f} us "
                  f"(one-row GEMV {gv:.0f} us)", flush=True)
            report["shapes"][shape]["rows"] = {"rows": args.rows, "cublas_us": cub, "skinny_us": sk,
                                               "matrices": list(multi.values())}
    extra = [tuple(int(d) for d in m.split("x")) for m in args.matrices.split(",") if m]
    if extra:
        rows = [bench_rows(n, k, args.rows, bw, args.sweep_rows) for n, k in extra]
        for r in rows:
            b = r["skinny_best"]
            best = f"  best {b['us']:.1f} us {({key: b[key] for key in b if key != 'us'})}" if b else ""
            print(f"  {args.rows} rows {r['N']:>7}x{r['K']:<6} cuBLAS {r['cublas_us']:6.1f} us  skinny "
                  f"{r['skinny_us']:6.1f} us{best}", flush=True)
        report["matrices"] = rows
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gemv_bench.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
