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
