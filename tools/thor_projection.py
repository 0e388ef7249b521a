#!/usr/bin/env python3
"""Project a lossless DFlash cycle onto a Jetson AGX Thor from a GPU measurement (a projection, not a measurement).

    python tools/thor_projection.py cycle_bench.json [more.json ...] [--al 4.57] [--thor-clock-mhz 1575]
    python tools/thor_projection.py --sm-runs c16.json c24.json [--als 4.57,6,8] [--stacks q16.json q24.json]
    python tools/thor_projection.py --sm-runs c16.json c24.json --tree-cost tree16.json [tree_full.json]
    python tools/thor_projection.py --tree-cycle-ms 41.5 [--als 4.57,6,8]
    python tools/thor_projection.py --vision vision_bench_sm16.json vision_bench_sm24.json

Input: the JSON ``tools/cycle_bench.py`` writes ($OUT/cycle_bench.json): per stage of one cycle (draft, verify,
accept+rollback, other) the time measured on the GPU, the bytes the draft and verify stages read, and the GPU's SM
count and maximum SM clock. Each stage is projected two ways and takes the slower:

* bytes: the stage's weight bytes over Thor's 273 GB/s (the floor no kernel can beat);
* SMs: the measured time scaled by (SMs x clock) of the measured GPU over Thor's 20 SMs x ``--thor-clock-mhz``.
  A stage that did not reach the measured GPU's byte limit was bound by its SMs (instructions, latency), and the
  same kernels on Thor's 20 SMs do that work at Thor's issue rate. Thor's GPU clock is an assumption (flag).

With ``--stack-json`` (``tools/quant_bench.py``'s $OUT/quant_bench.json of the same shape) a second, less
pessimistic estimate is printed: on the measured GPU the narrow matrices of a 27B step cannot fill 132 SMs (split
K, launch tails), which the SM scaling above carries over to Thor, where the same matrices fill 20 SMs several
times. The second estimate takes each format's 16-row rate on the widest matrix alone (the lm_head: the chip full),
in bytes per SM-clock, as that format's kernel throughput per Thor SM: a stage's weights then take
bytes / (rate x 20 SMs x clock), or their byte time if that is longer. The truth on a Thor lies between the two.

Projected tok/s = acceptance length / cycle time, at the published AL of the robot JSON-plan prompt (4.57) unless
``--al`` says otherwise: the measured run's drafts are random (AL 1), but a cycle's draft and verify cost do not
depend on how many drafts are accepted. ``byte limit`` is the same cycle at bytes alone (an upper bound).

Measured SM budget (files written with ``--sm-limit``, e.g. one run on 16 SMs and one on 24, what Hopper grants
around Thor's 20): instead of scaling full-chip times, each stage's time is interpolated to 20 SMs from the two
measured contexts that bracket it (throughput taken linear in SMs between them, as measured: 16 -> 24 SMs gave
1.2-1.5x), then scaled by the clock ratio (measured GPU's maximum SM clock / ``--thor-clock-mhz``), and set next to
its bytes at 259 GB/s (Thor's measured DRAM read rate) and 273 GB/s (its spec); the stage takes the slower of the
SM time and the 259 GB/s byte time. Printed for each AL of ``--als``. Assumptions, stated with the table: Thor's
SMs issue what Hopper's do per clock (its tensor cores are newer: a pessimistic bound for SM-bound stages); the
measuring GPU's memory does not bound the 16/24-SM runs (their copy rate is several times Thor's); L2 and launch
overheads scale like the SM work. ``--stacks`` does the same for ``tools/quant_bench.py --sm-limit`` files: each
format's linear stack at every row count, GB/s projected to Thor against 259 GB/s.

Tree verification: ``--tree-cost`` takes ``tools/tree_cost.py --json`` files (tree forwards of B + 1 rows, the
commit of a path, and the chain verify of 16 rows, measured on one GPU and SM budget) and, with ``--sm-runs`` of the
same shape and format, projects the tree cycle: the chain cycle of the DFlash drafter as above, its verify times
the measured tree/chain-verify ratio of that budget, its rollback replaced by the commit (scaled like the verify,
from the measured GPU to Thor). ``--tree-cycle-ms`` takes a tree cycle as it is (measured or projected elsewhere).
Both print tok/s at each AL of ``--als`` (a tree's AL comes from the drafter, not from these random weights).

Block-scaled formats (NVFP4, MXFP4): on Thor their products take the block-scaled tensor-core MMA
(``edgespec.kernels.quant.triton_block_scaled``), which no Hopper GPU has, so the SM-measured figures of such a target
are those of the Hopper kernels. Beside them the tables print an ESTIMATE: every stage whose weights are
block-scaled (the verify of an NVFP4 target, the draft of an NVFP4 drafter) at its byte time, the other stages as
projected, and, from ``--sass`` (``tools/compile_targets.py --json`` output), the sm_110a SASS lane-instructions per
weight of the block-scaled products' main loops against int4's at each row count: what the byte-bound figure
rests on (fewer instructions per weight than int4's SM-measured kernels), not a timing.

Camera frames: ``--vision`` takes ``tools/vision_bench.py --sm-limit`` files (16 and 24 SMs) and projects the vision
tower's time per frame size the same way (interpolated to 20 SMs, x the clock ratio, never below its weight bytes
at 259 GB/s), with the prefill of the frame's tokens and the frame's price in decode steps when the files timed a
text model (``--decode-shape``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

THOR_BW = 273e9
THOR_READ_BW = 259e9      # measured DRAM read rate (shared/reference/thor.md): what a byte-bound stage gets
THOR_SMS = 20
DEFAULT_ALS = "4.57,6,8"


# cycle_bench's target formats and drafter_weights -> quant_bench's stack names
STACK_NAMES = {"dense": "bf16", "model": "bf16", "fp8": "fp8_block", "nvfp4": "nvfp4", "int4": "int4"}


def project(run: dict, meta: dict, al: float, clock_mhz: float, rates: dict[str, float] | None = None) -> dict:
    """Projected cycle of one proposer's run (``run``: cycle_bench's split with ``draft_bytes`` and, for the
    second estimate, ``drafter_bytes``/``head_bytes``/``drafter_weights``; ``meta``: the file's header;
    ``rates``: bytes per SM-clock of each stack name's 16-row product with the chip full)."""
    thor_clock = THOR_SMS * clock_mhz * 1e6
    scale = (meta["sms"] * meta["sm_clock_mhz"]) / (THOR_SMS * clock_mhz)
    stages = {"verify": (run["verify_ms_per_cycle"], meta["verify_bytes"]),
              "draft": (run["draft_ms_per_cycle"], run.get("draft_bytes", 0)),
              "accept": (run["accept_rollback_ms_per_cycle"], 0),
              "other": (run["other_ms_per_cycle"], 0)}
    kernel_ms = {}
    if rates is not None:
        # the output projection runs in its own format (lm_head_weights), the rest of a verify in the target's
        head_rate = rates[STACK_NAMES[meta.get("lm_head", "model")]]
        head = meta.get("head_bytes", run["head_bytes"])
        kernel_ms["verify"] = ((meta["verify_bytes"] - head) / rates[STACK_NAMES[meta["format"]]]
                               + head / head_rate) / thor_clock * 1e3
        kernel_ms["draft"] = (run["drafter_bytes"] / rates[STACK_NAMES[run["drafter_weights"]]]
                              + run["head_bytes"] / head_rate) / thor_clock * 1e3
    out = {"stages": {}}
    for name, (ms, nbytes) in stages.items():
        bytes_ms, sm_ms = nbytes / THOR_BW * 1e3, ms * scale
        stage = {"bytes_ms": bytes_ms, "sm_ms": sm_ms, "ms": max(bytes_ms, sm_ms),
                 "bound": "bytes" if bytes_ms >= sm_ms else "SMs"}
        k_ms = kernel_ms.get(name, sm_ms)
        stage.update(kernel_ms=max(bytes_ms, k_ms), kernel_bound="bytes" if bytes_ms >= k_ms else "SMs")
        out["stages"][name] = stage
    cycle = sum(s["ms"] for s in out["stages"].values())
    floor = sum(s["bytes_ms"] for s in out["stages"].values())
    out.update(cycle_ms=cycle, tok_s=al / cycle * 1e3, byte_limit_tok_s=al / floor * 1e3 if floor else float("inf"))
    if rates is not None:
        kernel_cycle = sum(s["kernel_ms"] for s in out["stages"].values())
        out.update(kernel_cycle_ms=kernel_cycle, kernel_tok_s=al / kernel_cycle * 1e3)
    return out


