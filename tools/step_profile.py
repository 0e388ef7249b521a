"""Where a decode step and a verify go on the GPU: CUDA-graph replays under the torch profiler, kernels grouped.

    python tools/step_profile.py [--shapes qwen3.5-4b,qwen3.5-27b] [--rows 1,16] [--context 512]
    python tools/step_profile.py --drafter qwen3.5-27b        # the DFlash draft graph instead
    python tools/step_profile.py --prefill 512 --shapes peer-llama --format int4   # a whole-model prefill

For each shape and row count it replays the captured forward (as served: merged projections, CUDA graphs) and
prints the GPU time per step split into kernel groups (matmul, attention, GDN, conv, norms, elementwise, copies),
each with its share and kernel count, next to the weight-read limit. Writes step_profile.json to $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.arch.detect import select_hooks  # noqa: E402
from edgespec.bench.gpu import measure_copy_bandwidth, random_model, weight_bytes_per_token  # noqa: E402
from edgespec.drafters.ngram import NGramProposer  # noqa: E402
from edgespec.speculative.session import SpecSession  # noqa: E402

# Kernel name patterns -> group (first match wins).
GROUPS = [
    ("matmul", r"gemm|gemv|skinny|split_sum|cutlass|sm90_xmma|nvjet|splitK|Kernel2"),
    ("attention", r"_attn_"),
    ("gdn", r"gdn|delta"),
    ("conv", r"conv"),
    ("norm", r"norm"),
    ("copy", r"copy|Memcpy|memcpy|index_copy|fill"),
    ("reduce", r"reduce|argmax|softmax"),
    ("elementwise", r"elementwise|vectorized|unrolled|Elementwise"),
]


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def profile_rows(session: SpecSession, model, rows: int, steps: int = 20) -> dict:
    device = model.device
    toks = torch.randint(0, model.config.vocab_size, (rows,), device=device)
    hooks, cache = session.hooks, session.cache
    start = cache.length

    def step() -> None:
        if rows == 1:
            hooks.decode(model, cache, toks, ())
            cache.length = start
        else:
            hooks.verify(model, cache, toks, (), session.rollback)
            cache.rollback(start)

    return {"rows": rows, **profile_step(step, steps)}


def profile_step(step, steps: int = 20) -> dict:
    """Event-timed microseconds per ``step()`` and its kernels under the profiler, grouped (see ``GROUPS``)."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(steps):
        step()
    t1.record()
    torch.cuda.synchronize()
    step_us = t0.elapsed_time(t1) * 1e3 / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            rec = per_kernel[ev.name]
            rec[0] += ev.device_time / steps
            rec[1] += 1 / steps
    groups: dict[str, dict] = defaultdict(lambda: {"us": 0.0, "kernels": 0.0})
    for name, (us, n) in per_kernel.items():
        g = groups[group_of(name)]
        g["us"] += us
        g["kernels"] += n
    total = sum(g["us"] for g in groups.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:12]
    # The kernels of the first replayed step, in launch order (what one layer of each kind runs).
    cuda_events = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda ev: ev.time_range.start)
    per_step = len(cuda_events) // steps
    sequence = [{"name": ev.name[:90], "us": ev.device_time} for ev in cuda_events[:per_step]]
    return {"step_us": step_us, "gpu_us": total, "groups": dict(groups),
            "top": [{"name": n[:90], "us": us, "count": c} for n, (us, c) in top], "sequence": sequence}


def print_profile(res: dict, sequence: int) -> None:
    for g, v in sorted(res["groups"].items(), key=lambda kv: -kv[1]["us"]):
        print(f"  {g:<12} {v['us']:>9.1f} us {v['us'] / res['gpu_us']:>6.1%}  {v['kernels']:>6.0f} kernels")
    for t in res["top"][:12]:
        print(f"    {t['us']:>8.1f} us x{t['count']:<5.0f} {t['name']}")
    for i, ev in enumerate(res["sequence"][:sequence]):
        print(f"    [{i:3d}] {ev['us']:>7.1f} us  {ev['name']}")


