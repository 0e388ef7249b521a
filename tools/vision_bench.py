#!/usr/bin/env python3
"""What a camera frame costs on a GPU: the Qwen3.5/3.6 vision tower per frame, beside the text model's decode.

    python tools/vision_bench.py [--frames 640x480,1280x720] [--hidden 5120] [--reps 20] [--sm-limit 16]
                                 [--decode-shape qwen3.5-27b --format int4 --tokens 32]

Builds the published tower (27 blocks of 1152, 16 heads, patch 16, 2x2 merge; ``--hidden``: the text hidden size
it feeds, 5120 for the 27B) with random bf16 weights on the GPU and, per frame size, the grid the image processor
gives it (``smart_resize`` with Qwen3.5's bounds: 640x480 stays 640x480 = 1200 patches = 300 tokens; 1280x720
becomes 1280x704 = 3520 patches = 880 tokens, 720/32 = 22.5 rounding half to even), then times the tower's
forward (eager, as the server runs it: CUDA events, median of ``--reps`` after warm-up) and, with Pillow at hand,
the host side (JPEG decode + resize + patches). ``--decode-shape`` also builds that text model (``--format``
weights, random) and times its plain decode step (CUDA graphs) and the prefill of each frame's tokens, so the frame
is priced in decode steps.
``--sm-limit N`` runs everything on a green context of N SMs (``edgespec.bench.sm_limit``; Thor has 20: measure 16
and 24 and let ``tools/thor_projection.py --vision`` interpolate). Peak GPU memory is printed with every figure.
Writes vision_bench.json (vision_bench_sm<N>.json) to $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from edgespec.bench.gpu import sm_clock_mhz
from edgespec.bench.quant_stack import apply_sm_limit
from edgespec.bench.vision_shapes import QWEN35_TOWER, encode_frame, synthetic_frame
from edgespec.kernels import sm_count
from edgespec.loading.images import ImageLimits, ProcessorConfig, load_image, smart_resize
from edgespec.memory import module_bytes
from edgespec.models.config import VisionConfig
from edgespec.models.vision import VisionTower


def build_tower(hidden: int, device: torch.device) -> VisionTower:
    """The published tower feeding a text model of ``hidden``, random bf16 weights, allocated once on ``device``."""
    cfg = VisionConfig(**QWEN35_TOWER, out_hidden_size=hidden)
    with torch.device("meta"):
        tower = VisionTower(cfg).to(torch.bfloat16)
    tower = tower.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return tower.eval()


def time_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median device time of ``fn()`` in ms (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def host_ms(width: int, height: int, proc: ProcessorConfig, reps: int = 5) -> float | None:
    """Host preprocessing of one JPEG frame (decode, resize, patches); None without Pillow."""
    try:
        data = encode_frame(synthetic_frame(height, width, seed=1), "JPEG")
    except ImportError:
        return None
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        load_image(data, proc, ImageLimits())
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def frame_plan(cfg: VisionConfig, width: int, height: int, proc: ProcessorConfig) -> dict:
    """What the processor makes of a ``width x height`` frame (size, grid, tokens) and the tower's arithmetic on
    it: every block's linears per patch, attention's two patch x patch products, the patch embedding, the merger."""
    h_bar, w_bar = smart_resize(height, width, proc.factor, proc.min_pixels, proc.max_pixels)
    grid = (1, h_bar // cfg.patch_size, w_bar // cfg.patch_size)
    patches = grid[1] * grid[2]
    block = 4 * cfg.hidden_size ** 2 + 2 * cfg.hidden_size * cfg.intermediate_size
    merger = (cfg.merge_unit * cfg.hidden_size) ** 2 + cfg.merge_unit * cfg.hidden_size * cfg.out_hidden_size
    flops = 2 * (cfg.depth * (patches * block + 2 * patches ** 2 * cfg.hidden_size)
                 + patches // cfg.merge_unit * merger + patches * cfg.patch_dim * cfg.hidden_size)
    return {"frame": f"{width}x{height}", "resized": f"{w_bar}x{h_bar}", "grid": list(grid), "patches": patches,
            "tokens": patches // cfg.merge_unit, "tflop": flops / 1e12}


def frame_figures(tower: VisionTower, width: int, height: int, proc: ProcessorConfig, reps: int) -> dict:
    """:func:`frame_plan` with the tower's time (random pixels of that grid), host time and peak memory."""
    plan = frame_plan(tower.config, width, height, proc)
    grid = tuple(plan["grid"])
    device = tower.pos_embed.weight.device
    pixels = torch.randn(plan["patches"], tower.config.patch_dim, device=device)
    torch.cuda.reset_peak_memory_stats(device)
    ms = time_ms(lambda: tower(pixels, grid), reps)
    return {**plan, "tower_ms": ms, "tflops_per_s": plan["tflop"] / (ms / 1000.0),
            "host_ms": host_ms(width, height, proc), "peak_GB": torch.cuda.max_memory_allocated(device) / 1e9}


