"""Quantized weight-only products on the GPU, measured against the byte limit and against torch's own kernels.

    python tools/quant_bench.py [--shapes qwen3.5-27b,qwen3.5-4b] [--formats int4,nvfp4,fp8_block] [--sweep]
                                [--prefill 512,2048] [--prefill-shapes qwen3.5-4b] [--rows 1,4,8,16,32,64]
                                [--sm-limit 16] [--wide-sweep]

For each model shape it builds the whole linear stack (every matrix of every layer, merged projections as served,
lm_head included) once per format from random packed data (no dense copy is staged), checks one product per
distinct matrix against the torch reference (``edgespec.kernels.quant.quant_ref.matmul_ref``), and times the stack as
one CUDA graph for each of ``--rows`` (1: decode; 16: a chain verify; 32 and 64: tree verifies). Printed per
format: weight bytes, us and GB/s per row count, % of the byte limit (bytes / copy bandwidth measured in the same
run), verify16 / decode, peak GPU memory, and the same stack
through torch's alternatives on the device: bf16 cuBLAS and edgespec's bf16 GEMV (16-bit bytes), tinygemm int4
(``torch._weight_int4pack_mm``, group 128) and ``torch._scaled_mm`` (FP8 x FP8 with per-tensor scales: it also
quantizes the activations, so it is a different product, shown for its speed only).
``--sweep`` first tries launch configurations per distinct matrix and times the stack with the best of each as
well. ``--prefill`` times the stack at those row counts through both many-row paths (the fused tensor-core tile,
and dequantize-then-cuBLAS) against bf16 cuBLAS: the crossover sets ``DEQUANT_GEMM_MIN_ROWS``.
``--wide-sweep`` times the stack at 16, 32 and 64 rows under a few launches of the 17..64-row tile (the choice in
``quant_config``; ``XPAIR``: x permuted to the pair order once per call instead of in every program).
``--sm-limit N`` runs everything on a green context of N SMs (``edgespec.bench.sm_limit``: Thor's 20-SM budget
is emulated by 16 and 24, what Hopper grants); the granted count is printed and recorded, and the copy bandwidth
(the % column) is then what those SMs can copy.
Writes quant_bench.json to $OUT when set (quant_bench_sm<N>.json with ``--sm-limit``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.bench.gpu import linear_shape_counts, sm_clock_mhz  # noqa: E402
from edgespec.bench.quant_stack import (  # noqa: E402
    DEV,
    QuantStack,
    apply_sm_limit,
    copies_for,
    per_matrix_us,
    random_packed,
    rel_err,
    write_report,
)
from edgespec.bench.timing import graph_time_us as time_us  # noqa: E402
from edgespec.kernels import sm_count  # noqa: E402
from edgespec.kernels.quant.quant_ref import matmul_ref  # noqa: E402
from edgespec.kernels.quant.triton_gemv import gemv_triton, skinny_gemm_triton  # noqa: E402
from edgespec.kernels.quant.triton_quant_gemv import quant_config, quant_matmul  # noqa: E402

# int4: the pair-ordered tensor-core tile (PAIRS=1) for 1 and 16 rows, against the one-row word kernel
# (DOT=0, H2=1) and the byte tile (PAIRS=0)
INT4_PAIRS = [dict(DOT=1, PAIRS=1, BLOCK_N=bn, num_warps=w, num_stages=st, PREFETCH=pf) for bn, w, st, pf in
              ((64, 4, 3, 0), (128, 4, 3, 0), (128, 4, 4, 0), (128, 2, 3, 0), (256, 4, 3, 0), (256, 8, 3, 0),
               (128, 4, 3, 2), (128, 4, 3, 4), (64, 4, 3, 2))]
DECODE_SWEEP = {
    "int4": INT4_PAIRS + [dict(DOT=0, BLOCK_N=bn, num_warps=w, num_stages=st, H2=1) for bn, w, st in
                          ((64, 4, 3), (128, 4, 3))],
    "nvfp4": [dict(DOT=d, BLOCK_N=bn, num_warps=w, num_stages=st) for d, bn, w, st in
              ((0, 16, 4, 4), (0, 32, 4, 4), (0, 64, 4, 4), (0, 128, 8, 4), (1, 128, 4, 3))],
    "fp8_block": [dict(DOT=d, BLOCK_N=bn, num_warps=w, num_stages=st) for d, bn, w, st in
                  ((0, 16, 4, 4), (0, 32, 4, 4), (0, 32, 4, 6), (1, 32, 4, 4), (0, 64, 8, 4))],
}
VERIFY_SWEEP = {
    fmt: [dict(DOT=1, BLOCK_N=bn, num_warps=w, num_stages=st) for bn, w, st in
          (((32, 4, 4), (64, 4, 4), (128, 4, 3), (128, 8, 4)) if fmt != "fp8_block" else
           ((32, 4, 4), (32, 4, 6), (64, 4, 4), (128, 8, 4)))]
    for fmt in ("nvfp4", "fp8_block")
}
VERIFY_SWEEP["int4"] = INT4_PAIRS + [dict(DOT=1, PAIRS=0, BLOCK_N=128, num_warps=4, num_stages=3)]
NVFP4_PAIRS = [dict(DOT=1, PAIRS=1, BLOCK_N=bn, num_warps=w, num_stages=st) for bn, w, st in
               ((64, 4, 3), (128, 4, 3), (128, 4, 4), (256, 8, 3))]
DECODE_SWEEP["nvfp4"] += NVFP4_PAIRS
VERIFY_SWEEP["nvfp4"] = NVFP4_PAIRS + [dict(DOT=1, PAIRS=0, BLOCK_N=128, num_warps=4, num_stages=3)]
# The int4 launches without the pair tile (one row: the word kernel; 2..16 rows: the byte tile; no PDL), timed in
# the same run as "int4_prev" so the two are compared side by side.
INT4_PREVIOUS = {1: dict(DOT=0, H2=1, BLOCK_N=64, num_warps=4, num_stages=3, PDL=0),
                 16: dict(DOT=1, PAIRS=0, BLOCK_N=128, num_warps=4, num_stages=3, PDL=0),
                 64: dict(DEQUANT=1)}     # 17+ rows without the wide tile: dequantize, then cuBLAS
# Launches of the 17..64-row tile tried by --wide-sweep (every matrix of the stack takes the same one)
WIDE_SWEEP = [dict(BLOCK_N=bn, num_warps=w, num_stages=st, XPAIR=xp) for bn, w, st, xp in
              ((32, 4, 4, 0), (64, 4, 3, 0), (128, 4, 3, 0), (64, 4, 3, 1), (128, 4, 3, 1), (128, 4, 4, 1),
               (64, 4, 4, 1))]
ROWS = (1, 4, 8, 16, 32, 64)


# The peer shape (tools/peer_llamacpp.sh): set by --llama, named "llama" in --shapes / --prefill-shapes.
LLAMA_COUNTS: Counter = Counter()


def llama_counts(spec: str) -> Counter:
    """Merged matrices of a plain llama (qkv, o, gate_up, down per layer; untied lm_head) from peer_gguf.py's
    shape arguments (``--hidden 3072 --layers 28 ...``)."""
    ap = argparse.ArgumentParser()
    for name, default in (("hidden", 3072), ("layers", 28), ("heads", 24), ("kv-heads", 8), ("ffn", 8192),
                          ("vocab", 49152)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args(spec.split())
    hd = a.hidden // a.heads
    c: Counter = Counter()
    c[(a.hidden + 2 * a.kv_heads * hd, a.hidden)] += a.layers
    c[(a.hidden, a.heads * hd)] += a.layers
    c[(2 * a.ffn, a.hidden)] += a.layers
    c[(a.hidden, a.ffn)] += a.layers
    c[(a.vocab, a.hidden)] += 1
    return c


def matrix_counts(shape: str) -> Counter:
    """``(N, K) -> uses per decode step`` of a shape, lm_head included: the llama.cpp peer's shape, or a served
    :data:`SHAPES` model (``edgespec.bench.gpu.linear_shape_counts``)."""
    if shape == "llama":
        return Counter(LLAMA_COUNTS)
    return linear_shape_counts(shape)


def measure_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy (bytes read plus bytes written), best of 10."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * nbytes / best


def sweep_matrix(fmt: str, n: int, k: int, bw: float) -> dict:
    """Best decode (1 row) and verify (16 rows) launch for one matrix, weights streamed from DRAM."""
    one = random_packed(fmt, n, k)
    items = [one] + [random_packed(fmt, n, k) for _ in range(copies_for(one.nbytes) - 1)]
    out = {}
    sms = sm_count(torch.device(DEV))
    for rows, configs in ((1, DECODE_SWEEP[fmt]), (16, VERIFY_SWEEP[fmt])):
        x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
        ref = matmul_ref(one, x).float()
        auto = quant_config(fmt, n, k, rows, sms)["SPLIT_K"]
        results = []
        for cfg in configs:
            for split in sorted({auto, 1, 2 * auto} if auto > 1 else {1}):
                c = {**cfg, "SPLIT_K": split}
                if fmt == "fp8_block" and c["BLOCK_N"] > 128:
                    continue
                try:
                    e = rel_err(quant_matmul(one, x, config=c), ref)
                    t = per_matrix_us(items, lambda p, c=c, x=x: quant_matmul(p, x, config=c))
                except Exception as exc:   # a launch that does not fit (registers, shared memory)
                    print(f"    {fmt} {n}x{k} {c}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                    continue
                if e < 2e-2:
                    results.append({**c, "us": t, "pct": one.nbytes / t / bw * 1e8})
        best = min(results, key=lambda r: r["us"]) if results else None
        out[rows] = best
        print(f"    sweep {fmt} {n}x{k} rows {rows}: best {best}", flush=True)
    return out


def make_weight(fmt: str, n: int, k: int):
    """One random ``[n, k]`` weight in the layout ``fmt``'s product reads."""
    if fmt == "int4_prev":
        return random_packed("int4", n, k)
    if fmt in ("bf16", "cublas"):
        return torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
    if fmt == "tinygemm":
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV)
        packed = torch._convert_weight_to_int4pack(q, 8)
        sz = torch.rand(k // 128, n, 2, device=DEV, dtype=torch.bfloat16) * 1e-3
        return (packed, sz)
    if fmt == "scaled_mm":
        w = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=DEV)
        w[(w & 0x7F) == 0x7F] = 0
        return w.view(torch.float8_e4m3fn)
    return random_packed(fmt, n, k)