def stack_rates(path: str, shape: str) -> dict[str, float]:
    """Bytes per SM-clock of each format's 16-row product on the widest matrix of ``shape`` (quant_bench.json)."""
    data = json.loads(Path(path).read_text())
    entries = data.get("shapes", {}).get(shape, {})
    rates = {fmt: e["filled"]["bytes_per_sm_clock_16"] for fmt, e in entries.items()
             if isinstance(e, dict) and "bytes_per_sm_clock_16" in e.get("filled", {})}
    if "bf16" not in rates:
        raise ValueError(f"{path}: no bf16 rate for {shape} (run tools/quant_bench.py with its baselines)")
    return rates


def interpolate_ms(points: dict[int, float], sms: float) -> float:
    """Time at ``sms`` SMs from times measured at other SM counts (``points``: SMs -> ms): the rate (1 / time) is
    taken linear in SMs between the nearest measured counts below and above (an exact count is returned as it is).
    Raises ValueError when the measurements do not bracket ``sms``."""
    if sms in points:
        return points[sms]
    below = [n for n in points if n < sms]
    above = [n for n in points if n > sms]
    if not below or not above:
        raise ValueError(f"SM counts {sorted(points)} do not bracket {sms:g} (run --sm-limit below and above it)")
    lo, hi = max(below), min(above)
    if points[lo] <= 0 or points[hi] <= 0:       # a stage that took no time (rounded to 0): times in between
        return points[lo] + (points[hi] - points[lo]) * (sms - lo) / (hi - lo)
    rate = 1 / points[lo] + (1 / points[hi] - 1 / points[lo]) * (sms - lo) / (hi - lo)
    return 1 / rate


