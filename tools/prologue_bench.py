"""Fused GEMV prologues against the two launches they replace, on the real matrices of a model shape (GPU).

    python tools/prologue_bench.py [--shapes qwen3.5-4b,qwen3.5-27b] [--rows 1,16]

For each shape it times, inside CUDA graphs and over enough weight copies to keep them out of L2:
  silu:  linear_silu_mul(gate_up, down)           vs  linear(silu_mul(gate_up), down)
  norm:  linear_gated_rms_norm(o, z, w, out_proj) vs  linear(gated_rms_norm(o, z, w), out_proj)
  gate:  linear_sigmoid_gate(x, g, o_proj)        vs  linear(x * sigmoid(g), o_proj)
and prints microseconds per call both ways. The model wires a fusion in only where it wins here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.bench.gpu import time_cuda  # noqa: E402
from edgespec.kernels.activation import silu_mul  # noqa: E402
from edgespec.kernels.linear import linear, linear_gated_rms_norm, linear_sigmoid_gate, linear_silu_mul  # noqa: E402
from edgespec.kernels.norm import gated_rms_norm  # noqa: E402
from edgespec.loading.hf_config import parse_config  # noqa: E402
from edgespec.loading.synthetic import SHAPES, config_dict  # noqa: E402


def _graphed(fn, copies: int) -> float:
    """Microseconds per call of ``fn(i)`` over ``copies`` weight copies, captured once as a CUDA graph."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    return time_cuda(graph.replay, iters=20, warmup=3) * 1e3 / copies


def bench(shape: str, rows: int) -> None:
    cfg = parse_config(config_dict(**SHAPES[shape]))
    dev, dt = torch.device("cuda"), torch.bfloat16
    H, inter = cfg.hidden_size, cfg.intermediate_size
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    hq, hd = cfg.num_attention_heads, cfg.head_dim
    cases = {
        "silu": (H, inter), "norm": (H, hv * dv), "gate": (H, hq * hd),
    }
    for name, (n, k) in cases.items():
        copies = max(2, (400 << 20) // (n * k * 2))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        fused, plain = _pair(name, ws, rows, k, hv, dv)
        t_f, t_p = _graphed(fused, copies), _graphed(plain, copies)
        print(f"{shape:<12} rows={rows:<3} {name:<5} {n}x{k:<6} fused {t_f:7.2f} us  two launches {t_p:7.2f} us"
              f"  ({'fused wins' if t_f < t_p else 'keep separate'})", flush=True)
        del ws, fused, plain
        torch.cuda.empty_cache()


def _pair(name: str, ws: list[torch.Tensor], rows: int, k: int, hv: int, dv: int):
    """``(fused(i), plain(i))`` for one prologue over weight copy ``i``, on fresh random inputs."""
    dev, dt = ws[0].device, ws[0].dtype
    if name == "silu":
        x = torch.randn(rows, 2 * k, device=dev, dtype=dt)
        return (lambda i: linear_silu_mul(x, ws[i])), (lambda i: linear(silu_mul(x), ws[i]))
    if name == "norm":
        o = torch.randn(rows, hv, dv, device=dev, dtype=dt)
        z = torch.randn(rows, hv, dv, device=dev, dtype=dt)
        nw = torch.rand(dv, device=dev, dtype=dt) + 0.5
        return ((lambda i: linear_gated_rms_norm(o, z, nw, 1e-6, ws[i])),
                (lambda i: linear(gated_rms_norm(o, z, nw, 1e-6).reshape(rows, k), ws[i])))
    x = torch.randn(rows, k, device=dev, dtype=dt)
    g = torch.randn(rows, k, device=dev, dtype=dt)
    return (lambda i: linear_sigmoid_gate(x, g, ws[i])), (lambda i: linear(x * torch.sigmoid(g), ws[i]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3.5-4b,qwen3.5-27b")
    ap.add_argument("--rows", default="1,16")
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            bench(shape, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
