"""What the torch and Triton forms of Gated DeltaNet share (:mod:`edgespec.kernels.recurrent.gdn`,
:mod:`edgespec.kernels.recurrent.triton_gdn`, the tree forms of :mod:`edgespec.kernels.verify`): the q/k
preparation and the chunk sizes the Triton chunked form takes."""

from __future__ import annotations

import torch


def prepare_qk(q: torch.Tensor, k: torch.Tensor, n_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """l2-normalise q and k in fp32, scale q, and repeat key heads up to the value heads."""
    q = q.float()
    k = k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5)
    ratio = n_v_heads // k.shape[1]
    if ratio > 1:
        q = q.repeat_interleave(ratio, dim=1)
        k = k.repeat_interleave(ratio, dim=1)
    return q, k


def triton_chunk_ok(chunk: int) -> bool:
    """Whether the Triton chunked form takes ``chunk`` rows per chunk: a power of two in [16, 128]."""
    return chunk > 0 and not chunk & (chunk - 1) and 16 <= chunk <= 128