def project_measured(runs: dict[int, dict], metas: dict[int, dict], als: list[float], clock_mhz: float) -> dict:
    """One proposer's cycle on Thor from runs on several SM budgets (``runs``/``metas``: granted SMs -> the
    proposer's split with ``draft_bytes``, and the file's header): per stage the time interpolated to 20 SMs,
    scaled by the clock ratio, beside its bytes at 259 and 273 GB/s; tok/s at each AL of ``als``."""
    meta = next(iter(metas.values()))
    clock_ratio = meta["sm_clock_mhz"] / clock_mhz
    stages = {"verify": ("verify_ms_per_cycle", meta["verify_bytes"]),
              "draft": ("draft_ms_per_cycle", next(iter(runs.values())).get("draft_bytes", 0)),
              "accept": ("accept_rollback_ms_per_cycle", 0), "other": ("other_ms_per_cycle", 0)}
    out = {"stages": {}, "sms": sorted(runs), "clock_ratio": clock_ratio}
    for name, (key, nbytes) in stages.items():
        measured = {n: r[key] for n, r in runs.items()}
        at20 = interpolate_ms(measured, THOR_SMS)
        sm_ms = at20 * clock_ratio
        bytes_ms = nbytes / THOR_READ_BW * 1e3
        out["stages"][name] = {"measured_ms": measured, "ms_20_sms": at20, "sm_ms": sm_ms, "bytes_ms": bytes_ms,
                               "bytes_ms_spec": nbytes / THOR_BW * 1e3, "ms": max(sm_ms, bytes_ms),
                               "bound": "bytes" if bytes_ms >= sm_ms else "SMs"}
    cycle = sum(st["ms"] for st in out["stages"].values())
    floor = sum(st["bytes_ms"] for st in out["stages"].values())
    out.update(cycle_ms=cycle, byte_cycle_ms=floor, tok_s={al: al / cycle * 1e3 for al in als},
               byte_limit_tok_s={al: al / floor * 1e3 for al in als} if floor else {})
    return out


def _load(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a JSON file ({e})") from e


# Formats whose products take the block-scaled tensor-core MMA on Thor (edgespec.kernels.quant.block_scaled_ref's
# BLOCK_SCALED_FORMATS, which ThorHooks routes there); the packed-product kernels whose main loops
# tools/compile_targets.py counts, by weight format (kernel name prefixes); the target the counts are read for.
BLOCK_SCALED_FORMATS = ("nvfp4", "mxfp4")
PRODUCT_KERNELS = {"int4": "_int4", "nvfp4": "_block_scaled_kernel", "mxfp4": "_block_scaled_kernel"}
SASS_TARGET = "sm_110a"
STAGES = ("decode", "verify16", "verify32", "verify64", "prefill")
_SASS_KEYS = {"target", "format", "kernel", "stage", "instructions_per_weight"}


def sass_counts(path: str, target: str = SASS_TARGET) -> dict[str, dict[str, tuple[float, float]]]:
    """Lane-instructions per weight of each format's packed-product main loop on ``target`` (the formats of
    :data:`PRODUCT_KERNELS` the file holds), per stage (lowest, highest) over the kernels that stage launches, from
    a ``tools/compile_targets.py --json`` file. A block-scaled format counts only products whose SASS holds the
    block-scaled MMA; int4's go by kernel name whichever format's forward compiled them first (the tool lists each
    compiled kernel once). Raises ValueError for a file that is not such a list or holds no product for ``target``."""
    rows = _load(path)
    if not isinstance(rows, list) or not all(isinstance(r, dict) and _SASS_KEYS <= r.keys() for r in rows):
        raise ValueError(f"{path}: not a tools/compile_targets.py --json file (a list of compiled kernels with "
                         f"{', '.join(sorted(_SASS_KEYS))})")
    out = {}
    for fmt, prefix in PRODUCT_KERNELS.items():
        block = fmt in BLOCK_SCALED_FORMATS
        counts: dict[str, tuple[float, float]] = {}
        for r in rows:
            v = r["instructions_per_weight"]
            if (r["target"] != target or not r["kernel"].startswith(prefix) or r.get("error") or not v
                    or (block and (r["format"] != fmt or not r.get("block_scaled")))):
                continue
            lo, hi = counts.get(r["stage"], (v, v))
            counts[r["stage"]] = (min(lo, v), max(hi, v))
        if counts:
            out[fmt] = {st: counts[st] for st in sorted(counts, key=lambda st: (*STAGES, st).index(st))}
    if not out:
        raise ValueError(f"{path}: no packed product compiled for {target}")
    out["path"] = path
    return out


def sass_line(counts: dict, fmt: str) -> str:
    """``fmt``'s counts against int4's at each stage both list, as printed under a block-scaled target; raises
    ValueError when the file lacks either format."""
    for need in (fmt, "int4"):
        if need not in counts:
            raise ValueError(f"{counts['path']}: no {need} product compiled for {SASS_TARGET} (write it with python "
                             f"tools/compile_targets.py --targets {SASS_TARGET} --formats {fmt},int4 --json FILE)")

    def cell(lo_hi: tuple[float, float]) -> str:
        lo, hi = lo_hi
        return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}"
    ours, int4 = counts[fmt], counts["int4"]
    cells = [f"{st} {cell(ours[st])} / {cell(int4[st])}" for st in ours if st in int4]
    return (f"  {SASS_TARGET} SASS main loop, lane-instructions per weight, {fmt} (block-scaled MMA) / int4: "
            + (", ".join(cells) or "no stage compiled for both"))


