"""Building a model's modules on the meta device without running their weight initialisers.

A loader builds the module tree on the meta device and then fills every tensor from the checkpoint, so the
random initialisation ``nn.Linear`` and ``nn.Embedding`` run in their constructors is thrown away. On meta tensors
it is not even free: ``normal_`` goes through torch's Python reference implementations, whose first call imports
``torch._dynamo`` (about a second, and 40 MB of resident memory for the rest of the process on the demo's CPU
path). :func:`meta_modules` builds on the meta device with the initialisers of ``torch.nn.init`` as no-ops.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

# The initialisers nn.Linear / nn.Embedding / nn.Conv1d call from reset_parameters.
_INITS = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "xavier_uniform_",
          "xavier_normal_", "zeros_", "ones_", "constant_")


@contextmanager
def meta_modules() -> Iterator[None]:
    """``with torch.device("meta")`` and every ``torch.nn.init`` initialiser returning its tensor untouched. Not
    thread-safe (it swaps module attributes): for loaders, which build one model at a time."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    try:
        for name in _INITS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def materialize(root: nn.Module, device: torch.device | str, requires_grad: bool | None = None) -> None:
    """Allocate (uninitialised) every tensor of ``root`` still on the meta device, in place; tensors already
    allocated stay as they are (``to_empty`` on the whole model would re-allocate, and so wipe, them).
    ``requires_grad``: of the new parameters (None: as the meta ones). ``torch.empty`` of the shape, not
    ``empty_like`` / ``to_empty``: from a meta tensor those import sympy (30 MB resident for the process)."""
    for module in root.modules():
        for store in (module._parameters, module._buffers):
            for key, value in list(store.items()):
                if value is not None and value.is_meta:
                    fresh = torch.empty(value.shape, dtype=value.dtype, device=device)
                    if isinstance(value, nn.Parameter):
                        grad = value.requires_grad if requires_grad is None else requires_grad
                        fresh = nn.Parameter(fresh, requires_grad=grad)
                    store[key] = fresh
