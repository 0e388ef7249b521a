#!/usr/bin/env python3
"""Time the DFlash block attention (``edgespec.kernels.attention.triton_block_attention``) per split count and tile
config.

Run from the repository root on a CUDA machine:  ``PYTHONPATH=. python3 tools/block_attn_bench.py [--iters 200]``

Shape: the Qwen3.5-27B drafter's attention (T=16 block rows, Hq=24, Hkv=4, hd=256, W=128 window rows), bf16, with
a causal drafter mask whose oldest ring slots are empty. For every ``n_splits`` in {1, 2, 3, 5, default} and a few
``BLOCK_N`` / ``num_warps`` choices it prints one line: microseconds per call timed eagerly with CUDA events (after
a warm-up; includes the host launch overhead), microseconds per call replayed from a CUDA graph (several calls per
graph: launch overhead excluded, the gap between the two launches of a split call included), the count of splits
actually launched, and the max abs error against the float32 torch reference. The reference's own time comes first.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.arch.graphs import capture_graph  # noqa: E402
from edgespec.bench.timing import time_cuda  # noqa: E402
from edgespec.kernels import sm_count  # noqa: E402
from edgespec.kernels.attention.block_attention import block_attention_ref  # noqa: E402

T, HQ, HKV, HD, W = 16, 24, 4, 256, 128
SPLITS: list[int | None] = [1, 2, 3, 5, None]
CONFIGS: list[dict[str, int]] = [{}, {"BLOCK_N": 16}, {"BLOCK_N": 32, "num_warps": 8}, {"BLOCK_N": 64}]


def make_inputs() -> tuple[torch.Tensor, ...]:
    """bf16 queries and block K/V, float32 window of bf16 values, causal bias with 40 empty ring slots."""
    torch.manual_seed(0)
    q = torch.randn(T, HQ, HD, device="cuda").bfloat16()
    keys, values = torch.randn(2, W + T, HKV, HD, device="cuda").bfloat16().float()
    k_block, v_block = torch.randn(2, T, HKV, HD, device="cuda").bfloat16()
    key_pos = torch.arange(-40, W + T - 40, device="cuda")
    visible = (key_pos >= 0)[None, :] & (key_pos[W:][:, None] >= key_pos[None, :])
    bias = torch.where(visible, 0.0, float("-inf")).repeat(HQ // HKV, 1)
    return q, k_block, v_block, keys, values, bias


def time_eager(fn: Callable[[], object], iters: int, warmup: int = 20) -> float:
    """Microseconds per call, CUDA events around ``iters`` back-to-back calls after ``warmup`` ones."""
    return time_cuda(fn, iters=iters, warmup=warmup, repeats=1) * 1e3


def time_graph(fn: Callable[[], object], iters: int, calls_per_graph: int = 20) -> float:
    """Microseconds per call, replaying a CUDA graph of ``calls_per_graph`` calls (no host launch overhead)."""
    graph, _ = capture_graph(lambda: [fn() for _ in range(calls_per_graph)], warmups=1)   # compiles outside
    replays = max(1, iters // calls_per_graph)
    return time_eager(graph.replay, replays, warmup=3) / calls_per_graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200, help="timed calls per configuration")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("block_attn_bench: needs a CUDA device (none found); nothing timed")
    from edgespec.kernels.attention.triton_block_attention import block_attention_launch, block_attention_triton

    q, k_block, v_block, keys, values, bias = make_inputs()
    scale = HD ** -0.5
    ref_keys, ref_values = keys.clone(), values.clone()     # the reference writes the scratch rows

    def ref() -> torch.Tensor:
        return block_attention_ref(q, k_block, v_block, ref_keys, ref_values, bias, scale)

    want = ref().float()
    n_sms = sm_count(q.device)
    print(f"{torch.cuda.get_device_name()} ({n_sms} SMs); T={T} Hq={HQ} Hkv={HKV} hd={HD} W={W}, {args.iters} iters")
    print(f"{'torch reference':44s} eager {time_eager(ref, args.iters):7.1f} us   graph "
          f"{time_graph(ref, args.iters):7.1f} us")
    for config in CONFIGS:
        for n_splits in SPLITS:
            name = f"n_splits={n_splits or 'default'} {config or 'default tiles'}"
            try:
                launched = block_attention_launch(T, W + T, HD, HQ, n_sms, n_splits, config)["n_splits"]
            except ValueError as err:
                print(f"{name:44s} skipped: {err}")
                continue

            def run(n_splits=n_splits, config=config) -> torch.Tensor:
                return block_attention_triton(q, k_block, v_block, keys, values, bias, scale, n_splits, config)

            err = (run().float() - want).abs().max().item()
            eager, graph = time_eager(run, args.iters), time_graph(run, args.iters)
            print(f"{name:44s} eager {eager:7.1f} us   graph {graph:7.1f} us   launched {launched} splits   "
                  f"max abs err {err:.2e}")


if __name__ == "__main__":
    main()