def block_scaled_stages(fmt: str, proposer: str) -> dict[str, str]:
    """The stages of a cycle whose weights take Thor's block-scaled MMA, with their format: the verify of a
    block-scaled target ``fmt``, the draft of a drafter with block-scaled weights (proposer ``dflash-<weights>``)."""
    drafter = proposer.split("-", 1)[1] if proposer.startswith("dflash-") else ""
    return {stage: f for stage, f in (("verify", fmt), ("draft", drafter)) if f in BLOCK_SCALED_FORMATS}


def block_scaled_estimate(stages: dict[str, dict], block_scaled: dict[str, str], als: list[float]) -> dict:
    """The cycle with the ``block_scaled`` stages at their byte time and the others as projected (an estimate: the
    block-scaled kernels have not run on a Thor; :func:`sass_line` prints what it rests on)."""
    cycle = sum(st["bytes_ms"] if name in block_scaled else st["ms"] for name, st in stages.items())
    return {"cycle_ms": cycle, "tok_s": {al: al / cycle * 1e3 for al in als}}


def estimate_line(p: dict, block_scaled: dict[str, str], als: list[float], bw: float) -> str:
    """The ESTIMATE printed under a proposer whose stages ``block_scaled`` take the block-scaled MMA on Thor."""
    e = block_scaled_estimate(p["stages"], block_scaled, als)
    rates = ", ".join(f"AL {al:g}: {t:.1f}" for al, t in e["tok_s"].items())
    its = "its" if len(block_scaled) == 1 else "their"
    return (f"  ESTIMATE on Thor's block-scaled MMA: {' and '.join(block_scaled)} at {its} bytes "
            f"({bw / 1e9:.0f} GB/s), the rest as above: cycle {e['cycle_ms']:.1f} ms, tok/s {rates} (the SM figures "
            "above are of the Hopper kernels)")


def print_sass(counts: dict | None, formats: set[str]) -> None:
    """The SASS lines of the block-scaled ``formats`` a table printed (or how to get them)."""
    for fmt in sorted(formats):
        print(sass_line(counts, fmt) if counts else f"  {fmt}: pass --sass (tools/compile_targets.py --targets "
              f"{SASS_TARGET} --formats {fmt},int4 --json FILE) for the {SASS_TARGET} instruction counts")


def measured_sm_table(paths: list[str], als: list[float], clock_mhz: float, sass: dict | None = None) -> int:
    """Print the measured-SM projection of cycle_bench files written with --sm-limit, grouped by target."""
    groups: dict[tuple, dict[int, dict]] = {}
    for path in paths:
        meta = _load(path)
        if not meta.get("sm_limit") or not meta.get("sm_clock_mhz") or not meta.get("verify_bytes"):
            raise ValueError(f"{path}: not a cycle_bench.json written with --sm-limit (no sm_limit, sm_clock_mhz "
                             "or verify_bytes)")
        key = (meta["shape"], meta["format"], meta.get("lm_head", "model"))
        granted = meta["sm_limit"]["granted"]
        if granted in groups.setdefault(key, {}):
            raise ValueError(f"{path}: a second run of {' '.join(key)} on {granted} SMs")
        groups[key][granted] = meta
    print(f"Jetson AGX Thor PROJECTION from measured SM budgets: stage times interpolated to {THOR_SMS} SMs, x "
          f"clock ratio (max SM clock / {clock_mhz:.0f} MHz), against bytes at {THOR_READ_BW / 1e9:.0f} GB/s "
          f"(measured read) and {THOR_BW / 1e9:.0f} GB/s (spec)")
    print("assumptions: Thor's SMs do per clock what the measuring GPU's do (its newer tensor cores only help); the "
          "16/24-SM runs are not bound by the measuring GPU's memory; overheads scale like the SM work")
    als_head = " ".join(f"{'AL ' + format(al, 'g'):>7}" for al in als)
    print(f"{'target':<30} {'drafter':<13} {'stage':<7} {'measured ms (SMs)':<22} {'20 SMs':>7} {'Thor SM':>7} "
          f"{'259GB/s':>7} {'273GB/s':>7} {'bound':>5}   cycle ms  tok/s {als_head}  (byte limit)")
    for key, metas in groups.items():
        sample = next(iter(metas.values()))
        block_formats: set[str] = set()
        for name in [n for n, r in sample.items() if isinstance(r, dict) and "verify_ms_per_cycle" in r]:
            runs = {n: {**m[name], "draft_bytes": m.get(f"{name}_draft_bytes", 0)} for n, m in metas.items()
                    if name in m}
            p = project_measured(runs, {n: metas[n] for n in runs}, als, clock_mhz)
            target = f"{key[0]} {key[1]}" + (f" head {key[2]}" if key[2] != "model" else "")
            for i, (stage, st) in enumerate(p["stages"].items()):
                measured = ", ".join(f"{ms:.2f} ({n})" for n, ms in sorted(st["measured_ms"].items()))
                tail = ""
                if i == 0:
                    rates = " ".join(f"{p['tok_s'][al]:>7.1f}" for al in als)
                    limit = " ".join(f"{p['byte_limit_tok_s'][al]:.1f}" for al in als) if p["byte_limit_tok_s"] else ""
                    tail = f"   {p['cycle_ms']:8.1f}        {rates}  ({limit})"
                print(f"{target if i == 0 else '':<30} {name if i == 0 else '':<13} {stage:<7} {measured:<22} "
                      f"{st['ms_20_sms']:>7.2f} {st['sm_ms']:>7.2f} {st['bytes_ms']:>7.2f} {st['bytes_ms_spec']:>7.2f} "
                      f"{st['bound']:>5}{tail}")
            if block := block_scaled_stages(key[1], name):
                print(estimate_line(p, block, als, THOR_READ_BW))
                block_formats |= set(block.values())
        print(f"measured on: {sample['device']} ({', '.join(str(n) for n in sorted(metas))} SMs granted, "
              f"{sample['sm_clock_mhz']} MHz max SM clock)")
        print_sass(sass, block_formats)
    return 0


