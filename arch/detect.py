"""Pick the hook set for a device."""

from __future__ import annotations

import torch

from edgespec.arch.base import ArchHooks


def detect_arch(device: torch.device) -> str:
    """``thor`` for compute capability 11.x (sm_110; sm_101 on CUDA 12), ``rtx`` for other CUDA, else ``base``."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "base"
    major, minor = torch.cuda.get_device_capability(device)
    if major == 11 or (major, minor) == (10, 1):
        return "thor"
    return "rtx"


def hooks_class(name: str) -> type[ArchHooks]:
    """The hook set class ``name`` names (``base``, ``rtx``, ``thor``)."""
    from edgespec.arch.rtx import RtxHooks
    from edgespec.arch.thor import ThorHooks

    classes = {"base": ArchHooks, "rtx": RtxHooks, "thor": ThorHooks}
    if name not in classes:
        from edgespec.errors import ConfigError
        raise ConfigError(f"arch {name!r} is not one of {', '.join(classes)}")
    return classes[name]


def select_hooks(name: str, device: torch.device) -> ArchHooks:
    """Instantiate the hook set ``name`` (``auto`` detects it)."""
    return hooks_class(detect_arch(device) if name == "auto" else name)()
