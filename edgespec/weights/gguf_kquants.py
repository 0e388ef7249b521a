"""GGUF K-quants Q4_K, Q5_K and Q6_K served in their own bytes (llama.cpp's Q4_K_M files mix Q4_K and Q6_K).

Same contract as :mod:`edgespec.weights.gguf` (one ``blocks`` buffer uint8 ``[out, in/256 * block_bytes]``,
the file's super-blocks unchanged, row after row), with super-blocks of 256 weights. Layouts (ggml's
``block_q4_K`` / ``block_q5_K`` / ``block_q6_K``, little-endian):

* ``gguf_q4_k`` (144 bytes): fp16 ``d``, fp16 ``dmin``, 12 bytes of 6-bit scales and mins for 8 sub-blocks of
  32, 128 bytes of nibbles; sub-block ``2c`` is the low and ``2c + 1`` the high nibbles of bytes ``32c..32c+31``.
  ``w = d * sc * q - dmin * m``.
* ``gguf_q5_k`` (176 bytes): as Q4_K, then 32 bytes ``qh`` before the nibbles: bit ``k`` of ``qh[l]`` is the
  fifth bit of weight ``l`` of sub-block ``k``. ``w = d * sc * (q + 16 h) - dmin * m``.
* ``gguf_q6_k`` (210 bytes): 128 bytes ``ql`` (low 4 bits), 64 bytes ``qh`` (high 2 bits), 16 int8 scales (one
  per 16 weights), fp16 ``d`` last; each half of 128 weights takes 64 ``ql`` and 32 ``qh`` bytes: weight ``p``
  of a half is nibble ``p // 64`` of ``ql[p % 64]`` with bits ``2 (p // 32)`` of ``qh[p % 32]`` above.
  ``w = d * sc * (q - 32)``.

The 6-bit scale packing of Q4_K/Q5_K: sub-blocks 0..3 take the low 6 bits of bytes 0..3 (scales) and 4..7
(mins); sub-blocks 4..7 take the nibbles of bytes 8..11 and, as bits 4..5, the top 2 bits of bytes 0..7.

On the CPU (fp32 activations) the product is the compiled one of ``gguf_cpu.c``: each super-block decoded to 256
fp32 weights with the reference's operations, bit for bit, then summed against the activations; each output row
is computed the same way whatever the number of rows (speculative == plain). On a CUDA GPU the arch hooks put
these weights on the Triton products of :mod:`edgespec.kernels.quant.triton_kquant`, which read the same super-blocks
(no second copy). Elsewhere the torch reference runs (:meth:`PackedWeight.matmul_ref`: a tile of rows
dequantized, then a matmul). Decoding is checked against gguf-py's ``quants.dequantize``
(tests/weights/test_gguf_kquants.py), the GPU products against this decode (tests/kernels/test_kquant_fp8_row_gpu.py).
"""

from __future__ import annotations

import numpy as np
import torch

from edgespec.weights.base import register_format
from edgespec.weights.gguf import GGUFBlockWeight


