"""Timing one call on the device: the clock every benchmark in this package shares."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def time_cuda(fn: Callable[[], Any], iters: int = 50, warmup: int = 5, repeats: int = 5) -> float:
    """Median milliseconds per call of ``fn`` (CUDA events; host clock on CPU)."""
    for _ in range(warmup):
        fn()
    results = []
    cuda = torch.cuda.is_available()
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            results.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            results.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(results)
