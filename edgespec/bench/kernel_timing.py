"""GPU timing of one kernel call and the KV caches the attention probes read: shared by ``tools/kernel_bench.py``
and the ``lab/`` probes, which import this module instead of each other.

:func:`graph_us` times a call free of host launch overhead with the L2 cache evicted before each call
(:func:`evict_l2`), as in a real decode step where the weight-streaming products run first; :func:`make_cache` fills
a bf16 or FP8 :class:`~edgespec.cache.kv.KVCache` with random rows, and the twins store the same rows in the
layouts the probes compare. CUDA only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from edgespec.cache.kv import KVCache

DEV = "cuda"
FLUSH_MODES = ("write", "read")
_FLUSH: list[torch.Tensor] = []


def _flush_buffers() -> list[torch.Tensor]:
    """The 256 MB buffer (> L2) that :func:`evict_l2` writes or reads, and the sink of its sum; made on first use."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(64 << 20, dtype=torch.int32, device=DEV))
        _FLUSH.append(torch.zeros((), dtype=torch.int64, device=DEV))
    return _FLUSH


def evict_l2(mode: str) -> None:
    """Push the L2 cache's contents out: write 256 MB ("write": L2 left full of dirty lines) or read them ("read":
    L2 left full of clean lines)."""
    flush, sink = _flush_buffers()
    if mode == "write":
        flush.zero_()
    else:
        torch.sum(flush, dim=0, dtype=torch.int64, out=sink)


def graph_us(fn: Callable[[], Any], reps: int = 10, rep_ms: int = 60, flush_mode: str = "write") -> float:
    """GPU microseconds per call, free of host launch overhead: ``reps`` calls, each after an L2 flush
    (``flush_mode``), are captured in one CUDA graph and timed by replay; a graph of the flushes alone is timed
    and subtracted.

    ``write`` zeroes a 256 MB buffer (L2 is left full of dirty lines, which the timed kernel must write back as it
    reads), ``read`` sums it (L2 is left full of clean lines, as after the weight-streaming GEMVs that precede
    attention in a decode step)."""
    mode = flush_mode
    if mode not in FLUSH_MODES:
        raise ValueError(f"flush mode {mode!r}: 'write' or 'read'")
    from triton.testing import do_bench

    _flush_buffers()                                       # made on the current stream, before the side stream
    evict = partial(evict_l2, mode)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                          # compile and warm up outside the capture
        evict()
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    work, flush_only = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(work):
        for _ in range(reps):
            evict()
            fn()
    with torch.cuda.graph(flush_only):
        for _ in range(reps):
            evict()
    t_work = do_bench(work.replay, warmup=10, rep=rep_ms, return_mode="median")
    t_flush = do_bench(flush_only.replay, warmup=10, rep=rep_ms, return_mode="median")
    del work, flush_only
    return max(t_work - t_flush, 0.0) / reps * 1e3


def make_cache(max_len: int, n_kv: int, hd: int, fp8: bool, v_block: int | None = None) -> KVCache:
    """A bf16 or FP8 cache of random rows; ``v_block`` picks an FP8 cache's V layout (None: the default)."""
    cache = KVCache(max_len, n_kv, hd, torch.bfloat16, DEV, fp8=fp8, v_block=v_block)
    step = 8192                         # write in slices: quantising 32k rows at once needs a big fp32 temp
    for s0 in range(0, max_len, step):
        n = min(step, max_len - s0)
        cache.write(s0, torch.randn(n, n_kv, hd, device=DEV, dtype=torch.bfloat16),
                    torch.randn(n, n_kv, hd, device=DEV, dtype=torch.bfloat16))
    return cache


def key_major_twin(cache: KVCache) -> KVCache:
    """A copy of an FP8 ``cache`` with the same rows and scales and a key-major V (the former layout)."""
    twin = KVCache(cache.max_len, *cache.v_row_shape, cache.dtype, cache.k.device, fp8=True, v_block=0)
    twin.k.copy_(cache.k)
    twin.k_scale.copy_(cache.k_scale)
    twin.v_scale.copy_(cache.v_scale)
    twin.v.copy_(cache.v_rows(cache.max_len))
    return twin


def head_major_twin(cache: KVCache) -> KVCache:
    """A copy of ``cache`` with the same rows whose K (and a key-major V) and scales are stored head-major: each KV
    head's keys contiguous, so one key tile is one contiguous block (8 KB at hd 256 in FP8) instead of 32 rows strided
    by the other heads. The tensors keep their ``[max_len, Hkv, ...]`` shape as strided views, which the attention
    kernel reads through their strides: nothing else in the runtime stores this layout (a layout probe only)."""
    twin = copy.copy(cache)                    # the same settings; every tensor is replaced below

    def head_major(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).contiguous().transpose(0, 1)

    twin.k = head_major(cache.k)
    twin.v = cache.v.clone() if cache.v_block else head_major(cache.v)
    if cache.fp8:
        twin.k_scale, twin.v_scale = head_major(cache.k_scale), head_major(cache.v_scale)
    return twin
