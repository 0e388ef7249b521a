#!/usr/bin/env python3
"""Compile the MoE expert kernels for sm_90 without a GPU and count what their K-tile loop executes per weight.

The CUDA-core expert kernels (``edgespec.kernels.moe.triton_moe_gemv`` for int4, ``triton_moe_gemv_packed`` for NVFP4
and block-FP8) loop over a slot's rows and, inside, over K tiles; the tensor-core kernels of
``triton_moe_int4`` / ``triton_moe_quant`` loop over K tiles only. This prints, per kernel, registers, spills and
the innermost loop's lane-instructions per weight (instructions per warp x 32 lanes x warps / weights of one pass)
with its top opcodes, as ``lab/quant_sass.py`` does for the dense products. Needs only Triton (its ptxas and
cuobjdump)::

    python lab/moe_gemv_sass.py
    python lab/moe_gemv_sass.py --top 16
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton.language as tl  # noqa: E402
from attn_sass import _INSTR, _compile_sm90, dump  # noqa: E402
from sass_loop import _BRANCH, opcode  # noqa: E402

from edgespec.kernels.moe import triton_moe_gemv as g4  # noqa: E402
from edgespec.kernels.moe import triton_moe_gemv_packed as gp  # noqa: E402
from edgespec.kernels.moe import triton_moe_int4 as m4  # noqa: E402
from edgespec.kernels.moe import triton_moe_quant as mq  # noqa: E402

GROUP = 128
PTR = {"x_ptr": "*bf16", "part_ptr": "*fp32", "out_ptr": "*fp32", "pair_w_ptr": "*fp32", "act_ptr": "*bf16",
       "y_ptr": "*fp32", "pair_row_ptr": "*i32", "pair_dst_ptr": "*i32", "slot_first_ptr": "*i32",
       "slot_count_ptr": "*i32", "slot_expert_ptr": "*i32"}


def programs(args: argparse.Namespace) -> list[tuple[str, object, dict, dict, dict, int]]:
    """(label, kernel, constexprs, pointer types, options, weights per pass of the innermost loop)."""
    up, down, w = args.up_block_n, args.down_block_n, {"num_warps": args.warps}
    tc = {"num_warps": m4.TUNING["num_warps"], "num_stages": m4.TUNING["num_stages"]}
    int4 = {**PTR, "q_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8"}
    nv = {**PTR, "q_ptr": "*i32", "s_ptr": "*i64", "g_ptr": "*fp32"}
    nv_tc = {**PTR, "q_ptr": "*i32", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32"}
    f8 = {**PTR, "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "g_ptr": "*fp8e4nv"}
    tc_consts = dict(K_TILES=16, IS_BF16=True, F32=False)
    return [
        ("int4 gemv up (gate+up), CUDA cores", g4._gemv_up_kernel, dict(GROUP=GROUP, BLOCK_N=up), int4, w,
         2 * up * GROUP),
        ("int4 gemv down, CUDA cores", g4._gemv_down_kernel, dict(GROUP=GROUP, BLOCK_N=down, ACT=tl.bfloat16), int4, w,
         down * GROUP),
        ("nvfp4 gemv up (gate+up), CUDA cores", gp._nvfp4_up_kernel, dict(BLOCK_N=up), nv, w, 2 * up * 128),
        ("nvfp4 gemv down, CUDA cores", gp._nvfp4_down_kernel, dict(BLOCK_N=down, ACT=tl.bfloat16), nv, w, down * 128),
        ("fp8 gemv up (gate+up), CUDA cores", gp._fp8_up_kernel, dict(BLOCK_N=up), f8, w, 2 * up * 128),
        ("fp8 gemv down, CUDA cores", gp._fp8_down_kernel, dict(BLOCK_N=down, ACT=tl.bfloat16), f8, w, down * 128),
        ("int4 up, tensor cores (16 rows)", m4._up_kernel, dict(GROUP=GROUP, BLOCK_N=32, **tc_consts),
         int4, tc, 2 * 32 * GROUP),
        ("nvfp4 up, tensor cores (16 rows)", mq._up_kernel, dict(BLOCK_N=32, NVFP4=True, **tc_consts), nv_tc, tc,
         2 * 32 * 128),
        ("fp8 up, tensor cores (16 rows)", mq._up_kernel, dict(BLOCK_N=32, NVFP4=False, **tc_consts), f8, tc,
         2 * 32 * 128),
    ]


def tile_loop(sass: str) -> tuple[int, collections.Counter]:
    """Instruction count and opcodes of the K-tile loop: of the loops (backward branches) holding the most
    multiply-adds (FFMA, HFMA2, HMMA), the smallest (the row loop around it holds the same ones)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in map(_INSTR.match, sass.splitlines()) if m]
    best = None
    for addr, text in ins:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            body = [t for a, t in ins if lo <= a <= addr]
            fma = sum(opcode(t).split(".")[0] in ("FFMA", "HFMA2", "HMMA") for t in body)
            key = (fma, -len(body))
            best = (key, body) if best is None or key > best[0] else best
    body = best[1] if best else []
    return len(body), collections.Counter(opcode(t) for t in body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--up-block-n", type=int, default=gp.PACKED_GEMV_TUNING["up_block_n"])
    ap.add_argument("--down-block-n", type=int, default=gp.PACKED_GEMV_TUNING["down_block_n"])
    ap.add_argument("--warps", type=int, default=gp.PACKED_GEMV_TUNING["num_warps"])
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    for label, fn, consts, types, options, weights in programs(args):
        kernel = _compile_sm90(fn, consts, types, options)
        usage, sass = dump(kernel)
        regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        n, hist = tile_loop(sass)
        warps = options["num_warps"]
        print(f"{label}: registers {regs.group(1)}, stack {regs.group(2)} B, loop {n} per warp = "
              f"{n * 32 * warps / weights:.2f} lane-instructions per weight")
        print("  " + "; ".join(f"{op} {c}" for op, c in hist.most_common(args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
