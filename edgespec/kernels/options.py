"""Kernel options: the tuning and A/B switches of the compute kernels, typed, checked and fixed once per process.

They are settings like any other (``gluon`` in YAML, ``EDGESPEC_GLUON`` in the environment, ``--gluon`` on the
command line; ``docs/configuration.md``). ``Engine.from_settings`` puts them in its runtime plan and fixes them
before loading; a process that runs kernels without an engine (a test, a kernel benchmark) gets them from its
``EDGESPEC_*`` environment at the first kernel that asks. Kernels deep in a forward have no argument to carry
them, so :func:`active` is the one place they are read; once fixed they never change (:func:`fix` refuses
other values), so a captured CUDA graph and the eager path it stands for run the same programs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from edgespec.errors import ConfigError

# A tree verify's conv and GDN on CUDA (edgespec.kernels.verify.tree): both torch references, the Triton conv only, or
# both Triton kernels.
TREE_KERNELS = ("reference", "conv", "triton")
# Instruction sets of the compiled CPU kernels (edgespec.kernels.cpu.gguf_native): auto picks the best this CPU runs.
GGUF_ISAS = ("auto", "avx512", "avx2", "neon", "scalar")


@dataclass(frozen=True)
class KernelOptions:
    """Switches of the kernels; each field is the setting of the same name."""

    no_triton: bool = False            # torch reference paths even on CUDA
    gluon: bool = True                 # the Gluon FP8 decode attention where it pays (False: the Triton program)
    pdl: bool = True                   # programmatic dependent launch of the Triton kernels on SM90+
    skinny: str = "all"                # 2-16-row products: all on the skinny GEMM, or "wide" ones only
    gdn_block_v: int | None = None     # GDN recurrence value tile (None: the tuned choice)
    gdn_warps: int | None = None       # GDN recurrence warps per program (None: the tuned choice)
    draft_tree_kernels: str = "reference"    # a tree verify's conv / GDN on CUDA: "reference", "conv" or "triton"
    gguf_native: bool = True           # the compiled GGUF CPU products (False: torch reference)
    gguf_threads: int | None = None    # threads of one GGUF CPU product (None: every core this process may use)
    gguf_isa: str = "auto"             # instruction set of the compiled CPU kernels (auto: the best this CPU runs)
    gguf_pin: bool = True              # pin the compiled CPU kernels' threads one per core

    def __post_init__(self) -> None:
        if self.skinny not in ("all", "wide"):
            raise ConfigError(f"skinny {self.skinny!r}: give 'all' or 'wide'")
        if self.draft_tree_kernels not in TREE_KERNELS:
            raise ConfigError(f"draft_tree_kernels {self.draft_tree_kernels!r}: give one of {', '.join(TREE_KERNELS)}")
        tile = self.gdn_block_v
        if tile is not None and (tile < 4 or tile & (tile - 1)):
            raise ConfigError(f"gdn_block_v {tile}: give a power of two >= 4 (or leave it unset)")
        if self.gdn_warps is not None and self.gdn_warps not in (1, 2, 4, 8):
            raise ConfigError(f"gdn_warps {self.gdn_warps}: give 1, 2, 4 or 8 (or leave it unset)")
        if self.gguf_isa not in GGUF_ISAS:
            raise ConfigError(f"gguf_isa {self.gguf_isa!r}: give one of {', '.join(GGUF_ISAS)}")
        if self.gguf_threads is not None and self.gguf_threads < 1:
            raise ConfigError(f"gguf_threads {self.gguf_threads}: give 1 or more (or leave it unset)")

    @classmethod
    def from_settings(cls, settings: Any) -> KernelOptions:
        """The kernel options of a ``Settings`` (its fields of the same names)."""
        return cls(**{name: getattr(settings, name) for name in KERNEL_SETTINGS})

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> KernelOptions:
        """The kernel options ``EDGESPEC_<NAME>`` variables set (others at their defaults), checked like settings."""
        from edgespec.config import ENV_PREFIX, read_env

        wanted = {ENV_PREFIX + name.upper() for name in KERNEL_SETTINGS}
        return cls(**read_env({k: v for k, v in environ.items() if k in wanted}))


KERNEL_SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(KernelOptions))

_fixed: KernelOptions | None = None
_lock = threading.Lock()


def fix(options: KernelOptions) -> KernelOptions:
    """Make ``options`` the process's kernel options (again: fine). Raises ConfigError when other options were
    fixed already: kernels already compiled, chosen or captured under them would disagree with the new ones."""
    global _fixed
    with _lock:
        if _fixed is None:
            _fixed = options
        elif _fixed != options:
            changed = ", ".join(f"{n}={getattr(options, n)!r} (fixed: {getattr(_fixed, n)!r})"
                                for n in KERNEL_SETTINGS if getattr(options, n) != getattr(_fixed, n))
            raise ConfigError(f"kernel options are fixed once per process; this one already runs with other "
                              f"values: {changed}")
        return _fixed


def active() -> KernelOptions:
    """The process's kernel options: those fixed, else (fixed now) those of the ``EDGESPEC_*`` environment."""
    return _fixed if _fixed is not None else fix(KernelOptions.from_environ(os.environ))
