"""Reading a compiled kernel's SASS: the main loop (the span of its largest backward branch), opcodes, resource
usage and the instruction histogram, with the ``cuobjdump`` Triton's wheel ships. Used by
``edgespec.bench.compile_targets`` (``tools/compile_targets.py``, ``edgespec doctor --compile``) and the lab's SASS
probes (``lab/sass_loop.py`` re-exports the loop helpers)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

# "BRA 0x..", "BRA.U UP1, 0x..", "BRA.U !UP0, 0x.." (a uniform-predicated branch: tcgen05 kernels' K loops)
_BRANCH = re.compile(r"\bBRA(?:\.U)?\s+(?:!?U?P\w+,\s*)?(0x[0-9a-f]+)")
_EXIT = re.compile(r"(^|\s)EXIT\b")


def largest_backward_branch(instructions: Iterable[tuple[int, str]],
                            holding: Callable[[str], bool] | None = None) -> tuple[int, int] | None:
    """(target address, branch address) of the backward branch spanning the most bytes among ``instructions``
    ((address, SASS text) pairs), only among spans that hold an instruction whose opcode satisfies ``holding`` when
    given; None when there is none.

    Spans that contain an ``EXIT`` lose to those that do not: kernels that wait on memory barriers (TMA copies,
    ``wgmma``, ``tcgen05``) place the retry of each wait after the kernel's exit, and the retry branches back to the
    wait. The retry of a wait inside the loop (or in a first trip the compiler peeled off before it) then spans from
    there to the end of the kernel, epilogue included: more bytes than the loop."""
    listed = list(instructions)
    exits = [addr for addr, text in listed if _EXIT.search(text)]
    best: tuple[bool, int, int, int] | None = None             # (no exit inside, span, target, branch)
    for addr, text in listed:
        m = _BRANCH.search(text)
        target = int(m.group(1), 16) if m else addr
        if target < addr and (holding is None or any(target <= a <= addr and holding(opcode(t)) for a, t in listed)):
            key = (not any(target <= e <= addr for e in exits), addr - target, target, addr)
            best = key if best is None or key[:2] > best[:2] else best
    return None if best is None else (best[2], best[3])


def opcode(text: str) -> str:
    """The opcode of one SASS instruction's text, its predicate (``@P0``, ``@!UP1``, ``@PT``) left out; "" if blank."""
    parts = text.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def cuobjdump() -> Path:
    """The ``cuobjdump`` bundled with Triton's NVIDIA backend (it reads sm_90 .. sm_120 cubins)."""
    import triton
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def dump_cubin(cubin: bytes) -> tuple[str, str]:
    """(resource usage, SASS) of a cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return tuple(subprocess.run([str(cuobjdump()), flag, str(path)], capture_output=True, text=True, check=True,
                                    timeout=120).stdout for flag in ("--dump-resource-usage", "--dump-sass"))


def resource_usage(usage: str) -> dict[str, int]:
    """``registers``, ``stack``, ``static_shared`` and ``local`` bytes of the (first) kernel in a resource dump."""
    m = _USAGE.search(usage)
    if m is None:
        return {"registers": 0, "stack": 0, "static_shared": 0, "local": 0}
    return dict(zip(("registers", "stack", "static_shared", "local"), map(int, m.groups()), strict=True))


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of every instruction of a SASS dump."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in map(_INSTR.match, sass.splitlines()) if m]


def loop_body(listed: list[tuple[int, str]]) -> list[str]:
    """The instructions of the main loop; empty when the kernel has no loop. In a kernel with tensor-core MMAs, the
    largest backward-branch span that holds one (a tcgen05 kernel's epilogue loops hold none), a barrier-wait retry
    after ``EXIT`` losing to the loop as in :func:`largest_backward_branch`; elsewhere the largest backward branch."""
    span = largest_backward_branch(listed, holding=lambda op: "MMA" in op) or largest_backward_branch(listed)
    return [] if span is None else [t for a, t in listed if span[0] <= a <= span[1]]
