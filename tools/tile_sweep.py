"""One run that sweeps the launches of the packed products and splits their cost, so a kernel change is measured
in one device call.

    python tools/tile_sweep.py [--sm-limit 16] [--shape qwen3.5-27b] [--formats int4,nvfp4,fp8_block]
                               [--rows 1,16,32,64] [--split-shape qwen3.5-4b --split-rows 1,16]

Stack sweep (``--shape``): for each format and row count, the whole linear stack of the shape (every matrix of every
layer: ``edgespec.bench.quant_stack.QuantStack``, as ``tools/quant_bench.py`` times it) is timed as one CUDA graph
under each launch of :data:`CANDIDATES`
(every matrix the same launch; K splits by the launch's own rule; row counts where a format already streams
above Thor's rate on 16 SMs are left out): the default of ``quant_config`` (the activation-major tiles of
``edgespec.kernels.quant.triton_quant_gemv``), and the weight-major tiles (``T``) of
``edgespec.kernels.quant.triton_quant_wide`` at several ``BLOCK_N`` / warps / stages. ``NO_DECODE`` launches feed the
raw words to the MMA (wrong values): their time is the tile without its dequantization, so ``decode share =
1 - no_decode / full`` says whether a tile is bound by its decode or by the rest (MMA, activation tile, latency).
Each launch is first checked against the torch reference on one matrix (``err``; NO_DECODE excepted) and dropped
above 2e-2.

Split sweep (``--split-shape``, full chip): per distinct matrix of that shape and row count, ``BLOCK_N`` x every
K split (up to 16) that divides the tiles, for the default kernel family and the weight-major tile, each matrix
timed alone from DRAM; then the stack with each matrix's best launch against the default (the launch-shape fix of narrow
matrices). Prints one line per measurement and writes tile_sweep[_sm<N>].json to $OUT.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.bench import quant_stack as qs  # noqa: E402
from edgespec.bench.gpu import linear_shape_counts, measure_copy_bandwidth  # noqa: E402
from edgespec.kernels import sm_count  # noqa: E402
from edgespec.kernels.quant.quant_ref import matmul_ref  # noqa: E402
from edgespec.kernels.quant.triton_quant_gemv import quant_config, quant_matmul  # noqa: E402


def _t(bn: int, warps: int = 4, stages: int = 3, **extra) -> dict:
    return {"T": 1, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, **extra}


# (label, launch or None for quant_config's default) per format and row count: the default, the activation-major
# tile, the weight-major tile (T); int4's launches use PDL like its default ones (NVFP4's and FP8's tiles run slower
# with it)
_I4 = {"PDL": 1}
_OWN = ("activation-major", {"T": 0})      # triton_quant_gemv's own tile, where quant_config picks another
CANDIDATES: dict[str, dict[int, list[tuple[str, dict | None]]]] = {
    "int4": {
        16: [("default", None), ("T128w4", _t(128, **_I4)), ("T128w4 nodecode", _t(128, NO_DECODE=1, **_I4))],
        32: [("default", None), ("T128w4", _t(128, **_I4)), ("T64w4", _t(64, **_I4))],
        64: [("default", None), _OWN, ("T128w4", _t(128, **_I4)), ("T64w4", _t(64, **_I4)),
             ("T64w4 nodecode", _t(64, NO_DECODE=1, **_I4))],
    },
    "nvfp4": {
        1: [("default", None), _OWN, ("T128w4", _t(128)), ("T64w4", _t(64))],
        16: [("default", None), _OWN, ("T128w4", _t(128)), ("T64w4", _t(64)), ("T64w4 nodecode", _t(64, NO_DECODE=1))],
        32: [("default", None), _OWN, ("T128w4", _t(128)), ("T64w4", _t(64))],
        64: [("default", None), _OWN, ("T128w4", _t(128)), ("T64w4", _t(64)), ("T64w4 nodecode", _t(64, NO_DECODE=1))],
    },
    "fp8_block": {
        32: [("default", None), _OWN, ("T64w4", _t(64))],
        64: [("default", None), _OWN, ("T128w4", _t(128)), ("T64w4", _t(64))],
    },
}
CHECK_MATRIX = (1024, 5120)         # the launch checked against the reference before its stack is timed


def check_launch(fmt: str, cfg: dict | None, rows: int) -> float:
    """Relative error of ``cfg``'s product against the torch reference on one random matrix."""
    p = qs.random_packed(fmt, *CHECK_MATRIX)
    x = torch.randn(rows, CHECK_MATRIX[1], device=qs.DEV, dtype=torch.bfloat16)
    return qs.rel_err(quant_matmul(p, x, config=cfg), matmul_ref(p, x))


