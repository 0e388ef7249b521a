"""Where the DFlash draft stage's time goes: host calls against device progress, per cycle.

    python lab/draft_trace.py [--shape qwen3.5-27b] [--tokens 64]

Runs the session of ``tools/cycle_bench.py`` (random target of the shape, random 5-layer DFlash drafter, K=15,
``stage_timing: device``) with the draft stage instrumented: CUDA events and host clocks at the stage start, after
the commit's launches, after the append graph's replay call, before and after the block graph's replay call, and
at the stage end. Prints the mean per cycle of each host interval and of each device interval, so host latency
that leaves the device idle shows up as device time not covered by kernels (compare with
``tools/step_profile.py --drafter``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict

import torch

from edgespec.arch.detect import select_hooks  # noqa: E402
from edgespec.bench.gpu import random_model  # noqa: E402
from edgespec.bench.random_drafter import write_dflash_drafter  # noqa: E402
from edgespec.bench.shapes import SHAPES, config_dict  # noqa: E402
from edgespec.drafters import dflash  # noqa: E402
from edgespec.speculative.acceptance import StrictGreedy  # noqa: E402
from edgespec.speculative.session import SpecSession  # noqa: E402
from edgespec.speculative.telemetry import RequestTelemetry  # noqa: E402


class Marks:
    """Host clock + device event at named points of one cycle; ``close`` folds a cycle into the sums."""

    def __init__(self) -> None:
        self.points: list[tuple[str, float, torch.cuda.Event]] = []
        self.host: dict[str, float] = defaultdict(float)
        self.dev: dict[str, float] = defaultdict(float)
        self.cycles = 0

    def mark(self, name: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.points.append((name, time.perf_counter(), ev))

    def close(self) -> None:
        torch.cuda.synchronize()
        for (a, ta, ea), (b, tb, eb) in zip(self.points, self.points[1:], strict=False):
            key = f"{a} -> {b}"
            self.host[key] += (tb - ta) * 1e3
            self.dev[key] += ea.elapsed_time(eb)
        if self.points:
            self.cycles += 1
        self.points = []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-27b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    device = torch.device("cuda")
    model = random_model(args.shape, device, torch.bfloat16, max_len=2048)
    marks = Marks()
    with tempfile.TemporaryDirectory() as tmp:
        write_dflash_drafter(tmp, config_dict(**SHAPES[args.shape]), num_layers=5, dtype=torch.bfloat16)
        proposer = dflash.load_dflash_checkpoint(tmp, model, window_size=128, cuda_graphs=True)
    session = SpecSession.with_defaults(model, select_hooks("auto", device), proposer, k=15, max_len=2048,
                                        cuda_graphs=True, stage_timing="device")
    prompt = torch.randint(0, 1000, (256,)).tolist()
    session.generate(prompt, max_tokens=16, policy=StrictGreedy())            # warm-up, captures every graph

    # Instrument: the draft stage's boundaries and the drafter's device launches.
    real_stage = RequestTelemetry.stage

    def stage(self, name):
        if name != "draft":
            return real_stage(self, name)
        ctx = real_stage(self, name)

        class Wrapped:
            def __enter__(self_inner):
                ctx.__enter__()
                marks.mark("stage start")

            def __exit__(self_inner, *exc):
                marks.mark("stage end (before sync)")
                ctx.__exit__(*exc)
                marks.close()
        return Wrapped()

    RequestTelemetry.stage = stage
    real_append, real_run = proposer._append_static, proposer._run_static

    def append_static(taps, start):
        marks.mark("commit: append")
        real_append(taps, start)
        marks.mark("append replayed")

    def run_static(anchor):
        marks.mark("propose: block")
        out = real_run(anchor)
        marks.mark("block replayed")
        return out

    proposer._append_static, proposer._run_static = append_static, run_static
    res = session.generate(prompt, max_tokens=args.tokens, policy=StrictGreedy())
    RequestTelemetry.stage = real_stage
    n = max(marks.cycles, 1)
    print(f"{args.shape}: {marks.cycles} draft stages, draft stage {res.telemetry.stage_ms['draft'] / n:.3f} ms "
          f"each (telemetry, with its syncs)")
    print(f"  {'interval':<52} {'host us':>9} {'device us':>10}")
    for key in marks.host:
        print(f"  {key:<52} {marks.host[key] / n * 1e3:9.1f} {marks.dev[key] / n * 1e3:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
