#!/usr/bin/env python3
"""Would repacking int4 AWQ/GPTQ groups for Blackwell's FP8 block-scaled MMA beat the pair-decode tiles on Thor?
Compiles a repack candidate for sm_110a without a GPU and prints its main loop's lane-instructions per weight, to
set beside the runtime's int4 products (``tools/compile_targets.py --targets sm_110a --formats int4``).

The candidate (the only lossless FP8 layout of an int4 group): each weight stored as the e4m3 byte of ``q - z``
(an integer in -15..15: exact in e4m3), the activations as 2 MXFP8 terms (exact for bf16, as the MXFP4 product
does), one ``tl.dot_scaled`` per group of 128 into a fresh accumulator with unit E8M0 weight scales, then that
group's fp16 scale (not a power of two: it cannot ride in an E8M0 block scale) applied on the CUDA cores,
``acc += s[:, None] * part``. It reads 8 bits per weight against int4's 4 (plus the same scales)::

    python lab/int4_repack_sass.py                  # 1, 16, 32, 64 rows
    python lab/int4_repack_sass.py --rows 16 --top 12
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from edgespec.bench.compile_targets import ensure_ptxas  # noqa: E402
from edgespec.kernels.launch.sass import dump_cubin, instructions, loop_body, opcode, resource_usage  # noqa: E402

GROUP = 128
BLOCK_N = 128
TERMS = 2          # MXFP8 terms of a bf16 activation row


@triton.jit
def _int4_fp8_repack_kernel(w_ptr, s_ptr, xq_ptr, xs_ptr, y_ptr, K, stride_wn, stride_sn, stride_xq, stride_xs,
                            stride_ym, C: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """``y[c, n] = sum_g s[n, g] * sum_k W8[n, k] X_c[k]`` over groups of ``GROUP``: W8 the e4m3 bytes of q - z."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, GROUP)
    c = tl.arange(0, C)
    ks = tl.arange(0, GROUP // 32)
    unit = tl.full([BLOCK_N, GROUP // 32], 127, tl.uint8)                # E8M0 2^0: the group scale comes after
    acc = tl.zeros([BLOCK_N, C], tl.float32)
    for g in range(0, K // GROUP):
        w = tl.load(w_ptr + n[:, None] * stride_wn + (g * GROUP + k)[None, :])
        x = tl.load(xq_ptr + c[None, :] * stride_xq + (g * GROUP + k)[:, None])
        xs = tl.load(xs_ptr + c[:, None] * stride_xs + (g * (GROUP // 32) + ks)[None, :])
        part = tl.dot_scaled(w, unit, "e4m3", x, xs, "e4m3")
        s = tl.load(s_ptr + n * stride_sn + g).to(tl.float32)
        acc += part * s[:, None]
    tl.store(y_ptr + c[None, :] * stride_ym + n[:, None], acc)


def compile_candidate(rows: int, warps: int, stages: int):
    """The candidate for ``rows`` activation rows (columns = 2 terms x rows, at least 16) on sm_110a."""
    fn = _int4_fp8_repack_kernel
    names = fn.arg_names
    consts = {"C": max(16, TERMS * triton.next_power_of_2(rows)), "BLOCK_N": BLOCK_N, "GROUP": GROUP}
    types = {"w_ptr": "*fp8e4nv", "s_ptr": "*fp16", "xq_ptr": "*fp8e4nv", "xs_ptr": "*u8", "y_ptr": "*fp32"}
    signature = {a: "constexpr" if a in consts else types.get(a, "i32") for a in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
             if a not in consts and (signature[a].startswith("*") or a.startswith("stride") or a == "K")}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(a),): v for a, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 110, 32), options={"num_warps": warps, "num_stages": stages})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,32,64")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--top", type=int, default=8, help="opcodes of the loop shown")
    args = ap.parse_args(argv)
    print(f"ptxas: {ensure_ptxas()}")
    print(f"{'rows':>4} {'cols':>4} {'regs':>4} {'spill B':>7} {'loop':>5} {'instr/weight':>12}  MMA, top opcodes")
    for rows in (int(r) for r in args.rows.split(",") if r):
        kernel = compile_candidate(rows, args.warps, args.stages)
        usage, sass = dump_cubin(kernel.asm["cubin"])
        res = resource_usage(usage)
        body = loop_body(instructions(sass))
        ops = Counter(opcode(t) for t in body)
        mma = ",".join(sorted({op for op in ops if "MMA" in op})) or "-"
        per_weight = len(body) * 32 * args.warps / (BLOCK_N * GROUP)
        top = " ".join(f"{op} {n}" for op, n in ops.most_common(args.top))
        print(f"{rows:>4} {max(16, TERMS * triton.next_power_of_2(rows)):>4} {res['registers']:>4} "
              f"{res['local'] + res['stack']:>7} {len(body):>5} {per_weight:>12.2f}  {mma}; {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