def _scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes ``[..., 12]`` -> 8 scales and 8 mins ``[..., 8]`` (float32, values 0..63)."""
    s = packed.to(torch.int32)
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def _nibble_subblocks(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes ``[..., 128]`` -> ``[..., 8, 32]`` values 0..15 (chunk c: low nibbles, then high nibbles)."""
    q = qs.reshape(*qs.shape[:-1], 4, 32).to(torch.int32)
    return torch.stack([q & 0xF, q >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32)


class _KQuant(GGUFBlockWeight):
    block = 256

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: on the Triton products (CUDA, a kernel chosen by the arch hooks) one launch decodes the
        rows asked for (``edgespec.kernels.quant.triton_kquant_decode.kquant_rows``); elsewhere the reference decode."""
        if self.kernel is not None and index.is_cuda:
            from edgespec.kernels.quant.triton_kquant_decode import kquant_rows
            return kquant_rows(self, index)
        return super().rows(index)

    def _dmin_form(self, blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``d * sc * q - dmin * m`` per sub-block of 32 (Q4_K, Q5_K), in ggml's order of fp32 operations."""
        d, dmin = self._half(blocks[..., 0:2]), self._half(blocks[..., 2:4])
        sc, mn = _scales_mins(blocks[..., 4:16])
        w = (d * sc).unsqueeze(-1) * q.float() - (dmin * mn).unsqueeze(-1)
        return w.reshape(*blocks.shape[:-1], 256)


@register_format
class Q4_KWeight(_KQuant):
    """GGUF Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins under fp16 ``d`` and ``dmin``."""

    format = "gguf_q4_k"
    ggml_type = 12
    block_bytes = 144

    def _decode(self, blocks: torch.Tensor) -> torch.Tensor:
        return self._dmin_form(blocks, _nibble_subblocks(blocks[..., 16:144]))


@register_format
class Q5_KWeight(_KQuant):
    """GGUF Q5_K: Q4_K's scales with a fifth bit per weight in ``qh``."""

    format = "gguf_q5_k"
    ggml_type = 13
    block_bytes = 176

    def _decode(self, blocks: torch.Tensor) -> torch.Tensor:
        qh = blocks[..., 16:48].to(torch.int32).unsqueeze(-2)                  # [..., 1, 32]
        # (shift tensors made on the weight's device: a host copy could not sit in a captured CUDA graph)
        sub = torch.arange(8, dtype=torch.int32, device=qh.device)
        high = (qh >> sub.view(8, 1)) & 1                                      # [..., 8, 32]: bit k -> sub-block k
        return self._dmin_form(blocks, _nibble_subblocks(blocks[..., 48:176]) + 16 * high)


@register_format
class Q6_KWeight(_KQuant):
    """GGUF Q6_K: 6-bit weights (4 low bits in ``ql``, 2 high in ``qh``), an int8 scale per 16, fp16 ``d``."""

    format = "gguf_q6_k"
    ggml_type = 14
    block_bytes = 210

    def _decode(self, blocks: torch.Tensor) -> torch.Tensor:
        lead = blocks.shape[:-1]
        ql = blocks[..., 0:128].reshape(*lead, 2, 64).to(torch.int32)
        qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32).to(torch.int32)
        low = torch.cat([ql & 0xF, ql >> 4], dim=-1)                            # [..., 2, 128]
        pair = torch.arange(0, 8, 2, dtype=torch.int32, device=qh.device)
        high = ((qh >> pair.view(4, 1)) & 3).reshape(*lead, 2, 128)
        q = (low | (high << 4)) - 32
        sc = blocks[..., 192:208].contiguous().view(torch.int8).float().reshape(*lead, 2, 8)
        d = self._half(blocks[..., 208:210]).unsqueeze(-1)                    # [..., 1, 1]
        w = (d * sc).repeat_interleave(16, dim=-1) * q.float()
        return w.reshape(*lead, 256)


# ggml type id -> format class (the loader merges this table with gguf.GGML_FORMATS).
K_FORMATS: dict[int, type[GGUFBlockWeight]] = {c.ggml_type: c for c in (Q4_KWeight, Q5_KWeight, Q6_KWeight)}


# Synthetic files (tests, benchmarks): gguf-py cannot quantize to K-quants, and every byte pattern is a valid
# super-block, so random codes and sub-scales under an fp16 d (and dmin) of a chosen size make a real tensor.
# Per type: where d and dmin lie, and typical sizes that keep the weights at about 0.1-0.3.
_D_AT = {"Q2_K": (80, 82), "Q3_K": (108, None), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None)}
K_D_SCALE = {"Q2_K": (1e-3, 1e-3), "Q3_K": (1e-3, None), "Q4_K": (4e-4, 1e-3), "Q5_K": (2e-4, 1e-3),
             "Q6_K": (1e-4, None)}


def random_kquant(rows: int, cols: int, kind: str, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Random ``kind`` (``Q2_K`` .. ``Q6_K``) super-blocks ``uint8 [rows, cols/256 * block_bytes]``; ``scale``
    multiplies the typical ``d`` / ``dmin`` (so the weights)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    _, nbytes = GGML_QUANT_SIZES[getattr(Q, kind)]
    raw = rng.integers(0, 256, size=(rows, cols // 256, nbytes), dtype=np.uint8)
    for at, base in zip(_D_AT[kind], K_D_SCALE[kind], strict=True):
        if at is not None:
            d = (scale * base * (0.5 + rng.random((rows, cols // 256)))).astype(np.float16)
            raw[..., at:at + 2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    return raw.reshape(rows, -1)
