#!/usr/bin/env python3
"""Where the time of one decode attention goes that does not scale with the cache (27B heads; ``--heads``).

0. The floor: a plain streaming read of as many bytes as the FP8 and the bf16 cache of 32768 keys hold, timed like
   the attention (``kernel_timing.graph_us``, both flush modes). With the write flush, L2 starts full of dirty lines
   that every read must first write back, so the floor there is far above bytes / bandwidth.
1. Per call after an L2 flush (``kernel_timing.graph_us``, both flush modes), at ``--contexts`` keys (16, 4096
   and 32768): the bf16-KV and FP8-KV paths (the FP8 default, the Triton program, key-major V), and the FP8 path's
   merge launch alone. The 16-key figures are the fixed cost; the differences to 32k are the streaming cost.
   Then the same 32768-key calls with the merge launch left out (the split kernel alone): the merge's share.
2. The merge launch alone by split count and columns per program (``BLOCK_D``).
3. Per call inside one CUDA graph of 16 back-to-back calls over 16 different 32k caches, as the 16 attention layers
   of a 27B decode step read 16 different caches: no flush is needed (16 caches are far larger than L2) and
   consecutive launches overlap as they do in a decode graph (programmatic dependent launch).
4. Launch variants (``config=`` overrides, ``VARIANTS``) of both caches at 32k keys, timed all three ways, for
   ``--rows`` query rows (1: decode; 16: a verify).
5. The target's figure, repeated: one call at 32k keys after each flush, ``--repeat`` times (fresh graphs each
   time), with the median and the range of each path and of the bf16 / FP8 ratio. Single runs of it have moved by
   up to 0.9 us between machine starts, which is 0.05 of the ratio.
6. Head-major K and scales (``kernel_timing.head_major_twin``): the same rows with each KV head's keys contiguous,
   read through strides by the unchanged kernel, timed like section 4 beside the default layout.

The FP8 / bf16 ratio the benchmarks page reports is one call inside a decode step instead
(``edgespec bench shapes --attn-in-place``, ``edgespec/bench/attn_in_place.py``); section 5 stays as the one-call
figure.

``bash lab/lab_sweep.sh attn-probe`` on a CUDA machine (it installs the package first: ``edgespec.arch``);
``python lab/attn_overhead_probe.py --sections 5 --repeat 9`` for the target figure alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path
from unittest import mock

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.arch.graphs import capture_graph  # noqa: E402
from edgespec.bench.kernel_timing import graph_us, head_major_twin, make_cache  # noqa: E402
from edgespec.kernels import attention_bytes, sm_count  # noqa: E402
from edgespec.kernels.attention import triton_attention  # noqa: E402
from edgespec.kernels.attention.triton_attention import (  # noqa: E402
    attention_launch_config,
    cached_attention_triton,
    merge_splits,
)
from edgespec.kernels.launch.triton_pdl import pdl_launch  # noqa: E402

N_Q, N_KV, HD = 24, 4, 256
LAYERS = 16


@triton.jit
def _stream_read_kernel(x_ptr, out_ptr, n_per_prog, BLOCK: tl.constexpr):
    """Read ``n_per_prog`` int32 of ``x`` per program (16-byte vectors) and keep one xor of them."""
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * n_per_prog
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(0, n_per_prog, BLOCK):
        acc ^= tl.load(base + i + tl.arange(0, BLOCK))
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def stream_read_us(nbytes: int, flush: str) -> float:
    """Graph-timed streaming read of ``nbytes`` (rounded to whole programs) after an L2 flush."""
    programs = 4 * sm_count(torch.device("cuda"))
    block = 4096
    per_prog = -(-nbytes // (4 * programs * block)) * block
    x = torch.zeros(programs * per_prog, dtype=torch.int32, device="cuda")
    out = torch.empty(programs, dtype=torch.int32, device="cuda")
    return graph_us(partial(_stream_read_kernel[(programs,)], x, out, per_prog, BLOCK=block, num_warps=8),
                    reps=10, rep_ms=30, flush_mode=flush)


def forms(q: torch.Tensor, c16, c8, c8_rows, start: int, scale: float) -> dict:
    """name -> call, for one bf16 cache and one FP8 cache in each V layout (blocked: the default)."""
    cfg = attention_launch_config(1, N_Q, N_KV, HD, start + 1, sm_count(q.device), 1, 2)
    o_part = torch.randn((cfg["n_splits"], 1, N_Q, HD), dtype=torch.float32, device="cuda")
    lse = torch.randn((cfg["n_splits"], 1, N_Q), dtype=torch.float32, device="cuda")
    res = torch.empty((1, N_Q, HD), dtype=torch.bfloat16, device="cuda")
    return {"bf16": partial(cached_attention_triton, q, c16, start, scale),
            "fp8": partial(cached_attention_triton, q, c8, start, scale),
            "fp8 Triton program": partial(cached_attention_triton, q, c8, start, scale, config={"GLUON": 0}),
            "fp8 key-major V": partial(cached_attention_triton, q, c8_rows, start, scale),
            "fp8 merge only": partial(merge_splits, o_part, lse, res, pdl_launch(q.device))}


def sequence_us(calls: list) -> float:
    """Per-call GPU time of ``calls`` captured back to back in one graph (no flush)."""
    graph, _ = capture_graph(lambda: [c() for c in calls], warmups=1)
    ms = do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
    del graph
    return ms * 1e3 / len(calls)


# Section 4: ``config=`` overrides of the default launch, each timed on both caches. Experimental kernel forms
# ran here too (docs/notes/attention-experiments.md).
VARIANTS = [{}, {"waves": 3}, {"waves": 5}, {"num_warps": 4}, {"BLOCK_N": 64, "num_warps": 4, "waves": 2},
            {"num_stages": 2}, {"num_stages": 4}]


def three_ways(q: torch.Tensor, caches: list, scale: float, config: dict | None = None) -> str:
    """"write | read | back-to-back" us: one call on ``caches[0]`` after each flush, and per call over one call on
    each cache of ``caches`` in one graph; the query rows are the last positions of each cache."""
    ctx = caches[0].max_len
    start = ctx - q.shape[0]
    fn = partial(cached_attention_triton, q, caches[0], start, scale, config=dict(config or {}))
    cells = [f"{graph_us(fn, reps=10, rep_ms=30, flush_mode=flush):6.1f}" for flush in ("write", "read")]
    seq = sequence_us([partial(cached_attention_triton, q, c, start, scale, config=dict(config or {}))
                       for c in caches])
    return " | ".join(cells) + f" | {seq:6.1f}"


def variants_at_32k(q: torch.Tensor, scale: float, variants: list[dict]) -> None:
    """4. Launch variants (``config=`` overrides) of both caches at 32768 keys: one call after either flush, and per
    call over 16 back-to-back calls."""
    ctx = 32768
    print(f"4. launch variants at {ctx} keys, T={q.shape[0]} (us: one call write | read flush | per call of {LAYERS} "
          "back to back)")
    for name, fp8 in (("fp8", True), ("bf16", False)):
        caches = [make_cache(ctx, N_KV, HD, fp8) for _ in range(LAYERS)]
        for extra in variants:
            try:
                cells = three_ways(q, caches, scale, extra)
            except ValueError as err:                     # a form for the other cache only (e.g. TMA: FP8)
                cells = f"n/a ({err})"
            print(f"  {name} {extra or 'default'}: " + cells, flush=True)
        del caches
        torch.cuda.empty_cache()


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="0,1,2,3,4,5,6", help="comma-separated sections to run (0-6)")
    ap.add_argument("--heads", default="24,4", help="query heads,KV heads (24,4: Qwen3.5-27B; 16,4: Qwen3.5-4B)")
    ap.add_argument("--repeat", type=int, default=5, help="section 5: timings per path and flush")
    ap.add_argument("--contexts", default="16,4096,32768", help="section 1: cache lengths (keys)")
    ap.add_argument("--variants", default=None,
                    help='section 4: a JSON list of config overrides instead of VARIANTS, e.g. \'[{}, {"waves": 3}]\'')
    ap.add_argument("--rows", type=int, default=1,
                    help="section 4: query rows T (1: decode; 16: a verify of 15 drafts)")
    args = ap.parse_args()
    if not 1 <= args.rows <= 128:
        ap.error(f"--rows {args.rows}: 1 to 128 query rows")
    global N_Q, N_KV
    try:
        N_Q, N_KV = (int(x) for x in args.heads.split(","))
    except ValueError:
        ap.error(f"--heads {args.heads!r}: two integers, query heads,KV heads")
    if N_Q % N_KV:
        ap.error(f"--heads {args.heads}: {N_Q} query heads do not group over {N_KV} KV heads")
    print(f"{N_Q} query heads, {N_KV} KV heads, head dim {HD}")
    sections = {int(x) for x in args.sections.split(",")}
    scale = HD ** -0.5
    q = torch.randn(1, N_Q, HD, device="cuda", dtype=torch.bfloat16)
    if 0 in sections:
        floors()
    if 1 in sections:
        per_call(q, scale, tuple(int(c) for c in args.contexts.split(",")))
    if 2 in sections:
        merge_sweep(q)
    if 3 in sections:
        back_to_back(q, scale)
    if 4 in sections:
        rows_q = torch.randn(args.rows, N_Q, HD, device="cuda", dtype=torch.bfloat16)
        variants_at_32k(rows_q, scale, json.loads(args.variants) if args.variants else VARIANTS)
    if 5 in sections:
        repeated_target(q, scale, args.repeat)
    if 6 in sections:
        head_major_layouts(q, scale)
    return 0


def head_major_layouts(q: torch.Tensor, scale: float) -> None:
    """6. The default layouts against head-major K (and key-major V) and scales, at 32768 keys."""
    ctx = 32768
    print(f"6. head-major K and scales at {ctx} keys (us: one call write | read flush | per call of {LAYERS} back to "
          "back; max |difference| of the outputs)")
    for name, fp8 in (("fp8", True), ("bf16", False)):
        caches = [make_cache(ctx, N_KV, HD, fp8) for _ in range(LAYERS)]
        print(f"  {name} default: " + three_ways(q, caches, scale), flush=True)
        want = cached_attention_triton(q, caches[0], ctx - 1, scale)
        caches = [head_major_twin(c) for c in caches]
        diff = (cached_attention_triton(q, caches[0], ctx - 1, scale) - want).abs().max().item()
        print(f"  {name} head-major: " + three_ways(q, caches, scale) + f" | diff {diff:.1e}", flush=True)
        del caches
        torch.cuda.empty_cache()


def repeated_target(q: torch.Tensor, scale: float, repeat: int) -> None:
    """5. The FP8 target's figure, ``repeat`` times per path and flush, interleaved so drifts hit both paths."""
    ctx = 32768
    print(f"5. one call at {ctx} keys, {repeat} timings each (us: median [min - max]; ratio = bf16 / fp8 per round)")
    caches = {"bf16": make_cache(ctx, N_KV, HD, False), "fp8": make_cache(ctx, N_KV, HD, True)}
    for flush in ("write", "read"):
        times: dict[str, list[float]] = {name: [] for name in caches}
        for _ in range(repeat):
            for name, cache in caches.items():
                times[name].append(graph_us(partial(cached_attention_triton, q, cache, ctx - 1, scale),
                                            reps=10, rep_ms=30, flush_mode=flush))
        ratios = [b / f for b, f in zip(times["bf16"], times["fp8"], strict=True)]
        cells = [f"{name} {statistics.median(ts):5.1f} [{min(ts):5.1f} - {max(ts):5.1f}]" for name, ts in times.items()]
        print(f"  flush={flush:<5} " + " | ".join(cells)
              + f" | ratio {statistics.median(ratios):4.2f} [{min(ratios):4.2f} - {max(ratios):4.2f}]", flush=True)


