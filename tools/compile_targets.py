#!/usr/bin/env python3
"""Compile every Triton/Gluon kernel the runtime launches for the GPUs users run, on a machine without a GPU.

For each target (sm_110a Thor, sm_100a B200, sm_120a RTX 50, sm_90a H100/H200), model shape (Qwen3.5-27B, 4B,
35B-A3B) and weight format, the real forward is recorded on the meta device at the runtime's row counts (decode,
16/32/64-row verifies, a 512-token prefill) with the hooks' product choice for that target; every distinct launch
is compiled and printed with registers, spills (local memory), shared memory against the target's limit, the MMA
instruction in its SASS (block-scaled or not) and lane-instructions per weight of the packed products' main loop
(``edgespec.bench.compile_targets``). Exits 1 on a compile error, a spill in a decode/verify kernel, shared memory
over the limit, or a block-scaled product without the block-scaled MMA on sm_100a/sm_110a.

Needs Triton and, for sm_110a/sm_120a, a CUDA 13 ptxas (Triton 3.9 bundles one; else the nvidia-cuda-nvcc wheel's,
which tools/setup.sh installs for the tests)::

    python tools/compile_targets.py                                   # everything (tens of minutes on 2 cores)
    python tools/compile_targets.py --targets sm_110a --shapes qwen3.5-27b --formats nvfp4,int4
    python tools/compile_targets.py --targets sm_110a --kernels _block_scaled_kernel --rows 1,16,64 --prefill 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.bench import compile_targets as ct  # noqa: E402

SHAPES = ("qwen3.5-27b", "qwen3.5-4b", "qwen3.5-35b-a3b")
FORMATS = ("int4", "nvfp4", "mxfp4", "fp8", "dense")


def _csv(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default=",".join(ct.TARGETS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--rows", default=",".join(map(str, ct.ROWS)), help="decode/verify row counts")
    ap.add_argument("--prefill", type=int, default=ct.PREFILL_TOKENS, help="prefill tokens (0: none)")
    ap.add_argument("--kernels", default="", help="only these kernels (function names, comma-separated)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    for name in _csv(args.targets):
        print(f"ptxas for {name}: {ct.ensure_ptxas(ct.TARGETS[name]) or 'none that knows it'}")
    rows = tuple(int(r) for r in _csv(args.rows))
    problems, rows_out = [], []
    for name in _csv(args.targets):
        target = ct.TARGETS[name]
        seen: dict[tuple, ct.Compiled] = {}
        for shape in _csv(args.shapes):
            for fmt in _csv(args.formats):
                start = time.perf_counter()
                launches, failed = ct.record_shape(shape, fmt, target, rows, args.prefill)
                todo = [la for la in launches if not args.kernels or la.name in _csv(args.kernels)]
                fresh = []
                for la in ct.unique_launches(todo, target):
                    key = ct.launch_key(la, target)
                    if key not in seen:
                        seen[key] = ct.compile_launch(la, target)
                        fresh.append(seen[key])
                print(f"\n== {name} {shape} {fmt}: {len(launches)} launches, {len(fresh)} new kernels compiled in "
                      f"{time.perf_counter() - start:.0f} s")
                print("\n".join(ct.report_lines(fresh)))
                for why in failed:
                    print(f"not recorded: {why}")
                problems += ct.problems(fresh)
                rows_out += [dict(target=name, shape=shape, format=fmt, kernel=r.launch.name, stage=r.launch.stage,
                                  launch=ct.describe(r.launch), error=r.error, registers=r.registers,
                                  spill_bytes=r.local, shared=r.shared, shared_limit=target.shared_limit,
                                  mma=dict(r.mma), block_scaled=r.block_scaled,
                                  instructions_per_weight=round(r.instructions_per_weight, 3)) for r in fresh]
    if args.json:
        Path(args.json).write_text(json.dumps(rows_out, indent=1))
    print(f"\n{len(problems)} problem(s)")
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
