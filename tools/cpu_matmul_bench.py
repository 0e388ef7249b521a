"""Measure fp32 CPU matrix products of the demo model's shapes: torch (MKL) vs numpy's OpenBLAS.

Prints the weight bandwidth each reaches (weight bytes / time) for 1..16 rows next to the DRAM read bandwidth
of a plain reduction, which is the limit a batch-1 forward can reach. This is the measurement behind
``edgespec.kernels.quant.linear`` (why fp32 CPU linears go through OpenBLAS, one GEMV per row up to ROWS_MAX rows).

    python tools/cpu_matmul_bench.py [--rows 1,2,5,11,16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from edgespec.kernels.quant import linear as L

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]   # out, in (demo model, merged)


def _median_ms(fn, repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def read_bandwidth_gbs() -> float:
    a = torch.randn(125_000_000)   # 500 MB
    return 0.5 / (_median_ms(lambda: a.sum(), 5) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,5,8,11,16")
    args = ap.parse_args()
    threads = torch.get_num_threads()
    print(f"torch threads {threads}; DRAM read bandwidth (sum of 500 MB): {read_bandwidth_gbs():.1f} GB/s")
    print(f"{'out x in':>12} {'rows':>4} {'torch GB/s':>11} {'edgespec GB/s':>14}")
    for n_out, k_in in SHAPES:
        count = max(1, 40_000_000 // (n_out * k_in))   # 160 MB of weights per pass: out of every cache
        weights = [torch.randn(n_out, k_in) for _ in range(count)]
        gb = count * n_out * k_in * 4 / 1e9
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k_in)
            with torch.inference_mode():
                torch.set_num_threads(threads)
                t_torch = _median_ms(lambda x=x, ws=weights: [F.linear(x, w) for w in ws])
                L.configure_cpu()
                t_ours = _median_ms(lambda x=x, ws=weights: [L.linear(x, w) for w in ws])
                L.configure_cpu(False)
            print(f"{n_out:>6}x{k_in:<5} {rows:>4} {gb / t_torch * 1e3:>11.1f} {gb / t_ours * 1e3:>14.1f}")
    torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
