"""The contract every packed weight format implements, and the module that holds one in a model.

A model's linear layers are :class:`edgespec.models.layers.Linear` (a plain ``nn.Linear``: dense weight, the
bf16/fp16/fp32 path). A layer loaded from a quantized checkpoint is replaced by a :class:`PackedLinear` whose
``packed`` attribute is a :class:`PackedWeight` subclass of the checkpoint's format. Everything that multiplies
by a weight goes through :func:`edgespec.kernels.quant.linear.linear`, which hands a :class:`PackedWeight` to its own
:meth:`PackedWeight.matmul`; callers never ask which format a layer has.

Rules every format follows:

* The tensors are registered as buffers under the checkpoint's own key suffixes (``qweight``, ``scales``,
  ``weight_scale_inv`` ...), so ``state_dict()`` round-trips to the public layout and loading streams each
  tensor straight into its buffer.
* Nothing is widened at load time: :meth:`PackedWeight.matmul_ref` dequantizes ``tile_rows`` output rows at a
  time inside the product (bounded extra memory), and :meth:`PackedWeight.dequantize` (whole matrix) is for
  tests and conversion only.
* ``compute_dtype`` is the activation dtype of the model (bf16 on GPU, fp32 on CPU): products return it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

# Output rows dequantized per step of the reference product: 4096 rows x 8192 inputs x 4 bytes = 128 MiB at most
# in fp32, so a reference step never holds a second copy of a large matrix.
REF_TILE_ELEMENTS = 1 << 25

# Up to this many rows (decode and verify) the reference product runs row by row (see matmul_ref).
ROW_EXACT_MAX = 32

_FORMATS: dict[str, type[PackedWeight]] = {}


def register_format(cls: type[PackedWeight]) -> type[PackedWeight]:
    """Class decorator: make a format findable by its ``format`` name (:func:`weight_format`)."""
    _FORMATS[cls.format] = cls
    return cls


def known_format(name: str) -> bool:
    """True when ``name`` is a registered packed format (:func:`weight_format` finds it)."""
    return name in _FORMATS


def weight_format(name: str) -> type[PackedWeight]:
    """The :class:`PackedWeight` subclass registered as ``name``; a named error listing the known ones."""
    from edgespec.errors import UnsupportedModelError
    try:
        return _FORMATS[name]
    except KeyError:
        raise UnsupportedModelError(f"weight format {name!r} is not supported; supported: "
                                    + ", ".join(sorted(_FORMATS))) from None


class PackedWeight(nn.Module):
    """A ``[out_features, in_features]`` weight stored in a packed format.

    Subclasses set ``format`` (registry name), register their tensors as buffers, and implement
    :meth:`dequantize_rows`. They may override :meth:`matmul` with a fast path (a Triton kernel on CUDA, a packed
    CPU kernel) and must keep :meth:`matmul_ref` as the oracle it is tested against.
    """

    format: ClassVar[str] = ""

    def __init__(self, out_features: int, in_features: int, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features = out_features
        self.in_features = in_features
        self.compute_dtype = compute_dtype
        # A fast product chosen for this weight's device (see edgespec.arch hooks); None: the reference.
        self.kernel: Callable[[PackedWeight, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None

    # -- what every format implements ---------------------------------------------------------------------------
    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``start:stop`` of the weight as a dense ``[stop - start, in_features]`` tensor of ``dtype``."""
        raise NotImplementedError

    @classmethod
    def cat(cls, parts: list[PackedWeight]) -> PackedWeight | None:
        """One weight whose rows are ``parts`` stacked (merged q/k/v, gate/up), or None when the format's
        blocks cannot be split at the part boundaries (the parts then stay separate layers)."""
        return None

    # -- shared behaviour ---------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype the products take and return (``compute_dtype``): code that casts its input to
        ``weight.dtype`` works for packed and dense weights alike."""
        return self.compute_dtype

    @property
    def nbytes(self) -> int:
        """Bytes this weight occupies (and a product reads), scales included."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole dense matrix (tests, conversion). Never called on the serving path."""
        return self.dequantize_rows(0, self.out_features, dtype or self.compute_dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Dense rows at ``index [T]`` (an embedding lookup from a packed table): ``[T, in_features]``."""
        flat = index.reshape(-1).tolist()
        out = torch.stack([self.dequantize_rows(i, i + 1, self.compute_dtype)[0] for i in flat])
        return out.reshape(*index.shape, self.in_features)

    def matmul_ref(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The torch reference product ``x [..., in] @ W^T (+ bias)``, dequantizing a tile of rows at a time."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        out = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        tile = max(1, REF_TILE_ELEMENTS // max(1, self.in_features))
        rows = x2.shape[0]
        for s in range(0, self.out_features, tile):
            e = min(self.out_features, s + tile)
            w = self.dequantize_rows(s, e, x.dtype).t()
            if rows <= ROW_EXACT_MAX:
                # One product per row: a verify row then rounds exactly like the plain decode step of the same
                # token (a multi-row GEMM may sum in another order), so greedy speculative output equals plain.
                for r in range(rows):
                    torch.matmul(x2[r:r + 1], w, out=out[r:r + 1, s:e])
            else:
                torch.matmul(x2, w, out=out[:, s:e])
        if bias is not None:
            out += bias
        return out.reshape(*lead, self.out_features)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T (+ bias)`` with the fast kernel when one was chosen, the reference otherwise."""
        if self.kernel is not None:
            return self.kernel(self, x, bias)
        return self.matmul_ref(x, bias)

    def extra_repr(self) -> str:
        return f"{self.format}, out={self.out_features}, in={self.in_features}, bytes={self.nbytes}"


class PackedLinear(nn.Module):
    """A linear layer whose weight is a :class:`PackedWeight` (same call as :class:`edgespec.models.layers.Linear`).

    ``weight`` is the packed weight itself, so code that passes ``layer.weight`` to
    :func:`edgespec.kernels.quant.linear.linear` works for both kinds of layer.
    """

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = packed
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.in_features = packed.in_features
        self.out_features = packed.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.matmul(x, self.bias)


class PackedEmbedding(nn.Module):
    """A token embedding whose table is a :class:`PackedWeight` (rows decoded on lookup): a GGUF model's table, or
    a tied head quantized by ``lm_head_weights``."""

    def __init__(self, packed: PackedWeight) -> None:
        super().__init__()
        self.weight = packed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(tokens)


def is_packed(weight: object) -> bool:
    """True for a :class:`PackedWeight` (the dispatch test of :func:`edgespec.kernels.quant.linear.linear`)."""
    return isinstance(weight, PackedWeight)
