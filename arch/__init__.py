"""Hardware hook sets (installed as ``edgespec.arch``): the stages the speculative session calls.

``base`` is portable (CPU, tests), ``rtx`` targets discrete GPUs, ``thor`` Jetson AGX Thor's unified memory.
:func:`select_hooks` picks one from the device (CC 11.x -> thor, other CUDA -> rtx, no CUDA -> base) unless the
``arch`` setting names one.
"""

from __future__ import annotations

from edgespec.arch.base import ArchHooks
from edgespec.arch.detect import detect_arch, select_hooks

__all__ = ["ArchHooks", "detect_arch", "select_hooks"]