def _by_granted(paths: list[str], needs: str, kind: str) -> dict[int, dict]:
    """The JSON files written with --sm-limit, by the SM count granted; refuses one without ``sm_limit`` or
    ``needs`` by name."""
    runs: dict[int, dict] = {}
    for path in paths:
        data = _load(path)
        if not data.get("sm_limit") or not data.get(needs):
            raise ValueError(f"{path}: not a {kind} written with --sm-limit (no sm_limit or {needs})")
        runs[data["sm_limit"]["granted"]] = data
    return runs


def stack_table(paths: list[str], clock_mhz: float) -> int:
    """Print each format's linear stack (quant_bench --sm-limit files) projected to Thor at every row count."""
    runs = _by_granted(paths, "sm_clock_mhz", "quant_bench.json")
    sample = next(iter(runs.values()))
    ratio = sample["sm_clock_mhz"] / clock_mhz
    print(f"Linear stacks projected to Thor ({THOR_SMS} SMs interpolated from {sorted(runs)}, x{ratio:.3f} clock): "
          f"GB/s (a stack is byte-bound on Thor at >= {THOR_READ_BW / 1e9:.0f})")
    for shape, entries in sample["shapes"].items():
        for fmt, e in entries.items():
            rows = sorted(int(k[3:]) for k in e if k.startswith("us_") and k[3:].isdigit())
            cells = []
            for r in rows:
                us = interpolate_ms({n: d["shapes"][shape][fmt][f"us_{r}"] for n, d in runs.items()}, THOR_SMS)
                gbps = e["bytes"] / (us * ratio) / 1e3
                cells.append(f"{r}: {gbps:4.0f} ({min(gbps, THOR_READ_BW / 1e9) / (THOR_READ_BW / 1e9) * 100:3.0f}%)")
            print(f"  {shape} {fmt:>10} {e['bytes'] / 1e9:6.2f} GB  " + "  ".join(cells))
    return 0


MTP_ALS = "2.43,2.87"      # FlashRT's MTP acceptance lengths on Thor (prose .. robot JSON plan)


def moe_projection(paths: list[str], als: list[float], clock_mhz: float, k: int) -> dict:
    """Plain decode and an MTP-class cycle (K drafts, a K+1-row verify) of an MoE target on Thor, from
    ``tools/moe_int4_bench.py model --sm-limit`` files bracketing 20 SMs. Each forward: its time interpolated to 20
    SMs x the clock ratio, or its bytes (routing as seen) at 259 GB/s if longer. A draft step is one MTP decoder
    layer plus the output projection: its bytes are a decode's dense share per layer, k experts and the head, and
    it is assumed to run at the projected decode's bytes per ms (the MTP head was not in the measured model)."""
    runs = {}
    for path in paths:
        data = _load(path)
        if not data.get("sm_limit") or "verify" not in data or "moe" not in data:
            raise ValueError(f"{path}: not a tools/moe_int4_bench.py model file written with --sm-limit")
        runs[int(data["sms"])] = data
    sample = next(iter(runs.values()))
    ratio = sample["sm_clock_mhz"] / clock_mhz
    bw = {n: d["bandwidth_GBps"] * 1e9 for n, d in runs.items()}

    def forward(key: str) -> dict:
        ms = {n: (d["decode_ms"] if key == "decode" else d["verify"][key]["ms"]) for n, d in runs.items()}
        limit = {n: (d["decode_limit_ms"] if key == "decode" else d["verify"][key]["limit_ms"])
                 for n, d in runs.items()}
        nbytes = sum(limit[n] / 1e3 * bw[n] for n in runs) / len(runs)      # the routing seen, averaged over runs
        sm_ms = interpolate_ms(ms, THOR_SMS) * ratio
        bytes_ms = nbytes / THOR_READ_BW * 1e3
        union = {n: d["verify"][key]["expert_union"] for n, d in runs.items()} if key != "decode" else {}
        return {"measured_ms": ms, "sm_ms": sm_ms, "bytes": nbytes, "bytes_ms": bytes_ms,
                "ms": max(sm_ms, bytes_ms), "bound": "bytes" if bytes_ms >= sm_ms else "SMs", "union": union}

    missing = [n for n, d in runs.items() if str(k + 1) not in d["verify"]]
    if missing:
        raise ValueError(f"--mtp-k {k}: no verify of {k + 1} rows in the {missing}-SM runs (measured: "
                         f"{', '.join(sorted(sample['verify'], key=int))} rows)")
    decode = forward("decode")
    verify = forward(str(k + 1))
    moe = sample["moe"]
    head = sample["head_bytes"]
    layer_dense = (decode["bytes"] - moe["layers"] * moe["top_k"] * moe["per_expert_MB"] * 1e6 - head) / moe["layers"]
    draft_bytes = layer_dense + moe["top_k"] * moe["per_expert_MB"] * 1e6 + head
    draft_ms = decode["ms"] * draft_bytes / decode["bytes"]
    cycle = verify["ms"] + k * draft_ms
    return {"decode": decode, "verify": verify, "k": k, "draft_bytes": draft_bytes, "draft_ms": draft_ms,
            "cycle_ms": cycle, "plain_tok_s": 1e3 / decode["ms"], "tok_s": {al: al / cycle * 1e3 for al in als},
            "clock_ratio": ratio, "sms": sorted(runs), "device": sample["device"]}


