#!/usr/bin/env python3
"""Summarise Nsight Compute's per-instruction stall samples of one kernel: where its warps wait, by SASS line.

Input: the CSV of ``ncu -i REPORT --page source --csv --print-source sass`` for a report taken with
``--section SourceCounters`` (``bash lab/lab_sweep.sh attn-ncu-source`` makes both for the attention split
kernel). The hot loop is the span of the largest backward branch (as ``lab/attn_sass.py`` finds it); the samples
are split into before / in / after that loop, the loop into ``--chunk``-instruction slices, and the instructions
with the most samples are listed with their two largest stall reasons. Stall reasons are Nsight Compute's
(``long_sb``: waiting on a global or local memory result; ``short_sb``: shared memory, shuffles, special functions;
``wait``: a fixed-latency dependency; ``barrier``: a CTA barrier; ``selected``: issuing).

Usage: ``python lab/ncu_source_summary.py attn_src.csv [--top 20] [--chunk 50]``
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys
from pathlib import Path

from sass_loop import largest_backward_branch, opcode

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


REQUIRED = ("Address", "Source", SAMPLES, EXECUTED)


def read_rows(path: Path) -> list[dict[str, str]]:
    """The instruction rows of the CSV (the header is the first row that names every ``REQUIRED`` column)."""
    with path.open(newline="") as f:
        lines = list(csv.reader(f))
    for i, row in enumerate(lines):
        if all(c in row for c in REQUIRED):
            rows = [dict(zip(row, r, strict=True)) for r in lines[i + 1:] if len(r) == len(row)]
            for r in rows:
                try:
                    int(r["Address"], 16)
                except ValueError:
                    raise ValueError(f"{path}: address {r['Address']!r} is not hexadecimal") from None
            return rows
    raise ValueError(f"{path}: no header with the columns {', '.join(REQUIRED)}; export with --page source --csv "
                     "--print-source sass from a report taken with --section SourceCounters")


def as_int(text: str) -> int:
    """A counter cell as an integer (empty: 0; thousands separators allowed)."""
    return int(float(text.replace(",", ""))) if text.strip() else 0


def reasons(row: dict[str, str]) -> collections.Counter:
    """Stall samples of one instruction by reason (all samples, issued or not)."""
    return collections.Counter({k[len("stall_"):]: as_int(v) for k, v in row.items()
                                if k.startswith("stall_") and "Not Issued" not in k and as_int(v)})


def loop_span(rows: list[dict[str, str]]) -> tuple[int, int]:
    """Row indices (first, last) of the largest backward branch's body; the whole kernel if it has none."""
    addr = [int(r["Address"], 16) for r in rows]
    span = largest_backward_branch(zip(addr, (r["Source"] for r in rows), strict=True))
    if span is None:
        return 0, len(rows) - 1
    return next(j for j, a in enumerate(addr) if a >= span[0]), addr.index(span[1])


def tally(rows: list[dict[str, str]]) -> tuple[int, collections.Counter]:
    """Stall samples of ``rows`` in all, and by reason."""
    return sum(as_int(r[SAMPLES]) for r in rows), sum((reasons(r) for r in rows), collections.Counter())


def summarise(rows: list[dict[str, str]], top: int, chunk: int) -> str:
    first, last = loop_span(rows)
    total = sum(as_int(r[SAMPLES]) for r in rows)
    out = [f"{len(rows)} instructions, {total} samples; loop: {last - first + 1} instructions, each executed "
           f"{as_int(rows[first][EXECUTED])} times"]
    for name, part in (("before loop", rows[:first]), ("loop", rows[first:last + 1]), ("after loop", rows[last + 1:])):
        n, why = tally(part)
        out.append(f"  {name:<12} {len(part):5d} instructions {n:6d} samples ({100 * n / max(total, 1):4.1f}%)  "
                   + ", ".join(f"{k} {v}" for k, v in why.most_common(6)))
    out.append(f"loop in slices of {chunk} instructions (samples; top reasons; top opcodes)")
    body = rows[first:last + 1]
    for i in range(0, len(body), chunk):
        part = body[i:i + chunk]
        n, why = tally(part)
        ops = collections.Counter(opcode(r["Source"]) for r in part if r["Source"].split())
        out.append(f"  {i:4d}  {n:5d}  " + ", ".join(f"{k} {v}" for k, v in why.most_common(3)) + "  |  "
                   + ", ".join(f"{k} {v}" for k, v in ops.most_common(3)))
    out.append(f"the {top} loop instructions with the most samples")
    for idx in sorted(range(first, last + 1), key=lambda j: -as_int(rows[j][SAMPLES]))[:top]:
        r = rows[idx]
        why = ", ".join(f"{k} {v}" for k, v in reasons(r).most_common(2))
        out.append(f"  +{idx - first:4d}  {as_int(r[SAMPLES]):5d}  {why:<32} {r['Source'].strip()}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--top", type=int, default=20, help="instructions to list")
    ap.add_argument("--chunk", type=int, default=50, help="loop instructions per slice")
    args = ap.parse_args()
    if not args.csv.is_file():
        print(f"no such file: {args.csv}", file=sys.stderr)
        return 2
    try:
        rows = read_rows(args.csv)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    if not rows:
        print(f"{args.csv}: no instruction rows", file=sys.stderr)
        return 2
    print(summarise(rows, args.top, max(args.chunk, 1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
