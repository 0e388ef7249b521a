#!/usr/bin/env python3
"""Compile the split attention kernel for sm_90 without a GPU and count what its key loop executes.

Triton compiles for any target it is told (``GPUTarget("cuda", 90, 32)``) and ships ``ptxas`` and ``cuobjdump``, so
registers, spills, shared memory and the SASS of the main loop can be read on a CPU machine. The loop is the largest
backward branch of the kernel; its opcode counts are per warp and per key tile. The FP8 V byte gathers were found
this way (``LDS.U8``: 128 per tile with a key-major V, none with the key-blocked V).

Usage (from the repository root; FP8 decode launch of the 27B heads unless told otherwise)::

    python lab/attn_sass.py                         # the default FP8 decode program
    python lab/attn_sass.py --v-block 0             # the key-major V layout
    python lab/attn_sass.py --kv bf16 --block-n 64 --warps 4
    python lab/attn_sass.py --block-m 128 --warps 8 --opaque 1     # the FP8 verify program
    python lab/attn_sass.py --gluon                 # the Gluon FP8 decode program (its default launch)
    python lab/attn_sass.py --gluon --warps 2 --block-n 16          # Gluon: 2 warps on 16 keys each

Pointers and strides are marked 16-divisible, as a real launch specialises them; without that hint every load
compiles to single bytes.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sass_loop import largest_backward_branch, opcode  # noqa: E402

from edgespec.kernels.attention import triton_attention as ta  # noqa: E402

_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


def _compile_sm90(fn, consts: dict, types: dict, options: dict, source=ASTSource) -> triton.compiler.CompiledKernel:
    """Compile ``fn`` for sm_90 with these constexprs and pointer/scalar ``types`` (other arguments i32), pointers and
    strides marked 16-divisible as a launch specialises them."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and (signature[n].startswith("*") or n.startswith("stride"))}
    src = source(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()},
                 attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_split_kernel(args: argparse.Namespace) -> triton.compiler.CompiledKernel:
    """The kernel as ``cached_attention_triton`` would launch it with these constants."""
    fp8 = args.kv == "fp8"
    kv_ptr = "*fp8e4nv" if fp8 else "*bf16"
    types = {"q_ptr": "*bf16", "k_ptr": kv_ptr, "v_ptr": kv_ptr, "ks_ptr": "*fp32" if fp8 else kv_ptr,
             "vs_ptr": "*fp32" if fp8 else kv_ptr, "start_ptr": "*bf16", "o_part_ptr": "*fp32",
             "lse_part_ptr": "*fp32", "tree_ptr": "*i64", "qk_scale": "fp32"}
    consts = dict(GROUP=args.group, HEAD_DIM=args.head_dim, BLOCK_M=args.block_m, BLOCK_N=args.block_n,
                  IS_FP8=fp8, START_FROM_PTR=False, DOT_IEEE=False, V_SCALE=3 if fp8 else 0, FP16_DOT=fp8,
                  OPAQUE_CVT=args.opaque if fp8 else 0, PDL=True, V_BLOCK=args.v_block if fp8 else 0,
                  TREE=False)
    options = {"num_warps": args.warps, "num_stages": args.stages}
    if args.maxnreg:
        options["maxnreg"] = args.maxnreg
    return _compile_sm90(ta._attn_split_kernel, consts, types, options)


