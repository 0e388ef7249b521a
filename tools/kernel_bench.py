#!/usr/bin/env python3
"""Check and time the Triton kernels against their torch references on one GPU.

Run from the repository root on a CUDA machine:  ``PYTHONPATH=. python3 tools/kernel_bench.py``

1. Runs ``tests/kernels/test_kernels_gpu.py`` (the correctness checks; ``--skip-tests`` to leave them out).
2. Measures the device-to-device copy bandwidth (bytes read + bytes written) as the ceiling for this run.
3. Times every kernel and its torch reference with ``triton.testing.do_bench`` (median; do_bench flushes L2
   before each repetition, so long-context numbers are DRAM numbers, as in a real decode step) and reports
   the achieved bandwidth: the fewest bytes the op must move over the measured time, and that as a share of
   the copy.
   Attention covers FP8 vs bf16 KV at 1k/8k/32k context for Qwen3.5 (Hq 16/24, Hkv 4, hd 256) and Qwen3
   (Hq 32, Hkv 8, hd 128), at T=1 (decode) and T=16 (verify).
4. ``--sweep`` also tries a few attention launch configurations at 32k and prints the best per case.
5. ``--fp8-sweep`` times the FP8-KV attention at 32k and 4k context, T=1 and T=16 (``--fp8-sweep-rows``),
   Qwen3.5-27B and -4B heads, each against the bf16-KV path's default: the default launch through the
   runtime's dispatch, then the other launch configurations (``fp8_sweep_configs``); it prints us, GB/s and the
   speedup per form, then the best per case. It stops starting new cases after ``--fp8-sweep-budget`` seconds
   (default 70). ``--skip-tests --only none --fp8-sweep`` runs it alone.
6. ``--attn-short`` times bf16 attention launches at 512 / 2048 keys, T=16 against T=1 (SmolLM2, Qwen3.5-4B and
   -27B heads), where a verify is latency-bound.
7. ``--only tree`` (not in the default groups) times one tree-verify layer's GDN and conv, Triton against torch,
   at 33 and 64 rows on the Qwen3.5-27B GDN shape (:func:`bench_tree`).
8. ``--gdn-sweep`` times the recurrent GDN kernel's launches (dv tile, warps) at T=1 and T=16 on the
   Qwen3.5-4B and -27B heads (same budget).

Writes everything as JSON to ``$OUT/kernel_bench.json`` when ``OUT`` is set. Prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from edgespec.bench import kernel_timing  # noqa: E402
from edgespec.bench.kernel_timing import key_major_twin, make_cache  # noqa: E402
from edgespec.cache.kv import KVCache  # noqa: E402
from edgespec.config import load_settings  # noqa: E402
from edgespec.kernels import attention_bytes  # noqa: E402
from edgespec.kernels.attention.attention import attention_ref, cached_attention  # noqa: E402
from edgespec.kernels.attention.triton_attention import cached_attention_triton  # noqa: E402
from edgespec.kernels.pointwise.norm import gated_rms_norm_ref, rms_norm_ref  # noqa: E402
from edgespec.kernels.pointwise.triton_norm import gated_rms_norm_triton, rms_norm_triton  # noqa: E402
from edgespec.kernels.recurrent.conv import causal_conv1d_ref  # noqa: E402
from edgespec.kernels.recurrent.gdn import gdn_chunked_ref, gdn_recurrent_ref  # noqa: E402
from edgespec.kernels.recurrent.triton_conv import causal_conv1d_triton  # noqa: E402
from edgespec.kernels.recurrent.triton_gdn import _chunk_prep, gdn_chunked_triton, gdn_recurrent_triton  # noqa: E402
from edgespec.plan import install_kernel_options  # noqa: E402

DEV = "cuda"
ATTN_MODELS = [("qwen3.5-9B", 16, 4, 256), ("qwen3.5-27B", 24, 4, 256), ("qwen3-8B", 32, 8, 128)]
CONTEXTS = [1024, 8192, 32768]


def bench_ms(fn: Callable[[], Any], quick: bool = False) -> float:
    """Median milliseconds of ``fn`` (events, warm-up first, L2 flushed before each repetition)."""
    return float(do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100, return_mode="median"))


# How graph_us evicts L2 before each call: "write" zeroes a 256 MB buffer (L2 is left full of dirty lines, which
# the timed kernel must write back as it reads: up to ~60 MB of extra traffic on an H200), "read" sums it (L2 is
# left full of clean lines, as after the weight-streaming GEMVs that precede attention in a decode step).
FLUSH_MODE = ["write"]


def graph_us(fn: Callable[[], Any], reps: int = 10, rep_ms: int = 60, flush_mode: str | None = None) -> float:
    """:func:`edgespec.bench.kernel_timing.graph_us` with this run's ``--flush`` mode unless ``flush_mode``."""
    return kernel_timing.graph_us(fn, reps, rep_ms, flush_mode or FLUSH_MODE[0])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    n = 1 << 28
    src = torch.randn(n, device=DEV)
    dst = torch.empty_like(src)
    ms = bench_ms(partial(dst.copy_, src))
    del src, dst
    return 2 * n * 4 / ms * 1e-6


