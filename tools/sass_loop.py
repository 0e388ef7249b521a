"""The main loop of a kernel's SASS: the span of its largest backward branch. Shared by ``tools/attn_sass.py``
(SASS compiled off the GPU) and ``tools/ncu_source_summary.py`` (Nsight Compute's source page)."""

from __future__ import annotations

import re
from collections.abc import Iterable

_BRANCH = re.compile(r"\bBRA (0x[0-9a-f]+)")


def largest_backward_branch(instructions: Iterable[tuple[int, str]]) -> tuple[int, int] | None:
    """(target address, branch address) of the backward branch spanning the most bytes among ``instructions``
    ((address, SASS text) pairs); None when there is none."""
    best: tuple[int, int] | None = None
    for addr, text in instructions:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < addr and (best is None or addr - int(m.group(1), 16) > best[1] - best[0]):
            best = (int(m.group(1), 16), addr)
    return best
