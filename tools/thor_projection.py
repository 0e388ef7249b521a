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


def project(run: dict, meta: dict, al: float, clock_mhz: float) -> dict:
    """Projected cycle of one proposer's run (``run``: cycle_bench's split; ``meta``: the file's header)."""
    scale = (meta["sms"] * meta["sm_clock_mhz"]) / (THOR_SMS * clock_mhz)
    stages = {"verify": (run["verify_ms_per_cycle"], meta["verify_bytes"]),
              "draft": (run["draft_ms_per_cycle"], run.get("draft_bytes", 0)),
              "accept": (run["accept_rollback_ms_per_cycle"], 0),
              "other": (run["other_ms_per_cycle"], 0)}
    out = {"stages": {}}
    for name, (ms, nbytes) in stages.items():
        bytes_ms, sm_ms = nbytes / THOR_BW * 1e3, ms * scale
        out["stages"][name] = {"bytes_ms": bytes_ms, "sm_ms": sm_ms, "ms": max(bytes_ms, sm_ms),
                               "bound": "bytes" if bytes_ms >= sm_ms else "SMs"}
    cycle = sum(s["ms"] for s in out["stages"].values())
    floor = sum(s["bytes_ms"] for s in out["stages"].values())
    out.update(cycle_ms=cycle, tok_s=al / cycle * 1e3, byte_limit_tok_s=al / floor * 1e3 if floor else float("inf"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="cycle_bench.json files")
    ap.add_argument("--al", type=float, default=4.57, help="acceptance length (default: FlashRT's robot JSON plan)")
    ap.add_argument("--thor-clock-mhz", type=float, default=1575.0,
                    help="Thor GPU clock assumed for SM-bound stages (MHz)")
    args = ap.parse_args(argv)
    print(f"Jetson AGX Thor PROJECTION: {THOR_BW / 1e9:.0f} GB/s, {THOR_SMS} SMs at an assumed "
          f"{args.thor_clock_mhz:.0f} MHz, AL {args.al}")
    print(f"{'target':<22} {'drafter':<14} {'verify GB':>9} {'draft GB':>8} {'verify ms':>15} {'draft ms':>15} "
          f"{'cycle ms':>8} {'tok/s':>6} {'byte limit':>10} {'peak GB (measured)':>18}")
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
            run = {**run, "draft_bytes": meta.get(f"{name}_draft_bytes", 0)}
            p = project(run, meta, args.al, args.thor_clock_mhz)
            v, d = p["stages"]["verify"], p["stages"]["draft"]
            print(f"{meta['shape'] + ' ' + meta['format']:<22} {name:<14} {meta['verify_bytes'] / 1e9:>9.2f} "
                  f"{run['draft_bytes'] / 1e9:>8.2f} {v['ms']:>8.1f} ({v['bound']:>5}) {d['ms']:>8.1f} "
                  f"({d['bound']:>5}) {p['cycle_ms']:>8.1f} {p['tok_s']:>6.1f} {p['byte_limit_tok_s']:>10.1f} "
                  f"{run['peak_GB']:>9.1f} ({meta['max_len']} ctx)")
    print(f"measured on: {meta['device']} ({meta['sms']} SMs, {meta['sm_clock_mhz']} MHz max SM clock)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
