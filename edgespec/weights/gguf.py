"""GGUF block formats Q4_0, Q4_1 and Q8_0 served in their own bytes on the CPU.

Layout (ours, documented here as the contract asks): one buffer ``blocks`` uint8 ``[out, in/32 * block_bytes]``
holding the file's blocks unchanged, row after row (GGUF stores a matrix as rows of consecutive blocks):

* ``gguf_q4_0`` (18 bytes): fp16 ``d``, 16 bytes of nibbles; ``w = d * (q - 8)``
* ``gguf_q4_1`` (20 bytes): fp16 ``d``, fp16 ``m``, 16 bytes of nibbles; ``w = d * q + m``
* ``gguf_q8_0`` (34 bytes): fp16 ``d``, 32 int8; ``w = d * q``

Byte ``j`` of a nibble field holds weight ``j`` (low nibble) and weight ``j + 16`` (high nibble).

The product (:meth:`GGUFBlockWeight.matmul`) is the compiled kernel of ``gguf_cpu.c`` (see
``edgespec.kernels.cpu.gguf_native``): fp32 activations against the blocks as stored, scales widened exactly from
fp16, fp32 sums. Why that and not torch's packed CPU kernels:
``_weight_int4pack_mm_for_cpu`` is fast only with bf16 activations and bf16 scale/zero pairs,
which rounds Q4_1's fp16 ``d`` and ``m`` (and every activation) to 8 bits of mantissa, and it has no Q8_0 form;
``_weight_int8pack_mm`` has one scale per output row, while Q8_0 has one per 32 weights. The compiled kernel
keeps the file's numbers, covers all three formats with one code path, and every output row is computed by the
same fp32 operations whatever the number of rows, so speculative verification equals plain decoding bit for
bit. :meth:`PackedWeight.matmul_ref` (dequantize a tile of rows to fp32, then matmul) stays the oracle and the
fallback where the kernel cannot be built.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from edgespec.kernels.cpu import gguf_native
from edgespec.weights.base import PackedWeight, register_format

BLOCK = 32


class GGUFBlockWeight(PackedWeight):
    """A ``[out, in]`` weight stored as GGUF blocks of 32 (see the module doc for the layout)."""

    ggml_type: ClassVar[int] = -1
    block_bytes: ClassVar[int] = 0
    block: ClassVar[int] = BLOCK        # weights per block (the K-quants' super-blocks hold 256)

    def __init__(self, blocks: torch.Tensor, out_features: int, in_features: int,
                 compute_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(out_features, in_features, compute_dtype)
        if in_features % self.block:
            raise ValueError(f"{self.format}: in_features {in_features} is not a multiple of {self.block}")
        want = (out_features, in_features // self.block * self.block_bytes)
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != want:
            raise ValueError(f"{self.format}: blocks must be uint8 {list(want)}, got {blocks.dtype} "
                             f"{list(blocks.shape)}")
        self.register_buffer("blocks", blocks.contiguous())

    # -- decoding (the oracle) ----------------------------------------------------------------------------------
    @staticmethod
    def _half(field: torch.Tensor) -> torch.Tensor:
        """``[..., 2]`` uint8 little-endian fp16 bytes -> ``[..., 1]`` float32."""
        return field.contiguous().view(torch.float16).float()

    @staticmethod
    def _nibbles(qs: torch.Tensor) -> torch.Tensor:
        """``[..., 16]`` uint8 -> ``[..., 32]`` values 0..15 (low nibbles are weights 0..15)."""
        return torch.cat([qs & 0x0F, qs >> 4], dim=-1)

    def _decode(self, blocks: torch.Tensor) -> torch.Tensor:
        """``[rows, nb, block_bytes]`` -> ``[rows, nb, block]`` float32 weights."""
        raise NotImplementedError

    def _dense(self, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = blocks.shape[0]
        w = self._decode(blocks.reshape(rows, -1, self.block_bytes))
        return w.reshape(rows, self.in_features).to(dtype)

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self._dense(self.blocks[start:stop], dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: only the rows asked for are decoded (on the CPU by the compiled decoder, the same
        values in one call)."""
        flat = index.reshape(-1)
        if (flat.device.type == "cpu" and self.compute_dtype == torch.float32 and self.blocks.device.type == "cpu"
                and gguf_native.library() is not None):
            flat = flat.to(torch.int64).contiguous()
            out = torch.empty(flat.shape[0], self.in_features)
            if gguf_native.library().gguf_rows(self.ggml_type, self.blocks.data_ptr(), self.out_features,
                                               self.in_features, flat.data_ptr(), flat.shape[0], out.data_ptr()) != 0:
                raise IndexError(f"{self.format} embedding: a token id outside 0 .. {self.out_features - 1}")
        else:
            out = self._dense(self.blocks[flat], self.compute_dtype)
        return out.reshape(*index.shape, self.in_features)

    @classmethod
    def cat(cls, parts: list[PackedWeight]) -> PackedWeight | None:
        # Each output row is its own run of blocks: stacking rows is stacking the bytes. Parts that already lie
        # one after the other in one storage (a GGUF file's ffn_gate then ffn_up, mapped) are stacked as they are.
        if any(type(p) is not cls or p.in_features != parts[0].in_features for p in parts):
            return None
        blocks = _adjacent_view([p.blocks for p in parts])  # type: ignore[attr-defined]
        if blocks is None:
            blocks = torch.cat([p.blocks for p in parts])  # type: ignore[attr-defined]
        return cls(blocks, blocks.shape[0], parts[0].in_features, parts[0].compute_dtype)

    # -- product ------------------------------------------------------------------------------------------------
    def fast_product(self, x: torch.Tensor) -> bool:
        """True when :meth:`matmul` takes the compiled kernel for ``x``."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and self.blocks.device.type == "cpu"
                and not torch.is_grad_enabled() and gguf_native.library() is not None)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(self, x, bias)
        if not self.fast_product(x):
            return self.matmul_ref(x, bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        rc = gguf_native.library().gguf_matmul(self.ggml_type, self.blocks.data_ptr(), self.out_features,
                                               self.in_features, x2.data_ptr(), x2.shape[0], out.data_ptr(),
                                               gguf_native.threads())
        if rc != 0:
            raise ValueError(f"{self.format}: no compiled product for {self.in_features} inputs (code {rc})")
        if bias is not None:
            out += bias
        return out.reshape(*lead, self.out_features)


def _adjacent_view(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The rows of ``parts`` (contiguous 2-D tensors of one width) as one view of their common storage when each
    part starts where the one before it ends there, else None (the caller copies)."""
    first = parts[0]
    storage = first.untyped_storage()
    offset = first.storage_offset()
    for part in parts:
        if (not part.is_contiguous() or part.dim() != 2 or part.shape[1] != first.shape[1]
                or part.dtype != first.dtype or part.device != first.device
                or part.untyped_storage().data_ptr() != storage.data_ptr() or part.storage_offset() != offset):
            return None
        offset += part.numel()
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1), first.storage_offset())


