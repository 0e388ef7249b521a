"""Kernel options: the tuning and A/B switches of the compute kernels, typed, checked, installed once per process.

They are developer settings (``gluon`` in YAML, ``EDGESPEC_GLUON`` in the environment, ``--gluon`` on the command
line; ``edgespec dev settings`` lists them), read only at the edge: :func:`edgespec.plan.build_plan` puts them in
the :class:`~edgespec.plan.RuntimePlan`, and the engine that owns the kernels installs its plan's options
(:func:`install`) before it loads or runs anything. Kernels that take an ``options`` argument get them passed;
the ones deep in a forward, with no argument to carry them, read :func:`active`.

The install is one per process, not per call: the compiled CPU library's instruction set and thread pinning, and
whether Triton runs at all, are process state, and a captured CUDA graph must replay the programs its eager path
chose. So a second install with other values is refused by name, and a process that runs kernels without an
engine (a test, a kernel benchmark) runs the defaults (or installs its own options at its edge); nothing here
reads the environment.
"""

from __future__ import annotations

import threading
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



KERNEL_SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(KernelOptions))

_installed: KernelOptions | None = None
_lock = threading.Lock()


def install(options: KernelOptions) -> KernelOptions:
    """Make ``options`` the process's kernel options (the same again: fine). Raises ConfigError when other options
    are in force already: kernels compiled, chosen or captured under them would disagree with the new ones."""
    global _installed
    with _lock:
        if _installed is None:
            _installed = options
        elif _installed != options:
            changed = ", ".join(f"{n}={getattr(options, n)!r} (in force: {getattr(_installed, n)!r})"
                                for n in KERNEL_SETTINGS if getattr(options, n) != getattr(_installed, n))
            raise ConfigError(f"kernel options are installed once per process; this one already runs with other "
                              f"values: {changed}")
        return _installed


def active() -> KernelOptions:
    """The process's kernel options: those installed, else the defaults (installed now, so a later engine asking
    for others is refused rather than mixing kernels chosen under both)."""
    return _installed if _installed is not None else install(KernelOptions())