def moe_table(paths: list[str], als: list[float], clock_mhz: float, k: int) -> int:
    """Print :func:`moe_projection`."""
    p = moe_projection(paths, als, clock_mhz, k)
    print(f"Jetson AGX Thor PROJECTION of an MoE target from {p['sms']}-SM runs on {p['device']} "
          f"(x{p['clock_ratio']:.3f} clock to {clock_mhz:.0f} MHz; bytes at {THOR_READ_BW / 1e9:.0f} GB/s; the "
          "slower of the two)")
    for name, f in (("decode (1 row)", p["decode"]), (f"verify ({k + 1} rows)", p["verify"])):
        measured = ", ".join(f"{ms:.2f} ({n})" for n, ms in sorted(f["measured_ms"].items()))
        union = ", ".join(f"{u:.1f} ({n})" for n, u in sorted(f["union"].items()))
        print(f"  {name:<16} measured ms {measured}; Thor SMs {f['sm_ms']:.2f} ms, bytes {f['bytes'] / 1e9:.2f} GB = "
              f"{f['bytes_ms']:.2f} ms -> {f['ms']:.2f} ms ({f['bound']})"
              + (f"; expert union per layer assumed {union} of 256 (random weights: near-uniform routing overstates"
                 " a trained router's union)" if union else ""))
    print(f"  MTP draft step (assumed at the decode's bytes/ms): {p['draft_bytes'] / 1e9:.3f} GB = "
          f"{p['draft_ms']:.2f} ms; cycle = verify + {k} drafts = {p['cycle_ms']:.2f} ms")
    print(f"  plain decode {p['plain_tok_s']:.1f} tok/s; MTP-class K={k}: "
          + ", ".join(f"AL {al:g}: {t:.1f} tok/s" for al, t in p["tok_s"].items()))
    return 0


def tree_cycles(tree_paths: list[str], sm_paths: list[str], clock_mhz: float) -> list[tuple[str, float]]:
    """``(label, projected Thor cycle ms)`` of every tree budget in the tree_cost files, from the DFlash chain cycle
    the ``--sm-runs`` files project for the same shape and format (see the module doc)."""
    metas = _by_granted(sm_paths, "verify_bytes", "cycle_bench.json")
    out = []
    for path in tree_paths:
        tree = _load(path)
        if "trees" not in tree or "chain_base_ms" not in tree:
            raise ValueError(f"{path}: not a tools/tree_cost.py --json file (no trees or chain_base_ms)")
        same = {n: m for n, m in metas.items() if (m["shape"], m["format"]) == (tree["shape"], tree["format"])}
        name = next((k for m in same.values() for k in m if k.startswith("dflash") and isinstance(m[k], dict)
                     and "verify_ms_per_cycle" in m[k]), None)
        if name is None:
            raise ValueError(f"{path}: no --sm-runs cycle of {tree['shape']} {tree['format']} with a DFlash drafter")
        runs = {n: {**m[name], "draft_bytes": m.get(f"{name}_draft_bytes", 0)} for n, m in same.items() if name in m}
        chain = project_measured(runs, {n: same[n] for n in runs}, [1.0], clock_mhz)
        st = chain["stages"]
        verify = st["verify"]["ms"]
        # Thor ms per measured ms of the chain verify on this file's GPU and SM budget: the commit scales alike.
        scale = verify / tree["chain_base_ms"]
        sms = tree["sm_limit"]["granted"] if tree.get("sm_limit") else tree["sms"]
        for t in tree["trees"]:
            cycle = st["draft"]["ms"] + st["other"]["ms"] + verify * t["tree_over_chain_base"] + t["commit_ms"] * scale
            label = (f"{tree['shape']} {tree['format']} B={t['budget']} (ratio {t['tree_over_chain_base']:.2f}, "
                     f"commit {t['commit_ms']:.2f} ms on {sms} SMs{', graphs' if tree.get('graphs') else ''}"
                     f"{', runtime' if tree.get('runtime') else ''})")
            out.append((label, cycle))
    return out


def print_tree_cycles(cycles: list[tuple[str, float]], als: list[float]) -> None:
    heads = " ".join(f"{'AL ' + format(al, 'g'):>7}" for al in als)
    print(f"Tree cycle on Thor (PROJECTION): tok/s = AL / cycle\n{'tree':<72} {'cycle ms':>8} {heads}")
    for label, ms in cycles:
        print(f"{label:<72} {ms:>8.1f} " + " ".join(f"{al / ms * 1e3:>7.1f}" for al in als))