def profile_drafter(shape: str, bw: float, sequence: int) -> dict:
    """The DFlash draft graph (5-layer random drafter of the published layout, block 16, window 128) of ``shape``,
    replayed as a cycle runs it, next to the read limit of its weights (layers + the head it uses)."""
    from edgespec.bench.random_drafter import write_dflash_drafter
    from edgespec.bench.shapes import SHAPES, config_dict
    from edgespec.drafters.dflash import load_dflash_checkpoint
    from edgespec.speculative.acceptance import StrictGreedy
    device = torch.device("cuda")
    model = random_model(shape, device, torch.bfloat16, 2048)
    with tempfile.TemporaryDirectory() as tmp:
        write_dflash_drafter(tmp, config_dict(**SHAPES[shape]), num_layers=5, dtype=torch.bfloat16)
        proposer = load_dflash_checkpoint(tmp, model, window_size=128, cuda_graphs=True)
    session = SpecSession.with_defaults(model, select_hooks("auto", device), proposer, k=15, max_len=2048,
                                        cuda_graphs=True)
    session.generate(torch.randint(0, 1000, (256,)).tolist(), max_tokens=16, policy=StrictGreedy())
    graph = proposer._graph                      # captured by the generate above
    nbytes = sum(p.numel() * p.element_size() for p in proposer.drafter.layers.parameters())
    nbytes += proposer._head_weight.numel() * proposer._head_weight.element_size()
    res = profile_step(graph.replay)
    limit_us = nbytes / bw * 1e6
    res.update(shape=f"{shape} dflash draft", weight_limit_us=limit_us)
    print(f"\n{shape} DFlash draft (block 16, window 128): {res['step_us']:.0f} us, {res['gpu_us']:.0f} us in "
          f"kernels; weight-read limit {limit_us:.0f} us ({nbytes / 1e9:.2f} GB) = {limit_us / res['step_us']:.0%}")
    print_profile(res, sequence)
    append = proposer._append_graphs.get(1)      # a cycle that accepted nothing appends one row
    if append is not None:
        fc = proposer.drafter.fc.weight
        kv_rows = 2 * proposer.cfg.num_key_value_heads * proposer.cfg.head_dim
        app_bytes = fc.numel() * fc.element_size() + sum(
            layer.self_attn.qkv_proj.weight[-kv_rows:].numel() * fc.element_size() for layer in proposer.drafter.layers)
        app = profile_step(append.replay)
        app_limit = app_bytes / bw * 1e6
        print(f"\n{shape} DFlash window append (1 row): {app['step_us']:.0f} us, {app['gpu_us']:.0f} us in kernels; "
              f"weight-read limit {app_limit:.0f} us ({app_bytes / 1e9:.3f} GB) = {app_limit / app['step_us']:.0%}")
        print_profile(app, sequence)
        res["append"] = {**app, "weight_limit_us": app_limit}
    return res


def profile_prefill(shape: str, fmt: str, tokens: int, sequence: int, host: bool = False) -> dict:
    """One whole-model prefill of ``tokens`` tokens as ``edgespec bench formats`` times it (the arch's prefill
    chunk, a fresh cache each time), its kernels grouped."""
    from edgespec.bench.formats import prefill_step, served_model, shape_config
    device = torch.device("cuda")
    model, cache, hooks = served_model(shape_config(shape), fmt, device, torch.bfloat16, tokens + 8)
    step = prefill_step(model, cache, hooks, torch.randint(0, model.config.vocab_size, (tokens,), device=device))
    res = profile_step(step, steps=3)
    res.update(shape=f"{shape} {fmt} prefill {tokens}")
    if host:
        # Where the host's time goes (a prefill whose wall time exceeds its kernel time is launch-bound)
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(f"\n{shape} {fmt} prefill of {tokens} tokens: {res['step_us'] / 1e3:.2f} ms "
          f"({tokens / res['step_us'] * 1e6:.0f} tok/s), {res['gpu_us'] / 1e3:.2f} ms in kernels")
    print_profile(res, sequence)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3.5-4b,qwen3.5-27b")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rollback", default=None, help="verify rollback strategy (default: the arch default)")
    ap.add_argument("--sequence", type=int, default=0, help="also print the first N kernels of one step in order")
    ap.add_argument("--drafter", default=None, help="profile the DFlash draft graph of this shape instead")
    ap.add_argument("--prefill", default="", help="profile whole-model prefills of these lengths instead, e.g. 512")
    ap.add_argument("--format", default="dense", help="weight format of --prefill: dense, fp8, nvfp4, int4")
    ap.add_argument("--host", action="store_true", help="with --prefill: also a cProfile of the host side")
    args = ap.parse_args()
    device = torch.device("cuda")
    bw = measure_copy_bandwidth(device)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    report = {"device": torch.cuda.get_device_name(), "bandwidth_GBps": bw / 1e9, "shapes": []}
    shapes = [] if args.drafter or args.prefill else args.shapes.split(",")
    for shape in args.shapes.split(",") if args.prefill else []:
        for n in args.prefill.split(","):
            report["shapes"].append(profile_prefill(shape, args.format, int(n), args.sequence, args.host))
    if args.drafter:
        report["shapes"].append(profile_drafter(args.drafter, bw, args.sequence))
    for shape in shapes:
        row_counts = [int(r) for r in args.rows.split(",")]
        model = random_model(shape, device, torch.bfloat16, args.context + 64)
        limit_us = weight_bytes_per_token(model) / bw * 1e6
        for rows in row_counts:
            # A proposer only sizes the verify graph (rows - 1 drafts); the profile feeds the rows itself.
            proposer = NGramProposer() if rows > 1 else None
            session = SpecSession.with_defaults(model, select_hooks("auto", device), proposer,
                                                k=rows - 1 if rows > 1 else None,
                                                max_len=args.context + 64, cuda_graphs=True, rollback=args.rollback)
            prompt = torch.randint(0, model.config.vocab_size, (args.context,), device=device)
            session.hooks.prefill(model, session.cache, prompt, session.prefill_chunk, ())
            res = profile_rows(session, model, rows)
            res.update(shape=shape, weight_limit_us=limit_us)
            report["shapes"].append(res)
            print(f"\n{shape} rows={rows}: step {res['step_us']:.0f} us, {res['gpu_us']:.0f} us of it in kernels "
                  f"(gaps {res['step_us'] - res['gpu_us']:.0f} us); weight-read limit {limit_us:.0f} us = "
                  f"{limit_us / res['step_us']:.0%} of the step")
            print_profile(res, args.sequence)
            del session
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "step_profile.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