def floors() -> None:
    print("0. streaming read of the bytes of one 32768-key cache, no arithmetic (us, GB/s)")
    for name, fp8 in (("fp8", True), ("bf16", False)):
        nbytes = attention_bytes(1, N_Q, N_KV, HD, 32768, fp8)
        cells = []
        for flush in ("write", "read"):
            us = stream_read_us(nbytes, flush)
            cells.append(f"flush={flush} {us:6.1f} us {nbytes / us * 1e-3:5.0f} GB/s")
        print(f"  {name:<5} {nbytes / 1e6:6.1f} MB  " + " | ".join(cells), flush=True)


def per_call(q: torch.Tensor, scale: float, contexts: tuple[int, ...] = (16, 4096, 32768)) -> None:
    print("1. one call after an L2 flush (us)")
    for ctx in contexts:
        c16, c8 = make_cache(ctx, N_KV, HD, False), make_cache(ctx, N_KV, HD, True)
        c8_rows = make_cache(ctx, N_KV, HD, True, v_block=0)
        for flush in ("write", "read"):
            cells = [f"{name} {graph_us(fn, reps=10, rep_ms=30, flush_mode=flush):6.1f}"
                     for name, fn in forms(q, c16, c8, c8_rows, ctx - 1, scale).items()]
            print(f"  ctx={ctx:<6} flush={flush:<5} " + " | ".join(cells), flush=True)
        if ctx == 32768:
            with mock.patch.object(triton_attention, "merge_splits", lambda *args, **kwargs: None):
                for flush in ("write", "read"):
                    cells = [f"{name} {graph_us(fn, reps=10, rep_ms=30, flush_mode=flush):6.1f}"
                             for name, fn in forms(q, c16, c8, c8_rows, ctx - 1, scale).items() if "merge" not in name]
                    print(f"  ctx={ctx:<6} flush={flush:<5} split kernel alone: " + " | ".join(cells), flush=True)
        del c16, c8, c8_rows
        torch.cuda.empty_cache()