def vision_projection(paths: list[str], clock_mhz: float) -> dict:
    """Each camera frame of ``tools/vision_bench.py --sm-limit`` files (16 and 24 SMs) on Thor: the tower's time
    (and, when the files timed a text model, the prefill of the frame's tokens and a decode step) interpolated to 20
    SMs and scaled by the clock ratio, against the tower's weight bytes at 259 GB/s (it reads them once a frame)."""
    runs = _by_granted(paths, "frames", "tools/vision_bench.py file")
    sample = next(iter(runs.values()))
    clock_ratio = sample["sm_clock_mhz"] / clock_mhz
    tower_bytes_ms = sample["tower_bytes"] / THOR_READ_BW * 1e3

    def at_thor(values: dict[int, float]) -> float:
        return interpolate_ms(values, THOR_SMS) * clock_ratio

    frames = []
    for i, f in enumerate(sample["frames"]):
        tower = at_thor({n: r["frames"][i]["tower_ms"] for n, r in runs.items()})
        row = {"frame": f["frame"], "tokens": f["tokens"], "tflop": f["tflop"], "tower_ms": max(tower, tower_bytes_ms),
               "bound": "bytes" if tower_bytes_ms >= tower else "SMs",
               "measured_ms": {n: r["frames"][i]["tower_ms"] for n, r in runs.items()}}
        if all("prefill_ms" in r["frames"][i] for r in runs.values()):
            row["prefill_ms"] = at_thor({n: r["frames"][i]["prefill_ms"] for n, r in runs.items()})
        frames.append(row)
    out = {"sms": sorted(runs), "clock_ratio": clock_ratio, "tower_bytes": sample["tower_bytes"], "frames": frames,
           "device": sample["device"]}
    if all("text" in r for r in runs.values()):
        text = sample["text"]
        # a decode step reads every weight once: it cannot beat its bytes at Thor's read rate
        decode = max(at_thor({n: r["text"]["decode_ms"] for n, r in runs.items()}),
                     text["weight_bytes"] / THOR_READ_BW * 1e3)
        out["text"] = {"shape": text["shape"], "format": text["format"], "decode_ms": decode}
        for row in frames:
            row["decode_steps"] = (row["tower_ms"] + row.get("prefill_ms", 0.0)) / decode
    return out


