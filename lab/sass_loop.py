"""The main loop of a kernel's SASS and the opcode of a SASS line, for the lab's probes (``lab/attn_sass.py``,
``lab/ncu_source_summary.py``, ``lab/moe_gemv_sass.py``): the package's own helpers
(``edgespec.kernels.launch.sass``), which ``tools/compile_targets.py`` uses too."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.kernels.launch.sass import _BRANCH, _EXIT, largest_backward_branch, opcode  # noqa: E402

__all__ = ["_BRANCH", "_EXIT", "largest_backward_branch", "opcode"]