class Stack(QuantStack):
    """:class:`QuantStack` with torch's alternatives as extra formats (bf16 GEMV / cuBLAS, tinygemm int4,
    ``_scaled_mm``) and the previous int4 launches (``int4_prev``)."""

    def make(self, n: int, k: int):
        return make_weight(self.fmt, n, k)

    def call(self, w, n: int, k: int, x: torch.Tensor):
        if self.fmt == "bf16":
            if x.shape[0] > 16:
                return F.linear(x, w)
            return gemv_triton(x, w) if x.shape[0] == 1 else skinny_gemm_triton(x, w)
        if self.fmt == "cublas":
            return F.linear(x, w)
        if self.fmt == "tinygemm":
            return torch._weight_int4pack_mm(x, w[0], 128, w[1])
        if self.fmt == "scaled_mm":
            one = torch.ones((), device=DEV)
            return torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        if self.fmt == "int4_prev":
            rows = x.shape[0]
            return quant_matmul(w, x, config=INT4_PREVIOUS[1 if rows == 1 else 16 if rows <= 16 else 64])
        return super().call(w, n, k, x)

    def inputs(self, rows: int) -> dict[int, torch.Tensor]:
        if self.fmt != "scaled_mm":
            return super().inputs(rows)
        r = max(rows, 16)                 # _scaled_mm wants 16-row multiples, and FP8 activations
        return {k: torch.randn(r, k, device=DEV).to(torch.float8_e4m3fn) for k in {k for _, _, k in self.items}}


