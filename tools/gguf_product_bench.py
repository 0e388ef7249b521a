"""Time one GGUF weight product on the CPU: the compiled kernel of ``gguf_cpu.c`` against the torch reference.

For each block type (Q4_0, Q4_1, Q8_0 quantized by gguf-py; Q4_K, Q5_K, Q6_K random super-blocks) it builds one
``[N, K]`` matrix and prints the median time of ``x [M, K] @ W^T`` with both products, and the weight bytes per
second of the compiled one. Repeats are interleaved; the load average is printed (shared machines are noisy).

    python tools/gguf_product_bench.py [--n 2048 --k 2048 --rows 1 --repeats 9]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from edgespec.config import load_settings
from edgespec.kernels.cpu import gguf_native
from edgespec.plan import install_kernel_options
from edgespec.weights.gguf import GGML_FORMATS
from edgespec.weights.gguf_kquants import K_FORMATS, random_kquant

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def _weight(name: str, n: int, k: int, rng: np.random.Generator):
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    kind = TYPES[name]
    if kind in K_FORMATS:
        raw = random_kquant(n, k, name, rng)
    else:
        raw = quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), getattr(Q, name))
    cls = {**GGML_FORMATS, **K_FORMATS}[kind]
    return cls(torch.from_numpy(np.ascontiguousarray(raw)), n, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    install_kernel_options(load_settings())   # the kernel switches of EDGESPEC_CONFIG / EDGESPEC_* (no engine here)
    if gguf_native.library() is None:
        raise SystemExit("the compiled GGUF product cannot be built here")
    rng = np.random.default_rng(0)
    x = torch.randn(args.rows, args.k)
    print(f"[{args.n}, {args.k}] weight, {args.rows} activation row(s), {gguf_native.threads()} threads, "
          f"load {os.getloadavg()[0]:.1f}")
    print("type | compiled ms | reference ms | compiled weight GB/s")
    with torch.inference_mode():
        for name in TYPES:
            w = _weight(name, args.n, args.k, rng)
            times: dict[str, list[float]] = {"compiled": [], "reference": []}
            w.matmul(x), w.matmul_ref(x)
            for _ in range(args.repeats):
                for label, fn in (("compiled", w.matmul), ("reference", w.matmul_ref)):
                    t0 = time.perf_counter()
                    fn(x)
                    times[label].append(time.perf_counter() - t0)
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            print(f"{name} | {med['compiled'] * 1e3:.2f} | {med['reference'] * 1e3:.1f} | "
                  f"{w.nbytes / med['compiled'] / 1e9:.1f}")


if __name__ == "__main__":
    main()