def text_figures(shape: str, fmt: str, device: torch.device, frames: list[dict], tokens: int) -> dict:
    """The text model's plain decode step (graphs) and the prefill of each frame's tokens."""
    from edgespec.arch.detect import select_hooks
    from edgespec.bench.formats import format_model
    from edgespec.bench.gpu import random_model
    from edgespec.bench.shapes import SHAPES, config_dict
    from edgespec.speculative.acceptance import StrictGreedy
    from edgespec.speculative.session import SpecSession

    max_len = 2048
    model = (random_model(shape, device, torch.bfloat16, max_len) if fmt == "dense"
             else format_model(config_dict(**SHAPES[shape]), fmt, device, torch.bfloat16, max_len))
    session = SpecSession.with_defaults(model, select_hooks("auto", device), None, max_len=max_len, cuda_graphs=True,
                                        stage_timing="device")
    prompt = torch.randint(0, 1000, (64,)).tolist()
    session.generate(prompt, max_tokens=8, policy=StrictGreedy())                 # warm-up, graphs captured
    res = session.generate(prompt, max_tokens=tokens, policy=StrictGreedy())
    out = {"shape": shape, "format": fmt, "weight_bytes": module_bytes(model),
           "decode_ms": res.telemetry.decode_ms / max(res.telemetry.generated_tokens - 1, 1)}
    for f in frames:
        ids = torch.randint(0, 1000, (f["tokens"],), device=device)

        def prefill(ids=ids):
            session.cache.reset()
            model.prefill(ids, session.cache, chunk=512, logits=False)

        f["prefill_ms"] = time_ms(prefill, reps=3, warmup=1)
        f["decode_steps"] = (f["tower_ms"] + f["prefill_ms"]) / out["decode_ms"]
    out["peak_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", default="640x480,1280x720", help="comma list of WIDTHxHEIGHT camera frames")
    ap.add_argument("--hidden", type=int, default=5120, help="text hidden size the tower feeds (27B: 5120)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sm-limit", type=int, default=0, help="run on a green context of this many SMs (Thor: 20)")
    ap.add_argument("--decode-shape", default=None, help="also time this text model's decode (e.g. qwen3.5-27b)")
    ap.add_argument("--format", default="int4", choices=("dense", "fp8", "nvfp4", "int4"))
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    try:
        frames = [tuple(int(x) for x in f.lower().split("x")) for f in args.frames.split(",") if f]
    except ValueError:
        ap.error(f"--frames {args.frames!r}: expected WIDTHxHEIGHT,...")
    device = torch.device("cuda")
    limit = apply_sm_limit(ap, args.sm_limit)        # before anything else runs on the GPU
    tower = build_tower(args.hidden, device)
    proc = ProcessorConfig()                  # Qwen3.5's preprocessor bounds: 65536 .. 16777216 pixels
    out = {"device": torch.cuda.get_device_name(device), "sms": sm_count(device), "sm_clock_mhz": sm_clock_mhz(),
           "sm_limit": {"requested": limit.requested, "granted": limit.granted, "device_sms": limit.device_sms}
           if limit else None, "tower_bytes": module_bytes(tower), "hidden": args.hidden,
           "frames": [frame_figures(tower, w, h, proc, args.reps) for w, h in frames]}
    print(f"{out['device']} ({out['sms']} SMs, {out['sm_clock_mhz']} MHz): Qwen3.5 tower "
          f"{out['tower_bytes'] / 1e9:.2f} GB bf16 -> hidden {args.hidden}", flush=True)
    if args.decode_shape:
        out["text"] = text_figures(args.decode_shape, args.format, device, out["frames"], args.tokens)
        t = out["text"]
        print(f"{t['shape']} {t['format']}: decode {t['decode_ms']:.2f} ms/token, peak {t['peak_GB']:.1f} GB")
    for f in out["frames"]:
        host = f"host {f['host_ms']:.1f} ms, " if f["host_ms"] is not None else ""
        text = (f", prefill of its tokens {f['prefill_ms']:.1f} ms = {f['decode_steps']:.1f} decode steps with "
                f"the tower" if "prefill_ms" in f else "")
        print(f"{f['frame']} -> {f['resized']}: {f['tokens']} tokens; {host}tower {f['tower_ms']:.2f} ms "
              f"({f['tflop']:.2f} TFLOP, {f['tflops_per_s']:.0f} TFLOP/s), peak {f['peak_GB']:.2f} GB{text}")
    if os.environ.get("OUT"):
        name = f"vision_bench_sm{args.sm_limit}.json" if args.sm_limit else "vision_bench.json"
        Path(os.environ["OUT"], name).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
