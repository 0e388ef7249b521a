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


def graph_time_us(fn: Callable[[], Any], reps: int = 20) -> float:
    """Per-call microseconds of ``fn`` captured ``reps`` times in one CUDA graph (best of 5 replays): launch
    overhead out of the figure, as a served graph runs it."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best