def vision_table(paths: list[str], clock_mhz: float) -> int:
    """Print :func:`vision_projection`."""
    p = vision_projection(paths, clock_mhz)
    print(f"Jetson AGX Thor PROJECTION of the vision tower ({p['tower_bytes'] / 1e9:.2f} GB bf16) from "
          f"{'/'.join(map(str, p['sms']))}-SM runs on {p['device']}: times interpolated to {THOR_SMS} SMs x clock "
          f"ratio {p['clock_ratio']:.2f}, tower bytes at {THOR_READ_BW / 1e9:.0f} GB/s as the floor")
    text = p.get("text")
    if text:
        print(f"text model {text['shape']} {text['format']}: decode {text['decode_ms']:.2f} ms/token "
              f"({1e3 / text['decode_ms']:.1f} tok/s plain)")
    print(f"{'frame':<11} {'tokens':>6} {'TFLOP':>6} {'measured tower ms (SMs)':<28} {'Thor tower ms':>13} {'bound':>5}"
          + (f" {'prefill ms':>10} {'decode steps':>12}" if text else ""))
    for f in p["frames"]:
        measured = ", ".join(f"{ms:.1f} ({n})" for n, ms in sorted(f["measured_ms"].items()))
        tail = (f" {f.get('prefill_ms', float('nan')):>10.1f} {f['decode_steps']:>12.1f}" if text else "")
        print(f"{f['frame']:<11} {f['tokens']:>6} {f['tflop']:>6.2f} {measured:<28} {f['tower_ms']:>13.1f} "
              f"{f['bound']:>5}{tail}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="cycle_bench.json files (full chip)")
    ap.add_argument("--al", type=float, default=4.57, help="acceptance length (default: FlashRT's robot JSON plan)")
    ap.add_argument("--thor-clock-mhz", type=float, default=1575.0,
                    help="Thor GPU clock assumed for SM-bound stages (MHz)")
    ap.add_argument("--stack-json", help="quant_bench.json of the same shapes: adds the full-chip kernel estimate")
    ap.add_argument("--sm-runs", nargs="+", default=[], help="cycle_bench.json files written with --sm-limit "
                    "(SM counts bracketing 20, e.g. 16 and 24): the measured-SM projection")
    ap.add_argument("--stacks", nargs="+", default=[], help="quant_bench.json files written with --sm-limit: each "
                    "stack projected to Thor")
    ap.add_argument("--als", default=DEFAULT_ALS, help="acceptance lengths of the measured-SM table")
    ap.add_argument("--moe", nargs="+", default=[], help="tools/moe_int4_bench.py model files written with "
                    "--sm-limit (16 and 24): plain decode and an MTP-class cycle of the MoE target on Thor")
    ap.add_argument("--mtp-als", default=MTP_ALS, help="with --moe: acceptance lengths of MTP-class drafting")
    ap.add_argument("--mtp-k", type=int, default=3, help="with --moe: drafts per cycle")
    ap.add_argument("--tree-cost", nargs="+", default=[], help="tools/tree_cost.py --json files: the tree cycle "
                    "projected from --sm-runs of the same shape and format")
    ap.add_argument("--tree-cycle-ms", type=float, default=None, help="a tree cycle (ms): tok/s at each AL of --als")
    ap.add_argument("--sass", help="tools/compile_targets.py --json output with sm_110a block-scaled and int4 "
                    "products: their instruction counts beside the block-scaled estimate")
    ap.add_argument("--vision", nargs="+", default=[], help="tools/vision_bench.py files written with --sm-limit (16 "
                    "and 24): the vision tower per camera frame on Thor, beside the text model's decode step")
    args = ap.parse_args(argv)
    try:
        sass = sass_counts(args.sass) if args.sass else None
    except ValueError as e:
        print(f"thor_projection: {e}", file=sys.stderr)
        return 2
    if args.vision:
        try:
            return vision_table(args.vision, args.thor_clock_mhz)
        except (ValueError, KeyError) as e:
            print(f"thor_projection: {e}", file=sys.stderr)
            return 2
    if args.moe:
        try:
            return moe_table(args.moe, [float(a) for a in args.mtp_als.split(",") if a], args.thor_clock_mhz,
                             args.mtp_k)
        except (ValueError, KeyError) as e:
            print(f"thor_projection: {e}", file=sys.stderr)
            return 2
    if args.tree_cost or args.tree_cycle_ms is not None:
        try:
            als = [float(a) for a in args.als.split(",") if a]
            cycles = []
            if args.tree_cycle_ms is not None:
                if not args.tree_cycle_ms > 0:
                    raise ValueError(f"--tree-cycle-ms {args.tree_cycle_ms} must be positive")
                cycles.append(("given", args.tree_cycle_ms))
            if args.tree_cost:
                if not args.sm_runs:
                    raise ValueError("--tree-cost needs --sm-runs (the chain cycle it scales)")
                cycles += tree_cycles(args.tree_cost, args.sm_runs, args.thor_clock_mhz)
            print_tree_cycles(cycles, als)
        except (ValueError, KeyError) as e:
            print(f"thor_projection: {e}", file=sys.stderr)
            return 2
        if not (args.sm_runs or args.stacks or args.files):
            return 0
    if args.sm_runs or args.stacks:
        try:
            als = [float(a) for a in args.als.split(",") if a]
            if args.sm_runs:
                measured_sm_table(args.sm_runs, als, args.thor_clock_mhz, sass)
            if args.stacks:
                stack_table(args.stacks, args.thor_clock_mhz)
        except (ValueError, KeyError) as e:
            print(f"thor_projection: {e}", file=sys.stderr)
            return 2
        if not args.files:
            return 0
    if not args.files:
        ap.error("give cycle_bench.json files (full chip), --sm-runs or --stacks")
    print(f"Jetson AGX Thor PROJECTION: {THOR_BW / 1e9:.0f} GB/s, {THOR_SMS} SMs at an assumed "
          f"{args.thor_clock_mhz:.0f} MHz, AL {args.al}")
    second = f" {'tok/s (full-chip rate)':>22}" if args.stack_json else ""
    print(f"{'target':<28} {'drafter':<14} {'verify GB':>9} {'draft GB':>8} {'verify ms':>15} {'draft ms':>15} "
          f"{'cycle ms':>8} {'tok/s':>6}{second} {'byte limit':>10} {'peak GB (measured)':>18}")
    block_formats: set[str] = set()
    for path in args.files:
        try:
            meta = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"{path}: cannot read a cycle_bench.json ({e})", file=sys.stderr)
            return 2
        missing = [k for k in ("sms", "sm_clock_mhz", "verify_bytes") if not meta.get(k)]
        if missing:
            print(f"{path}: no {', '.join(missing)} (written by an older tools/cycle_bench.py)", file=sys.stderr)
            return 2
        for name, run in meta.items():
            if not (isinstance(run, dict) and "verify_ms_per_cycle" in run and name.startswith("dflash")):
                continue
            run = {**run, "drafter_weights": name.split("-", 1)[1],
                   **{f"{part}_bytes": meta.get(f"{name}_{part}_bytes", 0) for part in ("draft", "drafter", "head")}}
            try:
                rates = stack_rates(args.stack_json, meta["shape"]) if args.stack_json else None
                p = project(run, meta, args.al, args.thor_clock_mhz, rates)
            except (OSError, ValueError, KeyError) as e:
                print(f"{args.stack_json}: no full-chip rate for {meta['shape']} {meta['format']} / {name} ({e})",
                      file=sys.stderr)
                return 2
            v, d = p["stages"]["verify"], p["stages"]["draft"]
            kernel = (f" {p['kernel_tok_s']:>6.1f} (verify {v['kernel_ms']:>5.1f} ms {v['kernel_bound']:>5})"
                      if rates else "")
            target = f"{meta['shape']} {meta['format']}" + (f" head {meta['lm_head']}"
                                                             if meta.get("lm_head", "model") != "model" else "")
            print(f"{target:<28} {name:<14} {meta['verify_bytes'] / 1e9:>9.2f} "
                  f"{run['draft_bytes'] / 1e9:>8.2f} {v['ms']:>8.1f} ({v['bound']:>5}) {d['ms']:>8.1f} "
                  f"({d['bound']:>5}) {p['cycle_ms']:>8.1f} {p['tok_s']:>6.1f}{kernel} "
                  f"{p['byte_limit_tok_s']:>10.1f} {run['peak_GB']:>9.1f} ({meta['max_len']} ctx)")
            if block := block_scaled_stages(meta["format"], name):
                print(estimate_line(p, block, [args.al], THOR_BW))
                block_formats |= set(block.values())
    print(f"measured on: {meta['device']} ({meta['sms']} SMs, {meta['sm_clock_mhz']} MHz max SM clock)")
    try:
        print_sass(sass, block_formats)
    except ValueError as e:
        print(f"thor_projection: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