class Table:
    """Rows of results; prints them aligned and keeps them for the JSON."""

    def __init__(self, copy_gbs: float) -> None:
        self.copy_gbs = copy_gbs
        self.rows: list[dict[str, Any]] = []

    def add(self, kernel: str, shape: str, gpu_us: float, eager_ms: float | None, ref_ms: float | None,
            nbytes: int, err: float | None = None, **extra: Any) -> dict[str, Any]:
        """``gpu_us``: graph-replay time (bandwidth is computed from it); ``eager_ms``/``ref_ms``: do_bench of
        the Triton call and of the torch reference as called from Python (host overhead included)."""
        gbs = nbytes / gpu_us * 1e-3
        row = {"kernel": kernel, "shape": shape, "gpu_us": gpu_us,
               "eager_us": eager_ms * 1e3 if eager_ms is not None else None,
               "torch_us": ref_ms * 1e3 if ref_ms is not None else None,
               "speedup": ref_ms / eager_ms if ref_ms and eager_ms else None, "bytes": nbytes, "GBps": gbs,
               "pct_copy": 100 * gbs / self.copy_gbs, "rel_err": err, **extra}
        self.rows.append(row)
        print(f"  {kernel:<14} {shape:<40} {gpu_us:9.1f} us  {gbs:7.0f} GB/s", flush=True)
        return row

    def render(self) -> str:
        head = (f"{'kernel':<14} {'shape':<40} {'gpu us':>8} {'eager us':>9} {'torch us':>9} {'speedup':>8} "
                f"{'GB/s':>6} {'%copy':>6} {'rel err':>8}")
        lines = [head, "-" * len(head)]

        def opt(v: float | None, fmt: str, width: int) -> str:
            return format(v, fmt) if v is not None else f"{'-':>{width}}"

        for r in self.rows:
            lines.append(f"{r['kernel']:<14} {r['shape']:<40} {r['gpu_us']:8.1f} "
                         f"{opt(r['eager_us'], '9.1f', 9)} {opt(r['torch_us'], '9.1f', 9)} "
                         f"{opt(r['speedup'], '7.1f', 7)}x {r['GBps']:6.0f} "
                         f"{r['pct_copy']:5.0f}% {opt(r['rel_err'], '8.1e', 8)}")
        return "\n".join(lines)


def _attention_ref_from_cache(q: torch.Tensor, cache: KVCache, start: int, scale: float) -> torch.Tensor:
    """The torch path as the dispatcher runs it off-GPU: read (dequantise) the rows, then SDPA."""
    k, v = cache.read(start + q.shape[0])
    return attention_ref(q, k, v, start, scale)


def bench_attention(table: Table, quick: bool) -> list[dict[str, Any]]:
    ratios = []
    for name, n_q, n_kv, hd in ATTN_MODELS:
        for ctx in CONTEXTS:
            caches = {fp8: make_cache(ctx, n_kv, hd, fp8) for fp8 in (True, False)}
            for T in (1, 16):
                start = ctx - T
                q = torch.randn(T, n_q, hd, device=DEV, dtype=torch.bfloat16)
                scale = hd ** -0.5
                times = {}
                for fp8, cache in caches.items():
                    out = cached_attention(q, cache, start, scale)
                    k, v = cache.read(ctx)
                    err = rel_err(out, attention_ref(q.float(), k.float(), v.float(), start, scale))
                    fn = partial(cached_attention, q, cache, start, scale)       # what the runtime runs
                    gpu = graph_us(fn)
                    t = bench_ms(fn, True)
                    r = None
                    if not quick or ctx == CONTEXTS[-1]:
                        r = bench_ms(partial(_attention_ref_from_cache, q, cache, start, scale), quick)
                    kv = "fp8" if fp8 else "bf16"
                    table.add(f"attn-{kv}", f"{name} T={T} ctx={ctx}", gpu, t, r,
                              attention_bytes(T, n_q, n_kv, hd, ctx, fp8), err,
                              kv=kv, T=T, ctx=ctx, model=name)
                    times[kv] = gpu
                ratios.append({"model": name, "T": T, "ctx": ctx,
                               "bf16_over_fp8": times["bf16"] / times["fp8"]})
            del caches
            torch.cuda.empty_cache()
    return ratios