def merge_sweep(q: torch.Tensor) -> None:
    print("2. the merge launch alone by split count and BLOCK_D (us, write flush; None = the default rule)")
    for splits in (16, 32, 66, 132):
        o_part = torch.randn((splits, 1, N_Q, HD), dtype=torch.float32, device="cuda")
        lse = torch.randn((splits, 1, N_Q), dtype=torch.float32, device="cuda")
        res = torch.empty((1, N_Q, HD), dtype=torch.bfloat16, device="cuda")
        cells = [f"bd={bd} {graph_us(partial(merge_splits, o_part, lse, res, pdl_launch(q.device), bd)):5.1f}"
                 for bd in (None, 16, 32, 64, 128, 256)]
        print(f"  splits={splits:<4} " + " | ".join(cells), flush=True)


def back_to_back(q: torch.Tensor, scale: float) -> None:
    ctx = 32768
    print(f"3. {LAYERS} calls over {LAYERS} different {ctx}-key caches in one graph (us per call, GB/s)")
    for name, fp8, v_block in (("bf16", False, None), ("fp8", True, None), ("fp8 key-major V", True, 0)):
        caches = [make_cache(ctx, N_KV, HD, fp8, v_block) for _ in range(LAYERS)]
        nbytes = attention_bytes(1, N_Q, N_KV, HD, ctx, fp8)
        us = sequence_us([partial(cached_attention_triton, q, c, ctx - 1, scale) for c in caches])
        print(f"  {name} {us:6.1f} us  {nbytes / us * 1e-3:5.0f} GB/s", flush=True)
        del caches
        torch.cuda.empty_cache()


if __name__ == "__main__":
    raise SystemExit(main())
