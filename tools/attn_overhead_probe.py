#!/usr/bin/env python3
"""Where the time of one decode attention goes that does not scale with the cache (Qwen3.5-27B heads).

1. Per call after an L2 flush (``kernel_bench.graph_us``, both flush modes), at 16, 4096 and 32768 keys: the
   bf16-KV and FP8-KV Triton paths, the FP8 CUDA path, and the CUDA path's two launches alone (split kernel, merge).
   The 16-key figures are the fixed cost; the differences to 32k are the streaming cost.
2. Per call inside one CUDA graph of 16 back-to-back calls over 16 different 32k caches, as the 16 attention layers
   of a 27B decode step read 16 different caches: no flush is needed (16 caches are far larger than L2) and
   consecutive launches overlap as they do in a decode graph (programmatic dependent launch).

``PYTHONPATH=. python3 tools/attn_overhead_probe.py`` on a CUDA machine.
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

from edgespec.kernels import sm_count  # noqa: E402
from edgespec.kernels.cuda_attention import (  # noqa: E402
    cuda_decode_supported,
    decode_launch_config,
    fp8_decode_attention_cuda,
    launch_splits,
)
from edgespec.kernels.triton_attention import attention_bytes, cached_attention_triton, merge_splits  # noqa: E402
from edgespec.kernels.triton_pdl import pdl_launch  # noqa: E402

N_Q, N_KV, HD = 24, 4, 256
LAYERS = 16


def forms(q: torch.Tensor, c16, c8, start: int, scale: float) -> dict:
    """name -> call, for one bf16 and one FP8 cache."""
    out = {"bf16 triton": partial(cached_attention_triton, q, c16, start, scale),
           "fp8 triton": partial(cached_attention_triton, q, c8, start, scale)}
    if cuda_decode_supported(q, c8):
        cfg = decode_launch_config(N_KV, start + 1, sm_count(q.device))
        o_part = torch.empty((cfg["n_splits"], 1, N_Q, HD), dtype=torch.float32, device="cuda")
        lse = torch.zeros((cfg["n_splits"], 1, N_Q), dtype=torch.float32, device="cuda")
        res = torch.empty((1, N_Q, HD), dtype=torch.bfloat16, device="cuda")
        out["fp8 cuda"] = partial(fp8_decode_attention_cuda, q, c8, start, scale)
        out["cuda splits only"] = partial(launch_splits, q, c8, start, scale, None, o_part, lse, cfg)
        out["cuda merge only"] = partial(merge_splits, o_part, lse, res, pdl_launch(q.device))
    return out


def sequence_us(calls: list) -> float:
    """Per-call GPU time of ``calls`` captured back to back in one graph (no flush)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
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
    print("3. the merge launch alone by split count and BLOCK_D (us, write flush)")
    for splits in (16, 32, 66, 132):
        o_part = torch.randn((splits, 1, N_Q, HD), dtype=torch.float32, device="cuda")
        lse = torch.randn((splits, 1, N_Q), dtype=torch.float32, device="cuda")
        res = torch.empty((1, N_Q, HD), dtype=torch.bfloat16, device="cuda")
        cells = [f"bd={bd} {graph_us(partial(merge_splits, o_part, lse, res, pdl_launch(q.device), bd)):5.1f}"
                 for bd in (None, 16, 32, 64, 128, 256)]
        print(f"  splits={splits:<4} " + " | ".join(cells), flush=True)
    ctx = 32768
    print("4. the CUDA split kernel with its arithmetic left out (loads only), 32k keys, write flush")
    c8 = make_cache(ctx, N_KV, HD, True)
    for waves in (1, 2):
        for stages in (3, -3):
            cfg = decode_launch_config(N_KV, ctx, sm_count(q.device), {"num_warps": 4, "num_stages": stages,
                                                                          "waves": waves})
            o_part = torch.empty((cfg["n_splits"], 1, N_Q, HD), dtype=torch.float32, device="cuda")
            lse = torch.zeros((cfg["n_splits"], 1, N_Q), dtype=torch.float32, device="cuda")
            us = graph_us(partial(launch_splits, q, c8, ctx - 1, scale, None, o_part, lse, cfg))
            print(f"  waves={waves} {'loads only' if stages < 0 else 'full':<10} {us:6.1f} us "
                  f"{attention_bytes(1, N_Q, N_KV, HD, ctx, True) / us * 1e-3:5.0f} GB/s", flush=True)
    del c8
    torch.cuda.empty_cache()
    print("5. fixed cost: the CUDA split kernel alone at 16 keys by (warps, ring depth) = shared memory")
    c8 = make_cache(16, N_KV, HD, True)
    for nw, st in ((2, 3), (4, 2), (4, 3), (4, -3), (8, 3)):
        cfg = decode_launch_config(N_KV, 16, sm_count(q.device), {"num_warps": nw, "num_stages": st})
        o_part = torch.empty((cfg["n_splits"], 1, N_Q, HD), dtype=torch.float32, device="cuda")
        lse = torch.zeros((cfg["n_splits"], 1, N_Q), dtype=torch.float32, device="cuda")
        fn = partial(launch_splits, q, c8, 15, scale, None, o_part, lse, cfg)
        cells = [f"flush={f} {graph_us(fn, flush_mode=f):5.1f}" for f in ("write", "read")]
        kb = nw * abs(st) * (32 * HD + 128) / 1024
        print(f"  warps={nw} stages={st:<2} ({kb:4.0f} KB) " + " | ".join(cells), flush=True)
    print(f"2. {LAYERS} calls over {LAYERS} different {ctx}-key caches in one graph (us per call, GB/s)")
    for fp8 in (False, True):
        caches = [make_cache(ctx, N_KV, HD, fp8) for _ in range(LAYERS)]
        nbytes = attention_bytes(1, N_Q, N_KV, HD, ctx, fp8)
        runs = {"triton": [partial(cached_attention_triton, q, c, ctx - 1, scale) for c in caches]}
        if fp8 and cuda_decode_supported(q, caches[0]):
            runs["cuda"] = [partial(fp8_decode_attention_cuda, q, c, ctx - 1, scale) for c in caches]
            runs["cuda waves=1"] = [partial(fp8_decode_attention_cuda, q, c, ctx - 1, scale, config={"waves": 1})
                                    for c in caches]
        for name, calls in runs.items():
            us = sequence_us(calls)
            print(f"  {'fp8' if fp8 else 'bf16'} {name:<13} {us:6.1f} us  {nbytes / us * 1e-3:5.0f} GB/s", flush=True)
        del caches, runs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
