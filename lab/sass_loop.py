"""The main loop of a kernel's SASS: the span of its largest backward branch, and the opcode of a SASS line. Shared by
``lab/attn_sass.py`` (SASS compiled off the GPU) and ``lab/ncu_source_summary.py`` (Nsight Compute's source
page)."""

from __future__ import annotations

import re
from collections.abc import Iterable

_BRANCH = re.compile(r"\bBRA (0x[0-9a-f]+)")
_EXIT = re.compile(r"(^|\s)EXIT\b")


def largest_backward_branch(instructions: Iterable[tuple[int, str]]) -> tuple[int, int] | None:
    """(target address, branch address) of the backward branch spanning the most bytes among ``instructions``
    ((address, SASS text) pairs); None when there is none.

    Spans that contain an ``EXIT`` lose to those that do not: kernels that wait on memory barriers (TMA copies,
    ``wgmma``) place the retry of each wait after the kernel's exit, and the retry branches back to the wait. The
    retry of a wait inside the loop then spans from the loop to the end of the kernel, more bytes than the loop."""
    listed = list(instructions)
    exits = [addr for addr, text in listed if _EXIT.search(text)]
    best: tuple[bool, int, int, int] | None = None             # (no exit inside, span, target, branch)
    for addr, text in listed:
        m = _BRANCH.search(text)
        target = int(m.group(1), 16) if m else addr
        if target < addr:
            key = (not any(target <= e <= addr for e in exits), addr - target, target, addr)
            best = key if best is None or key[:2] > best[:2] else best
    return None if best is None else (best[2], best[3])


def opcode(text: str) -> str:
    """The opcode of one SASS instruction's text, its predicate (``@P0``, ``@!UP1``, ``@PT``) left out; "" if blank."""
    parts = text.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""