def bench_shape(shape: str, formats: list[str], bw: float, sweep: bool, report: dict, baselines: bool = True,
                rows_list: tuple[int, ...] = ROWS, wide_sweep: bool = False) -> None:
    counts = matrix_counts(shape)
    print(f"\n== {shape}: {sum(counts.values())} matrices per step, distinct {sorted(counts)}", flush=True)
    rows_out = {}
    for fmt in formats + (["int4_prev", "bf16", "tinygemm", "scaled_mm"] if baselines else []):
        needs = {"tinygemm": "int4", "int4_prev": "int4", "scaled_mm": "fp8_block"}.get(fmt)
        if needs and needs not in formats:
            continue
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        entry: dict = {}
        configs = {}
        try:
            if fmt in ("int4", "nvfp4", "fp8_block"):
                errs = []
                for n, k in counts:
                    p = random_packed(fmt, n, k)
                    for rows in (1, 5, 16, 40, 64):
                        x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
                        errs.append(rel_err(quant_matmul(p, x), matmul_ref(p, x)))
                    if sweep:
                        best = sweep_matrix(fmt, n, k, bw)
                        for rows, b in best.items():
                            if b:
                                configs[(n, k, rows)] = {key: b[key] for key in b if key not in ("us", "pct")}
                    del p
                    torch.cuda.empty_cache()
                entry["max_rel_err_vs_ref"] = max(errs)
            stack = Stack(fmt, counts)
            entry["bytes"] = stack.nbytes
            limit_us = stack.nbytes / bw * 1e6
            entry["limit_us"] = limit_us
            for rows in rows_list:
                entry[f"us_{rows}"] = stack.time(rows)
                entry[f"GBps_{rows}"] = stack.nbytes / entry[f"us_{rows}"] / 1e3
            if wide_sweep and fmt in ("int4", "nvfp4", "fp8_block"):
                entry["wide_sweep"] = []
                for cfg in WIDE_SWEEP:
                    if fmt == "fp8_block" and (128 % cfg["BLOCK_N"] or cfg["XPAIR"]):
                        continue            # fp8 reads x in input order
                    stack.override = cfg
                    times = {r: stack.time(r) for r in (16, 32, 64)}
                    entry["wide_sweep"].append({**cfg, **{f"us_{r}": t for r, t in times.items()}})
                    print(f"    wide sweep {fmt} {cfg}: " + "  ".join(f"{r} rows {t:.0f} us" for r, t in
                                                                       times.items()), flush=True)
                stack.override = None
            # The widest matrix alone (the lm_head: enough programs to fill any GPU many times over): the kernel's
            # rate per SM and clock when the chip is full, what tools/thor_projection.py scales to Thor's SMs.
            wide = max(counts, key=lambda nk: nk[0])
            alone = Stack(fmt, Counter({wide: 1}))
            sms, mhz = sm_count(torch.device(DEV)), sm_clock_mhz()
            entry["filled"] = {"matrix": list(wide), "bytes": alone.nbytes, "sms": sms, "sm_clock_mhz": mhz,
                               **{f"us_{r}": alone.time(r) for r in (1, 16)}}
            if mhz:
                entry["filled"]["bytes_per_sm_clock_16"] = alone.nbytes / (entry["filled"]["us_16"] * 1e-6) / (
                    sms * mhz * 1e6)
            del alone
            if configs:
                stack.configs = configs
                entry["tuned_us_1"] = stack.time(1)
                entry["tuned_us_16"] = stack.time(16)
                entry["tuned_configs"] = {f"{n}x{k}/{r}": c for (n, k, r), c in configs.items()}
            entry["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
            if fmt == "bf16":        # the same weights through cuBLAS
                stack.fmt = "cublas"
                rows_out["cublas"] = {"bytes": stack.nbytes, "limit_us": limit_us,
                                      **{f"us_{r}": stack.time(r) for r in rows_list}}
            del stack
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"  {fmt}: {entry['error']}", flush=True)
            torch.cuda.empty_cache()
            rows_out[fmt] = entry
            continue
        rows_out[fmt] = entry
        for name, e in ((fmt, entry), ("cublas", rows_out.get("cublas") if fmt == "bf16" else None)):
            if e:
                print_entry(name, e)
    report["shapes"][shape] = rows_out


