"""Compute kernels. Each op has a pure-torch reference (CPU and oracle) and, where it pays, a Triton version.

The public function of each op dispatches: Triton when the tensors are on CUDA and Triton imports, the torch
reference otherwise. Tests compare the two on fresh random inputs. See ``docs/architecture.md`` and
``docs/benchmarks.md``.
"""

from __future__ import annotations

import functools
import os


@functools.cache
def triton_available() -> bool:
    """True when Triton imports and a CUDA device is present (and EDGESPEC_NO_TRITON is not set)."""
    if os.environ.get("EDGESPEC_NO_TRITON"):
        return False
    try:
        import torch
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()