def compile_gluon_kernel(args: argparse.Namespace) -> triton.compiler.CompiledKernel:
    """The Gluon decode program (``edgespec.kernels.attention.gluon_attention_fp8``) as ``gluon_decode_split`` launches
    it;
    ``--warps``/``--block-n``/``--stages`` are its ``num_warps``/``BLOCK_W``/``num_stages``."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from edgespec.kernels.attention import gluon_attention_fp8 as ga
    consts = dict(GROUP=args.group, HEAD_DIM=args.head_dim, BLOCK_W=args.block_n, STAGES=args.stages, W=args.warps,
                  START_FROM_PTR=False, PDL=True, TRACE=False, BALANCE=bool(ga.GLUON_DECODE["BALANCE"]))
    types = {"q_ptr": "*bf16", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "ks_ptr": "*fp32", "vs_ptr": "*fp32",
             "start_ptr": "*i32", "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "trace_ptr": "*i64",
             "qk_scale": "fp32"}
    options = {"num_warps": args.warps}
    if args.maxnreg:
        options["maxnreg"] = args.maxnreg
    return _compile_sm90(ga._fp8_decode_kernel, consts, types, options, source=GluonASTSource)


def compile_kernel(args: argparse.Namespace) -> triton.compiler.CompiledKernel:
    """The program ``args`` (from :func:`parse_args`) names: the Gluon decode program or the Triton split kernel."""
    return compile_gluon_kernel(args) if args.gluon else compile_split_kernel(args)


def dump(kernel: triton.compiler.CompiledKernel) -> tuple[str, str]:
    """(resource usage, SASS) of a compiled kernel, read with the ``cuobjdump`` that Triton ships."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "attn.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return tuple(subprocess.run([cuobjdump, flag, cubin], capture_output=True, text=True, check=True).stdout
                     for flag in ("--dump-resource-usage", "--dump-sass"))


def loop_histogram(sass: str) -> tuple[int, collections.Counter]:
    """Instruction count and opcode histogram of the largest loop (largest backward branch) of ``sass``."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in map(_INSTR.match, sass.splitlines()) if m]
    lo, hi = largest_backward_branch(ins) or (0, -1)
    body = [t for a, t in ins if lo <= a <= hi]
    return len(body), collections.Counter(opcode(t) for t in body)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--gluon`` without ``--warps``/``--block-n``/``--stages`` takes the Gluon program's own
    launch (``GLUON_DECODE``) for them."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--group", type=int, default=6, help="query heads per KV head (27B: 24 / 4)")
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--block-m", type=int, default=16)
    ap.add_argument("--block-n", type=int, default=None)
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--opaque", type=int, default=ta.FP8_LAUNCH["decode"]["OPAQUE_CVT"])
    ap.add_argument("--v-block", type=int, default=32, help="FP8 V layout: keys per block (0: key-major)")
    ap.add_argument("--maxnreg", type=int, default=0)
    ap.add_argument("--top", type=int, default=16, help="opcodes to print")
    ap.add_argument("--gluon", action="store_true",
                    help="the Gluon decode program (defaults: its launch, GLUON_DECODE) instead of the Triton one")
    args = ap.parse_args(argv)
    if args.gluon:
        from edgespec.kernels.attention.gluon_attention_fp8 import GLUON_DECODE as launch
        keys = {"block_n": "BLOCK_W", "warps": "num_warps", "stages": "num_stages"}
    else:
        launch = ta.FP8_LAUNCH["decode"]
        keys = {"block_n": "BLOCK_N", "warps": "num_warps", "stages": "num_stages"}
    for name, key in keys.items():
        if getattr(args, name) is None:
            setattr(args, name, launch[key])
    return args


def loop_report(kernel: triton.compiler.CompiledKernel, top: int) -> tuple[str, int, str]:
    """(registers / stack / shared memory, the main loop's instructions per warp, its top opcodes) of a compiled
    kernel, as the lab's SASS probes print them."""
    usage, sass = dump(kernel)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    n, hist = loop_histogram(sass)
    resources = f"registers {regs.group(1)}, stack {regs.group(2)} B, shared {kernel.metadata.shared} B"
    return resources, n, "  " + "; ".join(f"{op} {c}" for op, c in hist.most_common(top))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    resources, n, opcodes = loop_report(compile_kernel(args), args.top)
    print(f"{resources}, loop {n} instructions per warp per {args.block_n}-key tile")
    print(opcodes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
