#!/usr/bin/env python3
"""Timeline of one FP8 decode attention split launch (27B heads, 32768 keys), read from the programs' own clocks.

The Gluon decode program built with ``TRACE`` stamps the GPU's global timer at four points of every program (see
``gluon_attention_fp8.TRACE_POINTS``): its start, its first tile landing in shared memory, the end of its key loop
and the end of its stores. This prints, after each L2 flush, when programs start, how long their first tile takes,
how long their loops run and how far apart they finish: the startup and the tail of the launch, which a kernel
timer only shows summed.

Usage (CUDA machine): ``python lab/attn_trace.py [--config '{"num_warps": 1, "BLOCK_W": 32}'] [--calls 5]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.bench.kernel_timing import evict_l2, make_cache  # noqa: E402
from edgespec.kernels import sm_count  # noqa: E402
from edgespec.kernels.attention import gluon_attention_fp8 as g  # noqa: E402
from edgespec.kernels.attention.triton_attention import _LOG2E, _smem_per_sm, _split_buffers  # noqa: E402
from edgespec.kernels.launch.triton_pdl import pdl_launch  # noqa: E402

N_Q, N_KV, HD, CTX = 24, 4, 256, 32768


def summary(trace: torch.Tensor) -> dict[str, float]:
    """Microseconds, relative to the first program's start: the spans of the launch's phases."""
    t = trace.double().view(-1, 5)[:, :4]
    t = t[t[:, 1] > 0]                                   # programs with at least one tile (others stamp no tile)
    t0 = t[:, 0].min()
    rel = (t - t0) / 1e3
    def pct(x: torch.Tensor, q: float) -> float:
        return float(torch.quantile(x, q))
    return {
        "start p50 / max": (pct(rel[:, 0], 0.5), float(rel[:, 0].max())),
        "first tile p10 / p50 / max": (pct(rel[:, 1], 0.1), pct(rel[:, 1], 0.5), float(rel[:, 1].max())),
        "loop (first tile -> done) p10 / p50 / max": tuple(pct(rel[:, 2] - rel[:, 1], q) for q in (0.1, 0.5, 1.0)),
        "stores": (statistics.median((rel[:, 3] - rel[:, 2]).tolist()),),
        "finished p10 / p50 / p90 / max": tuple(pct(rel[:, 3], q) for q in (0.1, 0.5, 0.9, 1.0)),
    }


def by_groups(trace: torch.Tensor) -> None:
    """Median finish and first-tile times of the last call by split index (in eighths), by KV head and by the
    number of programs that shared an SM: whether lateness follows launch order, a head or crowding."""
    t = trace.double()
    done = t[..., 1] > 0
    t0 = t[..., 0][done].min()
    first, fin = (t[..., 1] - t0) / 1e3, (t[..., 3] - t0) / 1e3
    sm = t[..., 4].long()
    n_splits = t.shape[0]
    def med(mask: torch.Tensor) -> str:
        m = mask & done
        return f"{float(first[m].median()):5.2f} / {float(fin[m].median()):5.2f} ({int(m.sum())})" if m.any() else "-"
    idx = torch.arange(n_splits, device=t.device)[:, None].expand_as(done)
    print("    split eighths (first tile / finish):  " + "  ".join(
        med((idx * 8 // n_splits) == e) for e in range(8)))
    print("    KV heads:  " + "  ".join(med(torch.arange(t.shape[1], device=t.device)[None, :] == h)
                                     for h in range(t.shape[1])))
    per_sm = torch.bincount(sm[done], minlength=int(sm.max()) + 1)
    crowd = per_sm[sm]
    counts = sorted(set(crowd[done].tolist()))
    print("    programs on the same SM:  " + "  ".join(f"{k}: {med(crowd == k)}" for k in counts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default='{"num_warps": 1, "BLOCK_W": 32}', help="Gluon launch overrides (JSON)")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    cache = make_cache(CTX, N_KV, HD, True)
    q = torch.randn(1, N_Q, HD, device="cuda", dtype=torch.bfloat16)
    cfg = g.gluon_decode_config(N_KV, HD, CTX, sm_count(q.device), _smem_per_sm(q.device),
                                overrides=json.loads(args.config))
    o_part, lse_part, _ = _split_buffers(q, cfg["n_splits"])
    trace = torch.zeros((cfg["n_splits"], N_KV, 5), dtype=torch.int64, device="cuda")
    print(f"Gluon FP8 decode, 27B heads, {CTX} keys, {cfg}")
    for flush in ("write", "read"):
        rows = []
        for _ in range(args.calls):
            evict_l2(flush)
            g.gluon_decode_split(q, cache, CTX - 1, None, HD ** -0.5 * _LOG2E, o_part, lse_part, cfg,
                                 pdl_launch(q.device), trace=trace)
            torch.cuda.synchronize()
            rows.append(summary(trace))
        print(f"flush={flush} (us from the first program's start; median over {args.calls} calls)")
        for key in rows[0]:
            cells = [statistics.median(r[key][i] for r in rows) for i in range(len(rows[0][key]))]
            print(f"  {key:45s} " + " / ".join(f"{c:6.2f}" for c in cells))
        print("  last call, finish time (us) by ...")
        by_groups(trace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
