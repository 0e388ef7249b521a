"""What a checkpoint's quantization is, as edgespec loads it: :class:`QuantSpec` for the checkpoint and, for formats
chosen module by module, :class:`LayerScheme` for one layer. Read from the config by
:mod:`edgespec.loading.quant_config` (and its per-format parsers), used by :mod:`edgespec.loading.quantized`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LayerScheme:
    """How one linear layer of a per-module checkpoint (compressed-tensors, ModelOpt mixed precision) is stored.

    ``fmt``: the :mod:`edgespec.weights` format it loads into (``int4``, ``fp8_row``, ``fp8_block``, ``nvfp4``);
    ``layout``: whose tensor names it has (``ct`` compressed-tensors, ``modelopt``); ``group_size``: int4 inputs
    per scale (the whole row for per-channel); ``symmetric``: int4 without a stored zero point; ``block``: the
    block of ``fp8_block``; ``strategy``: ``tensor`` or ``channel`` for ``fp8_row`` (the scale's shape);
    ``label``: the config entry it came from, for messages.
    """

    fmt: str
    layout: str
    group_size: int = 0
    symmetric: bool = True
    block: tuple[int, int] = (128, 128)
    strategy: str = ""
    label: str = ""


@dataclass
class QuantSpec:
    """A checkpoint's quantization as edgespec loads it.

    ``method``: ``fp8_block``, ``nvfp4``, ``awq``, ``gptq``, ``compressed-tensors`` or ``modelopt``. ``excluded``:
    module name patterns the config lists as left unquantized (fnmatch globs or plain prefixes; informational:
    each module loads as its tensors are). ``schemes``: for per-module formats, the :class:`LayerScheme` of a
    module name (None: the config leaves it unquantized). ``kv_cache``: the KV-cache format the config asks for
    (``fp8``) or None. ``notes``: what is served differently from the checkpoint's declared scheme (activation
    quantization dropped: edgespec is weight-only), said once at load.
    """

    method: str
    source: str
    block: tuple[int, int] = (128, 128)
    group_size: int = 128
    zeros_minus_one: bool = False
    excluded: list[str] = field(default_factory=list)
    schemes: Callable[[str], LayerScheme | None] | None = None
    kv_cache: str | None = None
    notes: list[str] = field(default_factory=list)

    def scheme_for(self, module: str) -> LayerScheme | None:
        """The :class:`LayerScheme` of ``module`` (per-module formats only; None: left unquantized)."""
        return self.schemes(module) if self.schemes is not None else None

    def is_excluded(self, module: str) -> bool:
        return any(module == p or module.startswith(p + ".") or fnmatch.fnmatch(module, p) for p in self.excluded)
