#!/usr/bin/env python3
"""Compile the quantized products for sm_90 without a GPU and count what their main loop executes per weight.

The 4-bit products are bound by instructions, not bytes (docs/quant_kernels.md): an H100 at the 4-bit byte limit
must take ~5.9 weights per ns and issues ~29.6 lane-instructions per ns, so a loop above ~5 lane-instructions per
weight cannot reach the limit at all. This prints, per kernel and launch, registers, shared memory, the loop's
instruction count per warp and lane-instructions per weight (loop x 32 lanes x warps / weights of one tile), with
its top opcodes. Needs only Triton (its bundled ptxas and cuobjdump):

    python lab/quant_sass.py                      # int4 and nvfp4: pair tiles, byte tiles, one-row word kernel
    python lab/quant_sass.py --block-n 256 --warps 8 --group 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attn_sass import _compile_sm90, loop_report  # noqa: E402

from edgespec.kernels.quant import triton_quant_kernels as tq  # noqa: E402

TYPES = {"x_ptr": "*bf16", "s_ptr": "*fp16", "z_ptr": "*u8", "part_ptr": "*fp32", "b_ptr": "*bf16",
         "y_ptr": "*bf16"}


def programs(args: argparse.Namespace) -> list[tuple[str, object, dict, dict, int]]:
    """(label, kernel, constexprs, pointer types, weights per loop pass) of each program to compile."""
    bn, g = args.block_n, args.group
    common = dict(DIRECT=True, HAS_BIAS=False, PDL=True)
    return [
        ("int4 pair tile, 1..16 rows", tq._int4_pair_dot_kernel,
         dict(GROUP=g, BLOCK_M=16, BLOCK_N=bn, IS_BF16=True, PREFETCH=args.prefetch, **common),
         {**TYPES, "q_ptr": "*i32"}, bn * g),
        ("int4 byte tile (old), 2..16 rows", tq._int4_kernel,
         dict(GROUP=g, BLOCK_M=16, BLOCK_N=bn, DOT=True, M_FAST=False, **common), {**TYPES, "q_ptr": "*u8"}, bn * g),
        ("int4 word kernel, fp16 pairs, 1 row", tq._int4_gemv_h2_kernel,
         dict(GROUP=g, BLOCK_N=64, **common), {**TYPES, "q_ptr": "*i32"}, 64 * g),
        ("nvfp4 pair tile, 1..16 rows", tq._nvfp4_pair_dot_kernel,
         dict(BLOCK_M=16, BLOCK_N=bn, IS_BF16=True, **common),
         {**TYPES, "q_ptr": "*i32", "s_ptr": "*fp8e4nv", "scale2_ptr": "*fp32"}, bn * 128),
        ("nvfp4 byte tile (old), 2..16 rows", tq._nvfp4_kernel,
         dict(TILE=128, BLOCK_M=16, BLOCK_N=bn, DOT=True, M_FAST=False, **common),
         {**TYPES, "q_ptr": "*u8", "s_ptr": "*fp8e4nv", "scale2_ptr": "*fp32"}, bn * 128),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--prefetch", type=int, default=0, help="pair tile: L2 lines per row asked for before the PDL wait")
    args = ap.parse_args(argv)
    for label, fn, consts, types, weights in programs(args):
        kernel = _compile_sm90(fn, consts, types, {"num_warps": args.warps, "num_stages": args.stages})
        resources, n, opcodes = loop_report(kernel, args.top)
        print(f"{label}: {resources}, loop {n} per warp = {n * 32 * args.warps / weights:.2f} lane-instructions "
              "per weight")
        print(opcodes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
