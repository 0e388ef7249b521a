#!/usr/bin/env python3
"""Run the decode attention of the 27B heads at 32768 keys a few times, for a profiler to catch one launch.

``ncu --clock-control none --kernel-name regex:"_attn_split_kernel|_fp8_decode_kernel" --launch-skip 3 --launch-count 1
--section WarpStateStats --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis
python lab/attn_one_call.py --kv fp8`` (``bash lab/lab_sweep.sh attn-ncu`` runs it for both caches). Each call
is preceded by a write of 256 MB (``kernel_timing.evict_l2``), so the cache is read from HBM as in the flushed timing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.bench.kernel_timing import evict_l2, make_cache  # noqa: E402
from edgespec.kernels.attention.triton_attention import cached_attention_triton  # noqa: E402

N_Q, N_KV, HD, CTX = 24, 4, 256, 32768


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--config", default="{}", help='launch overrides as JSON, e.g. \'{"GLUON": 1}\' (FP8 only)')
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    cache = make_cache(CTX, N_KV, HD, args.kv == "fp8")
    q = torch.randn(1, N_Q, HD, device="cuda", dtype=torch.bfloat16)
    for _ in range(args.calls):
        evict_l2("write")
        cached_attention_triton(q, cache, CTX - 1, HD ** -0.5, config=json.loads(args.config))
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