def print_entry(fmt: str, entry: dict) -> None:
    """One format's line: us, GB/s and % of the byte limit at each row count timed, and the extras measured."""
    limit_us = entry["limit_us"]
    d = entry["us_1"]
    rows = sorted(int(key[3:]) for key in entry if key.startswith("us_") and key[3:].isdigit())
    per_rows = "  ".join(f"{r}: {entry[f'us_{r}']:.0f} us {entry['bytes'] / entry[f'us_{r}'] / 1e3:.0f} GB/s "
                         f"{limit_us / entry[f'us_{r}'] * 100:.1f}%" for r in rows)
    ratios = "".join(f" {r}/16 {entry[f'us_{r}'] / entry['us_16']:.2f}" for r in rows if r > 16 and "us_16" in entry)
    tuned = (f"  tuned: decode {entry['tuned_us_1']:.0f} us {limit_us / entry['tuned_us_1'] * 100:.1f}%, "
             f"v16/d {entry['tuned_us_16'] / entry['tuned_us_1']:.2f}") if "tuned_us_1" in entry else ""
    err = f"  err {entry['max_rel_err_vs_ref']:.1e}" if "max_rel_err_vs_ref" in entry else ""
    peak = f"  peak {entry['peak_GB']:.1f} GB" if "peak_GB" in entry else "  (same weights as bf16)"
    f = entry.get("filled")
    filled = (f"  widest alone {f['bytes'] / f['us_16'] / 1e3:.0f} GB/s at 16 rows"
              + (f" = {f['bytes_per_sm_clock_16']:.1f} B per SM-clock" if "bytes_per_sm_clock_16" in f else "")
              if f else "")
    v16 = f" (v16/d {entry['us_16'] / d:.2f}{ratios})" if "us_16" in entry else ""
    print(f"  {fmt:>10}: {entry['bytes'] / 1e9:6.2f} GB  {per_rows}{v16}{peak}{err}{tuned}{filled}", flush=True)