@register_format
class Q4_0Weight(GGUFBlockWeight):
    """GGUF Q4_0: ``w = d * (q - 8)`` per block of 32."""

    format = "gguf_q4_0"
    ggml_type = 2
    block_bytes = 18

    def _decode(self, blocks: torch.Tensor) -> torch.Tensor:
        q = self._nibbles(blocks[..., 2:18]).float() - 8.0
        return self._half(blocks[..., 0:2]) * q


@register_format
class Q4_1Weight(GGUFBlockWeight):
    """GGUF Q4_1: ``w = d * q + m`` per block of 32."""

    format = "gguf_q4_1"
    ggml_type = 3
    block_bytes = 20

    def _decode(self, blocks: torch.Tensor) -> torch.Tensor:
        q = self._nibbles(blocks[..., 4:20]).float()
        return self._half(blocks[..., 0:2]) * q + self._half(blocks[..., 2:4])


@register_format
class Q8_0Weight(GGUFBlockWeight):
    """GGUF Q8_0: ``w = d * q`` per block of 32 (int8 ``q``)."""

    format = "gguf_q8_0"
    ggml_type = 8
    block_bytes = 34

    def _decode(self, blocks: torch.Tensor) -> torch.Tensor:
        q = blocks[..., 2:34].contiguous().view(torch.int8).float()
        return self._half(blocks[..., 0:2]) * q


# ggml type id -> format class: what the GGUF loader packs.
GGML_FORMATS: dict[int, type[GGUFBlockWeight]] = {c.ggml_type: c for c in (Q4_0Weight, Q4_1Weight, Q8_0Weight)}