def sweep_attention(quick: bool) -> list[dict[str, Any]]:
    """Try launch configurations at 32k for Qwen3.5-27B attention (graph-timed, each checked against the
    reference): tile sizes, warps, stages, splits, and for FP8 caches bf16 products or fp16 ones (FP16_DOT:
    e4m3 converts to fp16 in one instruction). Returns every timing (or the compile error).

    The kernel is query-major only: a key-major form (KV tiles as the left operands) is slower at every shape of
    this sweep (docs/notes/attention-experiments.md)."""
    from edgespec.kernels import sm_count
    from edgespec.kernels.attention.triton_attention import attention_launch_config
    results: list[dict[str, Any]] = []
    ctx = 32768
    name, n_q, n_kv, hd = ATTN_MODELS[1]
    keys = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
    best_of: dict[tuple[bool, int], float] = {}
    for fp8 in (True, False):
        cache = make_cache(ctx, n_kv, hd, fp8)
        for T in (1, 16):
            q_bf16 = torch.randn(T, n_q, hd, device=DEV, dtype=torch.bfloat16)
            base = attention_launch_config(T, n_q, n_kv, hd, ctx, sm_count(q_bf16.device), cache.k.element_size())
            grid: list[dict[str, int]] = []
            if T == 1:
                grid += [{"BLOCK_M": 16, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
                         for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
            else:
                grid += [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 8, "num_stages": st}
                         for bm in (64, 128) for bn in (32, 64) for st in (2, 3)]
            default = {k: base[k] for k in keys}
            grid = [{**c, "n_splits": base["n_splits"]} for c in grid]
            grid += [{**default, "n_splits": max(1, base["n_splits"] * m // 2)} for m in (1, 2, 4)]
            ref = _attention_ref_from_cache(q_bf16.float(), cache, ctx - T, hd ** -0.5)
            q = q_bf16
            for fp16_dot in ((1, 0) if fp8 else (0,)):
                best: tuple[float, dict[str, int]] | None = None
                for cfg in ({**c, "FP16_DOT": fp16_dot} for c in grid):
                    row: dict[str, Any] = {"model": name, "fp8": fp8, "T": T, **cfg}
                    try:
                        fn = partial(cached_attention_triton, q, cache, ctx - T, hd ** -0.5, config=cfg)
                        row["rel_err"] = rel_err(fn(), ref)
                        t = graph_us(fn, reps=10, rep_ms=30) / 1e3
                        row["us"] = t * 1e3
                        if row["rel_err"] < 1e-2 and (best is None or t < best[0]):
                            best = (t, cfg)
                    except Exception as exc:  # e.g. out of shared memory for big tiles
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:80]}"
                    results.append(row)
                base_us = next((r["us"] for r in results if r["fp8"] == fp8 and r["T"] == T and "us" in r
                                and r["FP16_DOT"] == fp16_dot
                                and all(r[k] == base[k] for k in (*keys, "n_splits"))), float("nan"))
                best_txt = f"{best[0] * 1e3:.1f} us {best[1]}" if best else "none ran"
                if best:
                    key = (fp8, T)
                    best_of[key] = min(best_of.get(key, float("inf")), best[0] * 1e3)
                print(f"  sweep {name} {'fp8' if fp8 else 'bf16'} T={T} fp16_dot={fp16_dot}: default {base_us:.1f} us "
                      f"{ {k: base[k] for k in (*keys, 'n_splits')} }, best {best_txt}", flush=True)
        del cache
        torch.cuda.empty_cache()
    for T in (1, 16):
        if (True, T) in best_of and (False, T) in best_of:
            print(f"  best bf16 / best fp8 at 32k, T={T}: {best_of[(False, T)] / best_of[(True, T)]:.2f}x")
    return results


FP8_SWEEP_MODELS = [("qwen3.5-27B", 24, 4, 256), ("qwen3.5-4B", 16, 4, 256)]
FP8_SWEEP_CONTEXTS = [32768, 4096]


def fp8_sweep_configs(T: int, group: int) -> list[dict[str, Any]]:
    """Launch configurations ``--fp8-sweep`` tries for T rows over an FP8 cache with ``group`` query heads per KV
    head (``tests/kernels/test_kernels_gpu.py`` checks every one for correctness). The first is the default
    (``FP8_LAUNCH``), the second the plain FP8 launch (compiler-placed conversion, every V element scaled). Keys
    not given keep the default; ``waves`` sets the split count (programs per SM)."""
    old = {"OPAQUE_CVT": 0, "V_SCALE": "rows", "BLOCK_N": 64, "num_stages": 3}    # the plain FP8 launch
    if T * group <= 32:                                      # decode: row blocks of <= 32, mma.sync
        return [
            {},
            {**old, "num_warps": 4, "waves": 2},
            {**old, "V_SCALE": "tile", "num_warps": 4, "waves": 2},              # the scale fold alone
            {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4, "waves": 2},
            {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "waves": 2},
            {"BLOCK_N": 32, "num_warps": 8, "num_stages": 3, "waves": 3},
            {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "waves": 1},
            {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "waves": 2},
            {"waves": 6},                                                        # more splits
            # Narrow programs, many of them: 2 warps on 32-key tiles at 4 programs per SM is the default; 1 warp,
            # more programs per SM (register file full), 4 stages (shared memory) and register caps (maxnreg: spills)
            # are slower.
            {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "waves": 4},
            {"BLOCK_N": 32, "num_warps": 2, "num_stages": 3, "waves": 3},
            {"BLOCK_N": 32, "num_warps": 2, "num_stages": 3, "waves": 6},
            {"BLOCK_N": 32, "num_warps": 2, "num_stages": 3, "waves": 4, "OPAQUE_CVT": 1},
            {"BLOCK_N": 32, "num_warps": 2, "num_stages": 2, "waves": 4},
            {"BLOCK_N": 16, "num_warps": 2, "num_stages": 4, "waves": 6},
            {"BLOCK_N": 16, "num_warps": 1, "num_stages": 4, "waves": 8},
            {"BLOCK_N": 32, "num_warps": 2, "num_stages": 3, "waves": 5, "maxnreg": 168},
            # With the key-blocked V (fewer registers: 210 against 255 per thread).
            {"BLOCK_N": 64, "num_warps": 2, "num_stages": 3, "waves": 2},
            {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "waves": 2},
            {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "waves": 3},
            {"BLOCK_N": 32, "num_warps": 2, "num_stages": 4, "waves": 3},
            {"BLOCK_N": 32, "num_warps": 2, "num_stages": 3, "waves": 5},
            {"BLOCK_N": 32, "num_warps": 2, "num_stages": 3, "waves": 4},          # the T=1 launch at 17-32 rows
            # 200 registers (ptxas: no spills with the blocked V) let 5 programs share an SM; 168 (a few spills)
            # and 2 stages (shared memory) let 6; both are slower than the default.
            {"waves": 5, "maxnreg": 200},
            {"waves": 6, "maxnreg": 168, "num_stages": 2},
            {"waves": 5, "maxnreg": 200, "num_stages": 2},
        ]
    wide = min(128, triton.next_power_of_2(T * group))      # one row block for all rows (wgmma)
    return [                                                 # verify: 32-row mma.sync blocks, 64-key tiles
        {},
        {**old, "BLOCK_M": wide, "num_warps": 8, "waves": 1},                   # the plain FP8 launch, blocked
        {"BLOCK_M": wide, "BLOCK_N": 16, "num_warps": 8, "num_stages": 4, "waves": 2},  # no spills at 128 rows
        {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3, "waves": 2},
        {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "waves": 2},   # mma.sync; KV re-read (L2)
        {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "waves": 2},
        {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "waves": 2},
        {"BLOCK_M": wide, "waves": 1},
        {"BLOCK_M": wide},                                   # the former default: one wgmma block, OPAQUE_CVT
        {"waves": 3},
        {"num_warps": 2, "waves": 4},
    ]


def _fp8_candidates(q: torch.Tensor, cache: KVCache, start: int, scale: float, n_q: int, n_kv: int, hd: int,
                    ctx: int) -> list[tuple[str, Callable[[], Any], dict[str, Any]]]:
    """(tag, call, shown launch) of every FP8 form the sweep times for this case: the default launch through the
    runtime's own dispatch (``cached_attention``), then the other launch configurations."""
    from edgespec.kernels import sm_count
    from edgespec.kernels.attention.triton_attention import LAUNCH_KEYS, attention_launch_config
    T = q.shape[0]
    cands: list[tuple[str, Callable[[], Any], dict[str, Any]]] = []
    seen: set[tuple] = set()
    for i, cfg in enumerate(fp8_sweep_configs(T, n_q // n_kv)):
        full = attention_launch_config(T, n_q, n_kv, hd, ctx, sm_count(q.device), 1, 2, overrides=cfg)
        opaque = cfg.get("OPAQUE_CVT", full.get("OPAQUE_CVT", 1))      # the policy's own when not swept
        ident = (*(full.get(k) for k in LAUNCH_KEYS if k != "waves"), opaque, cfg.get("V_SCALE", "tile"))
        if ident in seen:                                # e.g. BLOCK_M 64 is the 4B verify default
            continue
        seen.add(ident)
        shown = {**{k: full[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "n_splits")},
                 "OPAQUE_CVT": opaque, "V_SCALE": cfg.get("V_SCALE", "tile"),
                 **({"maxnreg": full["maxnreg"]} if full.get("maxnreg") else {})}
        if i == 0:                                       # the default is what the runtime runs: time it that way
            cands.append(("default", partial(cached_attention, q, cache, start, scale), shown))
        else:
            cands.append(("old default" if i == 1 else f"#{i}",
                          partial(cached_attention_triton, q, cache, start, scale, config=cfg), shown))
    return cands


def sweep_fp8_attention(budget_s: float, rows: tuple[int, ...] = (1, 16)) -> list[dict[str, Any]]:
    """``--fp8-sweep``: every FP8 form of ``_fp8_candidates`` per (model, context, T), graph-timed and checked
    against the fp32 reference, with the bf16-KV default of the same case as the baseline. Cases run in order of
    importance (32k before 4k); none is started after ``budget_s`` seconds."""
    t0 = time.time()
    results: list[dict[str, Any]] = []
    summary: list[str] = []
    cases = [(ctx, m, T) for ctx in FP8_SWEEP_CONTEXTS for m in FP8_SWEEP_MODELS for T in rows]
    caches: dict[tuple[int, int, int, bool], KVCache] = {}
    for ctx, (name, n_q, n_kv, hd), T in cases:
        if summary and time.time() - t0 > budget_s:
            print(f"  budget of {budget_s:.0f} s spent: skipping {name} ctx={ctx} T={T}", flush=True)
            continue
        for fp8 in (True, False):
            key = (ctx, n_kv, hd, fp8)
            if key not in caches:
                for old_key in [k for k in caches if k[0] != ctx]:
                    del caches[old_key]
                torch.cuda.empty_cache()
                caches[key] = make_cache(ctx, n_kv, hd, fp8)
        c8, c16 = caches[(ctx, n_kv, hd, True)], caches[(ctx, n_kv, hd, False)]
        # The same FP8 rows with a key-major V, timed under the default launch.
        if (ctx, n_kv, hd, "key-major") not in caches:
            caches[(ctx, n_kv, hd, "key-major")] = key_major_twin(c8)
        c8_rows = caches[(ctx, n_kv, hd, "key-major")]
        start, scale = ctx - T, hd ** -0.5
        q = torch.randn(T, n_q, hd, device=DEV, dtype=torch.bfloat16)
        bf16_us = graph_us(partial(cached_attention_triton, q, c16, start, scale), reps=10, rep_ms=30)
        ref = _attention_ref_from_cache(q.float(), c8, start, scale)
        nbytes = attention_bytes(T, n_q, n_kv, hd, ctx, True)
        print(f"  {name} ctx={ctx} T={T}: bf16-KV default {bf16_us:.1f} us "
              f"({attention_bytes(T, n_q, n_kv, hd, ctx, False) / bf16_us * 1e-3:.0f} GB/s)", flush=True)
        best: tuple[float, str, dict[str, Any]] | None = None
        default_us = float("nan")
        cands = _fp8_candidates(q, c8, start, scale, n_q, n_kv, hd, ctx)
        cands.insert(1, ("key-major V", partial(cached_attention, q, c8_rows, start, scale),
                         {**cands[0][2], "v_block": 0}))
        for tag, fn, shown in cands:
            row: dict[str, Any] = {"model": name, "ctx": ctx, "T": T, "tag": tag, "bf16_default_us": bf16_us,
                                   **shown}
            try:
                row["rel_err"] = rel_err(fn(), ref)
                us = graph_us(fn, reps=10, rep_ms=30)
                row.update(us=us, GBps=nbytes / us * 1e-3, speedup=bf16_us / us)
                ok = row["rel_err"] < 1e-2
                print(f"    {tag:<11} {us:7.1f} us {row['GBps']:6.0f} GB/s {row['speedup']:5.2f}x  "
                      f"err {row['rel_err']:.1e}{'' if ok else ' (WRONG)'}  {shown}", flush=True)
                if tag == "default":
                    default_us = us
                if ok and (best is None or us < best[0]):
                    best = (us, tag, shown)
            except Exception as exc:  # e.g. out of shared memory
                row["error"] = f"{type(exc).__name__}: {str(exc)[:100]}"
                print(f"    {tag:<11} failed: {row['error']}  {shown}", flush=True)
            results.append(row)
        if best:
            line = (f"{name:<12} ctx={ctx:<6} T={T:<3} bf16 {bf16_us:6.1f} us  fp8 default {default_us:6.1f} us "
                    f"= {bf16_us / default_us:.2f}x  best {best[0]:6.1f} us ({nbytes / best[0] * 1e-3:.0f} GB/s) "
                    f"= {bf16_us / best[0]:.2f}x  {best[1]} {best[2]}")
            print(f"  best: {line}", flush=True)
            summary.append(line)
    del caches
    torch.cuda.empty_cache()
    print(f"\nFP8-KV sweep, best per case (target >= 1.6x over bf16 KV at 32k; {time.time() - t0:.0f} s):")
    for line in summary:
        print(f"  {line}")
    return results


def _gdn_inputs(T: int, n_k: int, n_v: int, dk: int, dv: int):
    """q/k/v as views of one fused bf16 conv output (as the model passes them), g < 0, beta in (0, 1), a state."""
    fused = torch.randn(T, 2 * n_k * dk + n_v * dv, device=DEV, dtype=torch.bfloat16)
    q = fused[:, : n_k * dk].view(T, n_k, dk)
    k = fused[:, n_k * dk: 2 * n_k * dk].view(T, n_k, dk)
    v = fused[:, 2 * n_k * dk:].view(T, n_v, dv)
    g = -torch.rand(T, n_v, device=DEV) * 0.5
    beta = torch.rand(T, n_v, device=DEV)
    state = torch.randn(n_v, dk, dv, device=DEV) * 0.1
    return fused, q, k, v, g, beta, state


def bench_gdn(table: Table, quick: bool) -> None:
    n_k, n_v, dk, dv = 16, 48, 128, 128                     # Qwen3.5-27B
    state_bytes = n_v * dk * dv * 4
    for T, with_slots in ((1, False), (4, True), (16, True)):
        fused, q, k, v, g, beta, state = _gdn_inputs(T, n_k, n_v, dk, dv)
        slots = torch.empty((T + 1, n_v, dk, dv), device=DEV) if with_slots else None
        s1, s2 = state.clone(), state.clone()
        err = rel_err(gdn_recurrent_triton(q, k, v, g, beta, s1, slots),
                      gdn_recurrent_ref(q, k, v, g, beta, s2, slots.clone() if with_slots else None))
        fn = partial(gdn_recurrent_triton, q, k, v, g, beta, s1, slots)
        gpu = graph_us(fn)
        t = bench_ms(fn, True)
        r = bench_ms(partial(gdn_recurrent_ref, q, k, v, g, beta, s2, slots), quick)
        nbytes = 2 * state_bytes + (T * state_bytes if with_slots else 0) + fused.nbytes + T * n_v * dv * 4
        table.add("gdn-recurrent", f"27B Hv={n_v} T={T}{' +slots' if with_slots else ''}", gpu, t, r, nbytes,
                  err)
    for T in (512, 2048):
        fused, q, k, v, g, beta, state = _gdn_inputs(T, n_k, n_v, dk, dv)
        s1, s2 = state.clone(), state.clone()
        err = rel_err(gdn_chunked_triton(q, k, v, g, beta, s1), gdn_chunked_ref(q, k, v, g, beta, s2))
        fn = partial(gdn_chunked_triton, q, k, v, g, beta, s1)
        gpu = graph_us(fn, reps=2)
        t = bench_ms(fn, True)
        r = bench_ms(partial(gdn_chunked_ref, q, k, v, g, beta, s2), quick)
        nbytes = 2 * state_bytes + fused.nbytes + T * n_v * dv * 4
        table.add("gdn-chunked", f"27B Hv={n_v} T={T} chunk=64", gpu, t, r, nbytes, err)
        prep = graph_us(partial(_chunk_prep, q, k, v, g, beta, 64), reps=2)
        table.add("  of which prep", f"torch intra-chunk prep T={T}", prep, None, None, nbytes)


ATTN_SHORT_MODELS = [("smollm2-135M", 9, 3, 64), ("qwen3.5-4B", 16, 4, 256), ("qwen3.5-27B", 24, 4, 256)]


def sweep_short_attention() -> list[dict[str, Any]]:
    """``--attn-short``: model-dtype (bf16) attention at short contexts (512 and 2048 keys, the grid sized for a
    2048-row cache as a CUDA graph sizes it), T=16 over row blocks, key tiles and split counts, with T=1 beside
    it: a 16-row verify should cost little more than a decode step there, where latency, not bandwidth, rules."""
    from edgespec.kernels import sm_count
    from edgespec.kernels.attention.triton_attention import attention_launch_config
    results: list[dict[str, Any]] = []
    for name, n_q, n_kv, hd in ATTN_SHORT_MODELS:
        cache = make_cache(2048, n_kv, hd, False)
        for ctx in (512, 2048):
            scale = hd ** -0.5
            for T in (1, 16):
                q = torch.randn(T, n_q, hd, device=DEV, dtype=torch.bfloat16)
                start = ctx - T
                start_t = torch.tensor([start], device=DEV, dtype=torch.int32)
                ref = _attention_ref_from_cache(q.float(), cache, start, scale)
                base = attention_launch_config(T, n_q, n_kv, hd, 2048, sm_count(q.device), 2, 2)
                configs: list[dict[str, Any]] = [{}]
                if T > 1:
                    configs += [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4 if bm <= 32 else 8, **extra}
                                for bm in (16, 32, 64) for bn in (32, 64)
                                for extra in ({}, {"n_splits": 2 * base["n_splits"]})]
                for cfg in configs:
                    full = attention_launch_config(T, n_q, n_kv, hd, 2048, sm_count(q.device), 2, 2, overrides=cfg)
                    fn = partial(cached_attention_triton, q, cache, start, scale, start_t, config=cfg)
                    try:
                        err = rel_err(fn(), ref)
                        us = graph_us(fn, reps=10, rep_ms=20)
                    except Exception as exc:  # e.g. out of shared memory
                        print(f"  {name} ctx={ctx} T={T} {cfg}: {type(exc).__name__}", flush=True)
                        continue
                    shown = {k: full[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "n_splits")}
                    results.append({"model": name, "ctx": ctx, "T": T, "us": us, "err": err, "default": not cfg,
                                    **shown})
                    print(f"  {name:<13} ctx={ctx:<5} T={T:<3} {us:6.2f} us  err {err:.1e}  "
                          f"{'default ' if not cfg else ''}{shown}", flush=True)
        del cache
    return results


GDN_SWEEP_SHAPES = [("qwen3.5-4B", 16, 32), ("qwen3.5-27B", 16, 48)]      # (name, key heads, value heads)


def sweep_gdn(budget_s: float) -> list[dict[str, Any]]:
    """``--gdn-sweep``: the recurrent GDN kernel's launches (dv tile, warps) at decode (T=1, state
    written) and at a deferred verify (T=16, state untouched), Qwen3.5-4B and -27B heads, graph-timed with a cold
    L2 and checked against the torch reference. Prints us per launch and the best per case."""
    from edgespec.kernels.recurrent.triton_gdn import gdn_tile
    dk = dv = 128
    tiles = [(bv, w) for bv in (4, 8, 16, 32) for w in (1, 2, 4) if not (bv == 4 and w == 4)]
    results: list[dict[str, Any]] = []
    t0 = time.time()
    for name, n_k, n_v in GDN_SWEEP_SHAPES:
        for T, update in ((1, True), (16, False)):
            if time.time() - t0 > budget_s:
                print(f"  budget of {budget_s:.0f} s spent: {name} T={T} not run", flush=True)
                continue
            fused, q, k, v, g, beta, state = _gdn_inputs(T, n_k, n_v, dk, dv)
            ref = gdn_recurrent_ref(q, k, v, g, beta, state.clone())
            default = gdn_tile(dv)
            case = []
            for tile in tiles:
                s1 = state.clone()
                try:
                    err = rel_err(gdn_recurrent_triton(q, k, v, g, beta, s1, tile=tile), ref)
                    us = graph_us(partial(gdn_recurrent_triton, q, k, v, g, beta, s1, update_state=update,
                                          tile=tile), reps=10, rep_ms=25)
                except Exception as exc:  # a launch that does not compile is reported, not fatal
                    print(f"  {name} T={T} tile {tile}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                row = {"model": name, "T": T, "block_v": tile[0], "warps": tile[1],
                       "us": us, "err": err, "default": tile == default}
                case.append(row)
                print(f"  {name:<12} T={T:<3} BLOCK_V={tile[0]:<3} warps={tile[1]} {us:7.2f} us"
                      f"  err {err:.1e}{'  (default)' if row['default'] else ''}", flush=True)
            results.extend(case)
            if case:
                best = min(case, key=lambda r: r["us"])
                base = next((r["us"] for r in case if r["default"]), float("nan"))
                print(f"  best: {name} T={T}: {best['us']:.2f} us (default {base:.2f} us) BLOCK_V={best['block_v']} "
                      f"warps={best['warps']}", flush=True)
    return results


def bench_conv(table: Table, quick: bool) -> None:
    C, K = 10240, 4                                          # Qwen3.5-27B conv_dim, kernel 4
    for T, with_slots in ((1, False), (16, True), (64, False)):
        x = torch.randn(T, C, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(C, K, device=DEV, dtype=torch.bfloat16)
        state = torch.randn(C, K - 1, device=DEV, dtype=torch.bfloat16)
        slots = torch.empty((T + 1, C, K - 1), device=DEV, dtype=torch.bfloat16) if with_slots else None
        s1, s2 = state.clone(), state.clone()
        err = rel_err(causal_conv1d_triton(x, s1, w, slots),
                      causal_conv1d_ref(x, s2, w, slots.clone() if with_slots else None))
        fn = partial(causal_conv1d_triton, x, s1, w, slots)
        gpu = graph_us(fn)
        t = bench_ms(fn, True)
        r = bench_ms(partial(causal_conv1d_ref, x, s2, w, slots), quick)
        nbytes = 2 * x.nbytes + w.nbytes + 2 * state.nbytes + (T * state.nbytes if with_slots else 0)
        table.add("conv", f"C={C} K={K} T={T}{' +slots' if with_slots else ''}", gpu, t, r, nbytes, err)


def bench_tree(table: Table, quick: bool) -> None:
    """``--only tree``: one layer of a tree verify on the Qwen3.5-27B GDN shape (48 value heads x 128, 16 key heads
    x 128; conv_dim 10240), 33 and 64 rows of a random tree: the Triton tree GDN (the forward's launch, then
    tf32x3 products and other splits of dv) against the torch chunked reference, and the Triton tree conv (gates
    fused) against the reference conv, copy and gates it replaces. Every time is a graph replay with L2 cold."""
    gen = torch.Generator().manual_seed(0)
    for T in (33, 64):
        # Each node hangs off one of the three rows before it: a bushy tree of depth ~T/2.
        _bench_tree_layer(table, [-1] + [int(torch.randint(max(0, t - 3), t, (1,), generator=gen))
                                         for t in range(1, T)])


def _bench_tree_layer(table: Table, parents: list[int]) -> None:
    from edgespec.kernels.pointwise.activation import gdn_gates_ref
    from edgespec.kernels.verify.tree import TreeMask, gdn_tree_ref, tree_conv_ref
    from edgespec.kernels.verify.triton_tree_gdn import gdn_tree_triton

    n_k, n_v, dk, dv = 16, 48, 128, 128
    C, K, T = 2 * n_k * dk + n_v * dv, 4, len(parents)
    tree = TreeMask.from_parents(torch.tensor(parents), DEV)
    fused, q, k, v, g, beta, state = _gdn_inputs(T, n_k, n_v, dk, dv)
    nbytes = n_v * dk * dv * 4 + fused.nbytes + T * n_v * dv * 2
    ref_fn = partial(gdn_tree_ref, q, k, v, g, beta, state, tree.ancestors)
    ref = ref_fn()
    torch_us = graph_us(ref_fn)
    table.add("tree-gdn-torch", f"27B T={T} reference", torch_us, None, None, nbytes)
    for precision, parts, warps in (("ieee", 1, None), ("tf32x3", 1, None), ("ieee", 2, None),
                                    ("ieee", 1, 16), ("tf32x3", 1, 16)):
        fn = partial(gdn_tree_triton, q, k, v, g, beta, state, tree.bits, torch.bfloat16, precision=precision,
                     parts=parts, num_warps=warps)
        err = rel_err(fn(), ref)
        gpu = graph_us(fn)
        name = "tree-gdn" if (precision, parts, warps) == ("ieee", 1, None) else "  tree-gdn"
        table.add(name, f"27B T={T} {precision} parts={parts} warps={warps or 'auto'}", gpu,
                  bench_ms(fn, True), None, nbytes, err, torch_over_triton=torch_us / gpu)
    x = fused
    w = torch.randn(C, K, device=DEV, dtype=torch.bfloat16)
    cstate = torch.randn(C, K - 1, device=DEV, dtype=torch.bfloat16)
    a, b = (torch.randn(T, n_v, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    A_log, dt_bias = torch.randn(n_v, device=DEV), torch.randn(n_v, device=DEV)
    out, x_save = torch.empty_like(x), torch.empty_like(x)
    gates = (torch.empty(T, n_v, device=DEV), torch.empty(T, n_v, device=DEV))

    def conv_ref() -> None:                      # what the tree path ran before: conv, input copy, gates
        out.copy_(tree_conv_ref(x, cstate, w, tree))
        x_save.copy_(x)
        for dst, src in zip(gates, gdn_gates_ref(a, b, A_log, dt_bias), strict=True):
            dst.copy_(src)

    conv_ref()
    ref_out = out.clone()
    conv_torch = graph_us(conv_ref)
    table.add("tree-conv-torch", f"C={C} K={K} T={T} + gates, reference", conv_torch, None, None,
              3 * x.nbytes + w.nbytes)
    fn = partial(causal_conv1d_triton, x, cstate, w, update_state=False, out=out, x_save=x_save,
                 gates=(a, b, A_log, dt_bias, *gates), tree=(tree.parents, tree.depths))
    fn()
    gpu = graph_us(fn)
    table.add("tree-conv", f"C={C} K={K} T={T} + gates", gpu, bench_ms(fn, True), None, 3 * x.nbytes + w.nbytes,
              rel_err(out, ref_out), torch_over_triton=conv_torch / gpu)


def bench_norm(table: Table, quick: bool) -> None:
    for T in (1, 16, 2048):
        x = torch.randn(T, 5120, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(5120, device=DEV, dtype=torch.bfloat16) * 0.1
        err = rel_err(rms_norm_triton(x, w, 1e-6, True), rms_norm_ref(x, w, 1e-6, True))
        fn = partial(rms_norm_triton, x, w, 1e-6, True)
        gpu = graph_us(fn)
        t = bench_ms(fn, True)
        r = bench_ms(partial(rms_norm_ref, x, w, 1e-6, True), quick)
        table.add("rms-norm", f"[{T}, 5120] bf16 zero-centred", gpu, t, r, 2 * x.nbytes + w.nbytes, err)
    for T in (1, 16, 2048):
        x = torch.randn(T, 48, 128, device=DEV, dtype=torch.bfloat16)
        gate = torch.randn(T, 48, 128, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(128, device=DEV, dtype=torch.float32)
        err = rel_err(gated_rms_norm_triton(x, gate, w, 1e-6), gated_rms_norm_ref(x, gate, w, 1e-6))
        fn = partial(gated_rms_norm_triton, x, gate, w, 1e-6)
        gpu = graph_us(fn)
        t = bench_ms(fn, True)
        r = bench_ms(partial(gated_rms_norm_ref, x, gate, w, 1e-6), quick)
        table.add("gated-norm", f"[{T}, 48, 128] bf16", gpu, t, r, 3 * x.nbytes + w.nbytes, err)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-tests", action="store_true", help="do not run tests/kernels/test_kernels_gpu.py first")
    ap.add_argument("--sweep", action="store_true", help="also sweep attention launch configs at 32k")
    ap.add_argument("--quick", action="store_true", help="shorter timings; torch attention only at 32k")
    ap.add_argument("--tests-k", default=None, help="pytest -k expression to run a subset of the GPU tests")
    ap.add_argument("--only", default="attn,gdn,conv,norm", help="comma list of kernel groups to time")
    ap.add_argument("--fp8-sweep", action="store_true",
                    help="sweep the FP8-KV attention launch configs at 32k/4k (27B and 4B heads, T=1 and 16)")
    ap.add_argument("--flush", choices=("write", "read"), default="write",
                    help="how graph timings evict L2 before each call (see FLUSH_MODE)")
    ap.add_argument("--fp8-sweep-rows", default="1,16", help="comma list of query row counts --fp8-sweep times")
    ap.add_argument("--fp8-sweep-budget", type=float, default=70.0,
                    help="seconds after which --fp8-sweep starts no new case")
    ap.add_argument("--attn-short", action="store_true",
                    help="sweep bf16 attention launches at short contexts (512/2048 keys), T=16 vs T=1")
    ap.add_argument("--gdn-sweep", action="store_true",
                    help="sweep the recurrent GDN launches (dv tile, warps) at T=1 and T=16")
    args = ap.parse_args()
    install_kernel_options(load_settings())   # the kernel switches of EDGESPEC_CONFIG / EDGESPEC_* (no engine here)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 1
    FLUSH_MODE[0] = args.flush
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": triton.__version__, "flush": args.flush}
    t0 = time.time()
    if not args.skip_tests:
        import pytest
        extra = ["-k", args.tests_k] if args.tests_k else []
        rc = pytest.main(["-q", "-rf", "--tb=short", "-p", "no:cacheprovider", *extra,
                          str(ROOT / "tests" / "kernels" / "test_kernels_gpu.py")])
        report["tests_exit_code"] = int(rc)
        report["tests_s"] = time.time() - t0
        print(f"tests: exit code {int(rc)} in {report['tests_s']:.0f} s", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False             # references stay true fp32
    copy = copy_bandwidth()
    report["copy_GBps"] = copy
    print(f"device-to-device copy: {copy:.0f} GB/s (read + write)", flush=True)
    table = Table(copy)
    groups = set(args.only.split(","))
    ratios: list[dict[str, Any]] = []
    benches: list[tuple[str, Callable[[], Any]]] = [
        ("attn", lambda: ratios.extend(bench_attention(table, args.quick))),
        ("gdn", lambda: bench_gdn(table, args.quick)),
        ("conv", lambda: bench_conv(table, args.quick)),
        ("norm", lambda: bench_norm(table, args.quick)),
        ("tree", lambda: bench_tree(table, args.quick)),
    ]
    errors = []
    for group, run in benches:
        if group not in groups:
            continue
        try:
            run()
        except Exception:  # keep timing the other kernels; the failure is in the report
            errors.append(f"{group}: {traceback.format_exc()}")
            print(errors[-1], flush=True)
    report.update(rows=table.rows, fp8_vs_bf16=ratios, errors=errors)
    write_report(report)
    print()
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}  "
          f"copy {copy:.0f} GB/s  tests rc={report.get('tests_exit_code', 'skipped')}")
    print(table.render())
    if ratios:
        print("\nFP8-KV speedup over bf16-KV attention (bf16 / fp8 GPU time; target >= 1.6x at 32k):")
        for r in ratios:
            mark = "  <- below 1.6x" if r["ctx"] == 32768 and r["bf16_over_fp8"] < 1.6 else ""
            print(f"  {r['model']:<12} T={r['T']:<3} ctx={r['ctx']:<6} {r['bf16_over_fp8']:5.2f}x{mark}")
    if args.sweep:
        print("\nattention launch-config sweep at 32k:", flush=True)
        report["sweep"] = sweep_attention(args.quick)
    if args.fp8_sweep:
        print("\nFP8-KV attention launch-config sweep (us, GB/s of the FP8 bytes, speedup over bf16-KV default):",
              flush=True)
        report["fp8_sweep"] = sweep_fp8_attention(args.fp8_sweep_budget,
                                                  tuple(int(x) for x in args.fp8_sweep_rows.split(",")))
    if args.attn_short:
        print("\nshort-context bf16 attention (graph launch sized for a 2048-row cache):", flush=True)
        report["attn_short"] = sweep_short_attention()
    if args.gdn_sweep:
        print("\nrecurrent GDN launch sweep (us per launch, cold L2):", flush=True)
        report["gdn_sweep"] = sweep_gdn(args.fp8_sweep_budget)
    report["total_s"] = time.time() - t0
    write_report(report)
    print(f"total {report['total_s']:.0f} s")
    return 0


def write_report(report: dict[str, Any]) -> None:
    """JSON to ``$OUT/kernel_bench.json`` when OUT is set (rewritten as results accumulate)."""
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "kernel_bench.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
