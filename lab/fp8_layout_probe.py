#!/usr/bin/env python3
"""Is FP8 decode attention bound by the cache's head interleaving? Same bytes, different row contiguity.

The cache is ``[keys, Hkv, hd]``: with Hkv = 4 and hd = 256, one (key, head) row of FP8 is 256 contiguous bytes
and the four heads of a key share one 1 KB row, read by four different programs at different times. This script
times the bf16 and FP8 attentions at equal bytes with Hkv = 4 (32k keys), 2 (64k) and 1 (128k keys: every read
contiguous), 24 / 12 / 6 query heads (group 6). If the FP8 kernels speed up as rows get contiguous while the
bf16 kernel (512-byte rows) does not, DRAM row locality, not kernel work, is what limits them. (Answer: they
do not; docs/notes/attention-experiments.md.)

``PYTHONPATH=. python3 lab/fp8_layout_probe.py [write|read]`` on a CUDA machine (the L2 flush of the timer).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.bench.kernel_timing import graph_us, make_cache  # noqa: E402
from edgespec.kernels import attention_bytes  # noqa: E402
from edgespec.kernels.attention.triton_attention import cached_attention_triton  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    hd, group = 256, 6
    flush = sys.argv[1] if len(sys.argv) > 1 else "write"
    print(f"L2 flush before each call: {flush}")
    for n_kv, keys in ((4, 32768), (2, 65536), (1, 131072)):
        n_q = n_kv * group
        q = torch.randn(1, n_q, hd, device="cuda", dtype=torch.bfloat16)
        scale = hd ** -0.5
        row = []
        for fp8 in (False, True):
            cache = make_cache(keys, n_kv, hd, fp8)
            nbytes = attention_bytes(1, n_q, n_kv, hd, keys, fp8)
            us = graph_us(partial(cached_attention_triton, q, cache, keys - 1, scale), reps=10, rep_ms=30,
                          flush_mode=flush)
            row.append(f"{'fp8' if fp8 else 'bf16'} triton {us:5.1f} us ({nbytes / us * 1e-3:4.0f} GB/s)")
            del cache
            torch.cuda.empty_cache()
        print(f"Hkv={n_kv} keys={keys:<6} " + " | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
