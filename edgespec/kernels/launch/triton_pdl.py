"""Programmatic dependent launch (PDL) for the chain of small kernels of a batch-1 forward.

A decode step is ~300 kernels of a few microseconds each, inside one CUDA graph. Without PDL each kernel starts
only after the previous one has fully drained, so every boundary costs a launch and a ramp-up. With PDL (SM90+:
Hopper, Blackwell, Thor) a kernel is launched while its predecessor still runs; its programs begin with
``griddepcontrol.wait``, which blocks until the predecessor has completed and its writes are visible, and then
signal that their own dependents may launch. So the scheduling of kernel N+1 overlaps the tail of kernel N, while
every read and write still happens after the predecessor is done (the wait precedes all memory access, also the
writes: an output buffer may alias memory the predecessor still reads).

Safety rule: a kernel launched with ``launch_pdl=True`` must call :func:`pdl_enter` (or :func:`pdl_wait`) first.
The wrappers pass both from one :func:`pdl_launch` value, so the two cannot disagree. Kernels launched without
PDL (torch's) serialise as usual; the wait is transitive because each PDL kernel finishes only after its own
wait returned.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # Triton >= 3.2 exposes grid dependency control; older versions run without PDL.
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _HAS_GDC = False


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a short PDL-launched kernel: wait for the predecessor, then let the successor launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """First statement of a long PDL-launched kernel (a GEMV, attention, the GDN recurrence): wait only. Its
    successor is released by :func:`pdl_release` after the main loop: released at the start, the successor's
    programs would sit on the SMs for the whole kernel, taking registers and shared memory from its own."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the successor launch (a long kernel's main loop is done; only its stores remain)."""
    if PDL:
        gdc_launch_dependents()


def pdl_launch(device) -> dict:
    """Launch options for a kernel on ``device``: ``{"launch_pdl": True}`` where PDL is on (see
    :func:`edgespec.kernels.pdl_enabled`), else empty. Use with ``PDL=bool(opts)``."""
    from edgespec.kernels import pdl_enabled
    return {"launch_pdl": True} if _HAS_GDC and pdl_enabled(device) else {}