def stack_sweep(shape: str, formats: list[str], rows_list: list[int], report: dict) -> None:
    """Every candidate launch of every format, the whole stack of ``shape`` at each row count."""
    counts = linear_shape_counts(shape)
    out = report.setdefault("stacks", {}).setdefault(shape, {})
    for fmt in formats:
        torch.cuda.empty_cache()
        stack = qs.QuantStack(fmt, counts)
        res = out.setdefault(fmt, {"bytes": stack.nbytes, "runs": []})
        for rows in rows_list:
            for label, cfg in CANDIDATES[fmt].get(rows, []):
                entry = {"rows": rows, "launch": label, "config": cfg}
                try:
                    if not (cfg or {}).get("NO_DECODE"):
                        entry["err"] = check_launch(fmt, cfg, rows)
                        if entry["err"] > 2e-2:
                            raise ValueError(f"error {entry['err']:.1e} against the reference")
                    stack.override = cfg
                    entry["us"] = stack.time(rows)
                    entry["GBps"] = stack.nbytes / entry["us"] / 1e3
                except Exception as exc:  # a launch that does not compile or fit, or is wrong: recorded, skipped
                    entry["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                res["runs"].append(entry)
                shown = (f"{entry['us'] / 1e3:8.2f} ms {entry['GBps']:6.0f} GB/s" if "us" in entry
                         else entry["error"])
                err = f"  err {entry['err']:.1e}" if "err" in entry else ""
                print(f"  {shape} {fmt:>9} rows {rows:2d} {label:<18} {shown}{err}", flush=True)
        stack.override = None
        del stack
        summarize(fmt, res["runs"])


def summarize(fmt: str, runs: list[dict]) -> None:
    """Best launch per row count, and the decode share where a NO_DECODE twin was timed."""
    by_rows: dict[int, list[dict]] = {}
    for r in runs:
        if "us" in r:
            by_rows.setdefault(r["rows"], []).append(r)
    for rows, rs in sorted(by_rows.items()):
        real = [r for r in rs if not (r["config"] or {}).get("NO_DECODE")]
        best = min(real, key=lambda r: r["us"])
        shares = []
        for nd in (r for r in rs if (r["config"] or {}).get("NO_DECODE")):
            twin = {k: v for k, v in nd["config"].items() if k != "NO_DECODE"}
            full = [r for r in real if r["config"] == twin]
            if full:
                share = 1 - nd["us"] / full[0]["us"]
                shares.append(f"{nd['launch']}: decode {share:.0%} of {full[0]['us'] / 1e3:.1f} ms")
        print(f"  best {fmt} rows {rows}: {best['launch']} {best['us'] / 1e3:.2f} ms {best['GBps']:.0f} GB/s"
              + (f"  ({'; '.join(shares)})" if shares else ""), flush=True)


def divisors(n: int, most: int) -> list[int]:
    return [d for d in range(1, min(n, most) + 1) if n % d == 0]


def family(fmt: str, rows: int, bn: int, split: int) -> list[tuple[str, dict]]:
    """The launches a split sweep tries at one ``BLOCK_N`` and K split: the default kernel's family, the T tile."""
    base = {"BLOCK_N": bn, "SPLIT_K": split, "num_warps": 4, "num_stages": 3}
    launches = [(f"default-family BN{bn} s{split}", base)]
    if bn >= 64:
        launches.append((f"T BN{bn} s{split}", {**base, "T": 1, "PDL": int(fmt == "int4")}))
    return launches


def split_sweep(shape: str, formats: list[str], rows_list: list[int], report: dict) -> None:
    """Per distinct matrix and row count: BLOCK_N x K splits of the default family and the T tile, each matrix
    timed alone from DRAM; then the stack with every matrix's best against the default launches."""
    counts = linear_shape_counts(shape)
    sms = sm_count(torch.device(qs.DEV))
    out = report.setdefault("splits", {}).setdefault(shape, {})
    for fmt in formats:
        best: dict = {}
        for n, k in counts:
            one = qs.random_packed(fmt, n, k)
            items = [one] + [qs.random_packed(fmt, n, k) for _ in range(qs.copies_for(one.nbytes) - 1)]
            n_tiles = k // 128
            for rows in rows_list:
                x = torch.randn(rows, k, device=qs.DEV, dtype=torch.bfloat16)
                ref = matmul_ref(one, x)
                auto = quant_config(fmt, n, k, rows, sms)
                tried = [("default", None)] + [lc for bn in (64, 128) for d in divisors(n_tiles, 16)
                                               for lc in family(fmt, rows, bn, d)]
                results = []
                for label, cfg in tried:
                    try:
                        if qs.rel_err(quant_matmul(one, x, config=cfg), ref) > 2e-2:
                            continue
                        t = qs.per_matrix_us(items, lambda p, c=cfg, x=x: quant_matmul(p, x, config=c))
                    except Exception:  # noqa: S112 - a launch that does not fit this matrix
                        continue
                    results.append((t, label, cfg))
                results.sort(key=lambda r: r[0])
                default_us = next(t for t, label, _ in results if label == "default")
                t, label, cfg = results[0]
                best[(n, k, min(rows, 16))] = cfg
                print(f"  split {shape} {fmt} {n}x{k} rows {rows}: default {default_us:.1f} us (auto split "
                      f"{auto['SPLIT_K']}, BN {auto['BLOCK_N']}); best {label} {t:.1f} us; next "
                      + ", ".join(f"{lb} {tt:.1f}" for tt, lb, _ in results[1:4]), flush=True)
                out.setdefault(fmt, {})[f"{n}x{k}/{rows}"] = {"default_us": default_us, "best": label, "best_us": t,
                                                               "config": cfg}
            del items, one
            torch.cuda.empty_cache()
        stack = qs.QuantStack(fmt, counts)
        bw = report["bandwidth_GBps"] * 1e9
        for rows in rows_list:
            stack.configs = {}
            d = stack.time(rows)
            stack.configs = {key: c for key, c in best.items() if key[2] == min(rows, 16) and c is not None}
            t = stack.time(rows)
            pct = (stack.nbytes / bw * 1e6) / t * 100
            print(f"  split {shape} {fmt} stack rows {rows}: default {d:.0f} us "
                  f"{(stack.nbytes / bw * 1e6) / d * 100:.1f}% -> per-matrix best {t:.0f} us {pct:.1f}% of the "
                  "byte limit", flush=True)
            out.setdefault(fmt, {})[f"stack/{rows}"] = {"default_us": d, "tuned_us": t, "tuned_pct": pct}
        del stack


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-27b", help="stack sweep shape ('' to skip)")
    ap.add_argument("--formats", default="int4,nvfp4,fp8_block")
    ap.add_argument("--rows", default="1,16,32,64")
    ap.add_argument("--split-shape", default="", help="split sweep shape, e.g. qwen3.5-4b")
    ap.add_argument("--split-formats", default="int4")
    ap.add_argument("--split-rows", default="1,16")
    ap.add_argument("--sm-limit", type=int, default=0, help="run on a green context of this many SMs")
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="folder for tile_sweep.json (default $OUT; none: not written)")
    args = ap.parse_args()
    limit = qs.apply_sm_limit(ap, args.sm_limit)
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats + args.split_formats.split(",") if f and f not in CANDIDATES]
    if unknown:
        ap.error(f"unknown formats {unknown}; known: {sorted(CANDIDATES)}")
    bw = measure_copy_bandwidth(torch.device(qs.DEV))
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    report = {"device": torch.cuda.get_device_name(), "bandwidth_GBps": bw / 1e9, "sms": sm_count(torch.device(qs.DEV)),
              "sm_limit": {"requested": limit.requested, "granted": limit.granted} if limit else None}
    if args.shape:
        stack_sweep(args.shape, formats, [int(r) for r in args.rows.split(",") if r], report)
    if args.split_shape:
        split_sweep(args.split_shape, [f for f in args.split_formats.split(",") if f],
                    [int(r) for r in args.split_rows.split(",") if r], report)
    qs.write_report(report, "tile_sweep", limit, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
