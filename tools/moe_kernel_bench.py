"""Time one MoE layer's routed-expert product on a GPU against the bytes of the experts its rows touched.

For 1-64 rows of random routing over a Qwen3.5-35B-A3B layer (256 experts, k=8, hidden 2048, width 512, bf16):
the stacked Triton kernel (edgespec.kernels.moe.triton_moe) and the grouped torch path (one product per touched expert,
edgespec.kernels.moe.moe.grouped_expert_product), each as milliseconds, the expert union, and the fraction of the byte
limit (touched experts' bytes over the measured copy bandwidth). Random routing is close to uniform, so the union
is the high end of what a trained router touches.

    python tools/moe_kernel_bench.py [--rows 1,2,4,8,16,32,64] [--experts 256] [--hidden 2048] [--width 512]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from edgespec.bench.gpu import measure_copy_bandwidth
from edgespec.bench.timing import time_cuda
from edgespec.kernels.moe.moe import group_by_expert, grouped_expert_product, route
from edgespec.kernels.moe.triton_moe import stacked_expert_product_triton
from edgespec.kernels.pointwise.activation import silu_mul


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=512)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    E, k, H, I = args.experts, args.top_k, args.hidden, args.width
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=gen) * I ** -0.5
    fns = [lambda x, e=e: F.linear(silu_mul(F.linear(x, w13[e])), w2[e]) for e in range(E)]
    per_expert = (w13[0].numel() + w2[0].numel()) * 2
    bw = measure_copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}  copy bandwidth {bw / 1e9:.0f} GB/s  expert {per_expert / 1e6:.2f} MB")
    print(f"{'rows':>4} {'union':>5} {'limit us':>8} {'triton us':>9} {'% limit':>7} {'grouped us':>10} {'% limit':>7}")
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, H, device=dev, dtype=torch.bfloat16, generator=gen)
        w, ids = route(torch.randn(rows, E, device=dev, generator=gen).to(torch.bfloat16), k)
        union = group_by_expert(ids).union
        limit_us = union * per_expert / bw * 1e6
        ref = grouped_expert_product(x, w, ids, fns)
        got = stacked_expert_product_triton(x, w, ids, w13, w2)
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        t_us = time_cuda(lambda x=x, w=w, ids=ids: stacked_expert_product_triton(x, w, ids, w13, w2)) * 1e3
        g_us = time_cuda(lambda x=x, w=w, ids=ids: grouped_expert_product(x, w, ids, fns), iters=10) * 1e3
        print(f"{rows:>4} {union:>5} {limit_us:>8.1f} {t_us:>9.1f} {100 * limit_us / t_us:>6.1f}% {g_us:>10.1f} "
              f"{100 * limit_us / g_us:>6.1f}%  (max rel diff {err:.1e})")
        results.append({"rows": rows, "union": union, "limit_us": limit_us, "triton_us": t_us, "grouped_us": g_us,
                        "max_rel_diff": err})
    print(json.dumps({"device": torch.cuda.get_device_name(dev), "bandwidth_GBps": bw / 1e9, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
