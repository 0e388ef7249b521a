"""Which SM a program runs on (``%smid``): the read-back that tells how many SMs a stream can really use
(``edgespec.bench.sm_limit``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def smid_kernel(ids_ptr, sink_ptr, spin):
    """Program p writes its SM's id to ``ids[p]`` after ``spin`` dependent FMAs (so the programs overlap in time and
    the scheduler spreads them over every SM it may use); the FMA result goes to ``sink`` so it is not removed."""
    pid = tl.program_id(0)
    acc = pid.to(tl.float32)
    for _ in range(0, spin):
        acc = acc * 0.999 + 1.0
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(ids_ptr + pid, sm)
    tl.store(sink_ptr + pid, acc)
