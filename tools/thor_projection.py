#!/usr/bin/env python3
"""Project a lossless DFlash cycle onto a Jetson AGX Thor from a GPU measurement (a projection, not a measurement).

    python tools/thor_projection.py cycle_bench.json [more.json ...] [--al 4.57] [--thor-clock-mhz 1575]

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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

THOR_BW = 273e9
THOR_SMS = 20


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="cycle_bench.json files")
    ap.add_argument("--al", type=float, default=4.57, help="acceptance length (default: FlashRT's robot JSON plan)")
    ap.add_argument("--thor-clock-mhz", type=float, default=1575.0,
                    help="Thor GPU clock assumed for SM-bound stages (MHz)")
    ap.add_argument("--stack-json", help="quant_bench.json of the same shapes: adds the full-chip kernel estimate")
    args = ap.parse_args(argv)
    print(f"Jetson AGX Thor PROJECTION: {THOR_BW / 1e9:.0f} GB/s, {THOR_SMS} SMs at an assumed "
          f"{args.thor_clock_mhz:.0f} MHz, AL {args.al}")
    second = f" {'tok/s (full-chip rate)':>22}" if args.stack_json else ""
    print(f"{'target':<28} {'drafter':<14} {'verify GB':>9} {'draft GB':>8} {'verify ms':>15} {'draft ms':>15} "
          f"{'cycle ms':>8} {'tok/s':>6}{second} {'byte limit':>10} {'peak GB (measured)':>18}")
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
    print(f"measured on: {meta['device']} ({meta['sms']} SMs, {meta['sm_clock_mhz']} MHz max SM clock)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