def bench_prefill(shape: str, formats: list[str], rows_list: list[int], report: dict) -> None:
    """Tokens/s of the linear stack at prefill row counts: one copy per distinct matrix, times its uses. Each
    quantized format runs both many-row paths (``fused``: the decode kernels' tensor-core tile; ``dequant``: a
    band dequantized then multiplied by cuBLAS), next to bf16 cuBLAS on dense weights. Each matrix is made once
    per format and timed at every row count through every path before the next one is made."""
    counts = matrix_counts(shape)
    out = {}
    for fmt in formats + ["cublas"]:
        torch.cuda.empty_cache()
        paths = ("fused", "dequant") if fmt != "cublas" else ("",)
        totals = {(path, rows): 0.0 for path in paths for rows in rows_list}
        for (n, k), uses in counts.items():
            w = make_weight(fmt, n, k)
            for rows in rows_list:
                x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
                for path in paths:
                    if fmt == "cublas":
                        def call(w=w, x=x):
                            return F.linear(x, w)
                    else:
                        def call(w=w, x=x, dequant=int(path == "dequant")):
                            return quant_matmul(w, x, config={"DEQUANT": dequant})
                        if rows == rows_list[0]:
                            e = rel_err(call(), matmul_ref(w, x))
                            if e > 2e-2:
                                print(f"  prefill {fmt} {path} {n}x{k}: rel err {e:.1e} vs reference", flush=True)
                    totals[path, rows] += uses * time_us(call, reps=3)
            del w
        for path in paths:
            res = {rows: {"us": totals[path, rows], "tok_s": rows / totals[path, rows] * 1e6} for rows in rows_list}
            name = f"{fmt} {path}".strip()
            out[name] = res
            print(f"  prefill {shape} {name:>17}: " + "  ".join(
                f"{r} rows {v['us'] / 1e3:.2f} ms ({v['tok_s']:.0f} tok/s)" for r, v in res.items()), flush=True)
    report.setdefault("prefill", {})[shape] = out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3.5-27b,qwen3.5-4b")
    ap.add_argument("--formats", default="int4,nvfp4,fp8_block")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-baselines", action="store_true", help="leave out bf16, tinygemm and _scaled_mm")
    ap.add_argument("--prefill", default="", help="prefill row counts, e.g. 512,2048")
    ap.add_argument("--prefill-shapes", default="qwen3.5-4b")
    ap.add_argument("--no-decode", action="store_true", help="only the --prefill timings")
    ap.add_argument("--llama", default="", help="peer llama shape, e.g. '--hidden 3072 --layers 28' (shape 'llama')")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="activation row counts the stacks are timed at")
    ap.add_argument("--wide-sweep", action="store_true", help="also time launches of the 17..64-row tile")
    ap.add_argument("--sm-limit", type=int, default=0, help="run on a green context of this many SMs (Thor: 20)")
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="folder for quant_bench.json (default $OUT; none: not written)")
    args = ap.parse_args()
    limit = apply_sm_limit(ap, args.sm_limit)
    rows_list = tuple(int(r) for r in args.rows.split(",") if r)
    if 1 not in rows_list or 16 not in rows_list:
        ap.error("--rows must include 1 and 16 (the decode and the chain verify every ratio is taken against)")
    if args.llama:
        LLAMA_COUNTS.update(llama_counts(args.llama))
        args.shapes = ",".join(["llama"] + [s for s in args.shapes.split(",") if s])
    formats = [f for f in args.formats.split(",") if f]
    bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s (% = bytes / time / copy bandwidth)",
          flush=True)
    report = {"device": torch.cuda.get_device_name(), "bandwidth_GBps": bw / 1e9, "shapes": {},
              "sms": sm_count(torch.device(DEV)), "sm_clock_mhz": sm_clock_mhz(),
              "sm_limit": {"requested": limit.requested, "granted": limit.granted} if limit else None}
    for shape in [s for s in args.shapes.split(",") if s and not args.no_decode]:
        bench_shape(shape, formats, bw, args.sweep, report, not args.no_baselines, rows_list, args.wide_sweep)
    if args.prefill:
        rows = [int(r) for r in args.prefill.split(",")]
        for shape in [s for s in args.prefill_shapes.split(",") if s]:
            bench_prefill(shape, formats, rows, report)
    write_report(report, "quant_bench", limit, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
