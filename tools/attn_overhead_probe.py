#!/usr/bin/env python3
"""Where the time of one decode attention goes that does not scale with the cache (Qwen3.5-27B heads).

1. Per call after an L2 flush (``kernel_bench.graph_us``, both flush modes), at 16, 4096 and 32768 keys: the
   bf16-KV and FP8-KV paths, and the FP8 path's merge launch alone. The 16-key figures are
   the fixed cost; the differences to 32k are the streaming cost.
2. The merge launch alone by split count and columns per program (``BLOCK_D``).
3. Per call inside one CUDA graph of 16 back-to-back calls over 16 different 32k caches, as the 16 attention layers
   of a 27B decode step read 16 different caches: no flush is needed (16 caches are far larger than L2) and
   consecutive launches overlap as they do in a decode graph (programmatic dependent launch).

Round 6 ran an earlier version with a CUDA decode kernel beside these (removed again: slower than the Triton
one); its outputs are ``docs/measurements/attn_overhead_probe*_h200_round6.txt``.

``bash tools/gpu_sweep.sh attn-probe`` on a CUDA machine (it installs the package first: ``edgespec.arch``).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_bench import graph_us, make_cache  # noqa: E402

from edgespec.arch.graphs import capture_graph  # noqa: E402
from edgespec.kernels import sm_count  # noqa: E402
from edgespec.kernels.triton_attention import (  # noqa: E402
    attention_bytes,
    attention_launch_config,
    cached_attention_triton,
    merge_splits,
)
from edgespec.kernels.triton_pdl import pdl_launch  # noqa: E402

N_Q, N_KV, HD = 24, 4, 256
LAYERS = 16


def forms(q: torch.Tensor, c16, c8, start: int, scale: float) -> dict:
    """name -> call, for one bf16 and one FP8 cache."""
    cfg = attention_launch_config(1, N_Q, N_KV, HD, start + 1, sm_count(q.device), 1, 2)
    o_part = torch.randn((cfg["n_splits"], 1, N_Q, HD), dtype=torch.float32, device="cuda")
    lse = torch.randn((cfg["n_splits"], 1, N_Q), dtype=torch.float32, device="cuda")
    res = torch.empty((1, N_Q, HD), dtype=torch.bfloat16, device="cuda")
    return {"bf16": partial(cached_attention_triton, q, c16, start, scale),
            "fp8": partial(cached_attention_triton, q, c8, start, scale),
            "fp8 merge only": partial(merge_splits, o_part, lse, res, pdl_launch(q.device))}


def sequence_us(calls: list) -> float:
    """Per-call GPU time of ``calls`` captured back to back in one graph (no flush)."""
    graph, _ = capture_graph(lambda: [c() for c in calls], warmups=1)
    ms = do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
    del graph
    return ms * 1e3 / len(calls)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    scale = HD ** -0.5
    q = torch.randn(1, N_Q, HD, device="cuda", dtype=torch.bfloat16)
    print("1. one call after an L2 flush (us)")
    for ctx in (16, 4096, 32768):
        c16, c8 = make_cache(ctx, N_KV, HD, False), make_cache(ctx, N_KV, HD, True)
        for flush in ("write", "read"):
            cells = [f"{name} {graph_us(fn, reps=10, rep_ms=30, flush_mode=flush):6.1f}"
                     for name, fn in forms(q, c16, c8, ctx - 1, scale).items()]
            print(f"  ctx={ctx:<6} flush={flush:<5} " + " | ".join(cells), flush=True)
        del c16, c8
        torch.cuda.empty_cache()
    print("2. the merge launch alone by split count and BLOCK_D (us, write flush; None = the default rule)")
    for splits in (16, 32, 66, 132):
        o_part = torch.randn((splits, 1, N_Q, HD), dtype=torch.float32, device="cuda")
        lse = torch.randn((splits, 1, N_Q), dtype=torch.float32, device="cuda")
        res = torch.empty((1, N_Q, HD), dtype=torch.bfloat16, device="cuda")
        cells = [f"bd={bd} {graph_us(partial(merge_splits, o_part, lse, res, pdl_launch(q.device), bd)):5.1f}"
                 for bd in (None, 16, 32, 64, 128, 256)]
        print(f"  splits={splits:<4} " + " | ".join(cells), flush=True)
    ctx = 32768
    print(f"3. {LAYERS} calls over {LAYERS} different {ctx}-key caches in one graph (us per call, GB/s)")
    for fp8 in (False, True):
        caches = [make_cache(ctx, N_KV, HD, fp8) for _ in range(LAYERS)]
        nbytes = attention_bytes(1, N_Q, N_KV, HD, ctx, fp8)
        us = sequence_us([partial(cached_attention_triton, q, c, ctx - 1, scale) for c in caches])
        print(f"  {'fp8' if fp8 else 'bf16'} {us:6.1f} us  {nbytes / us * 1e-3:5.0f} GB/s", flush=True)
        del caches
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
