"""Attention of a DFlash draft block: ``T`` block queries over the context window's keys and the block's own.

``q [T, Hq, hd]`` are the block's queries (after q-norm and RoPE), ``k_block`` / ``v_block [T, Hkv, hd]`` its own
keys and values, ``keys`` / ``values [W + T, Hkv, hd]`` float32 hold the window's keys and values in rows ``0 .. W-1``
and scratch rows ``W .. W+T-1`` for the block's; their values are q's dtype widened to float32 (the drafter rounds
K/V to its dtype before storing them). ``bias [rep*T, W+T]`` float32 is the additive mask (0 attend, -inf not; row
``r*T + t`` is query row t of the r-th query head of a KV group, rep = Hq / Hkv). Scores and probabilities are
float32; the output ``[T, Hq*hd]`` is in q's dtype.

The reference (:func:`block_attention_ref`, CPU and the oracle) writes the block's keys and values into the scratch
rows and runs one batched float32 product per KV group. On CUDA the Triton kernel
(:mod:`edgespec.kernels.attention.triton_block_attention`; split over the keys, then one merge launch) reads the window
rows and the block's own rows where they are and leaves the scratch rows alone: the seven launches of the reference
(three copies, two float32 GEMMs on the FMA units, a softmax, the cast back) cost more per drafter layer than the
layer's q/k/v GEMM (docs/benchmarks.md, "Design figures").
"""

from __future__ import annotations

import torch

from edgespec.kernels import use_triton


def block_attention_ref(q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor, keys: torch.Tensor,
                        values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """The torch reference: the block's keys/values go to the scratch rows, then float32 GQA attention with the
    query heads of a group sharing their KV head's keys in one batched product (no copy of K/V per query head)."""
    T, Hq, hd = q.shape
    S, Hkv, _ = keys.shape
    rep = Hq // Hkv
    keys[-T:] = k_block
    values[-T:] = v_block
    qg = torch.empty(Hkv, rep, T, hd, dtype=keys.dtype, device=q.device)
    qg.copy_(q.view(T, Hkv, rep, hd).permute(1, 2, 0, 3))            # grouped by KV head, cast to fp32: 1 copy
    scores = torch.baddbmm(bias, qg.view(Hkv, rep * T, hd), keys.permute(1, 2, 0), alpha=scale)
    out = torch.bmm(torch.softmax(scores, dim=-1), values.transpose(0, 1))          # [Hkv, rep*T, hd]
    o = torch.empty(T, Hkv, rep, hd, dtype=q.dtype, device=q.device)
    o.copy_(out.view(Hkv, rep, T, hd).permute(2, 0, 1, 3))            # back to [T, Hq, hd] in q's dtype: 1 copy
    return o.view(T, Hq * hd)


def block_attention(q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA (bf16/fp16 queries, power-of-two head dims 16-256, blocks of up to 64
    rows), else the reference. Shapes as in the module docstring."""
    T, Hq, hd = q.shape
    S, Hkv, _ = keys.shape
    if (Hq % Hkv or k_block.shape != (T, Hkv, hd) or v_block.shape != k_block.shape or S < T
            or bias.shape != (Hq // Hkv * T, S) or keys.dtype != torch.float32 or values.shape != keys.shape):
        raise ValueError(f"block attention shapes: q{tuple(q.shape)} k_block{tuple(k_block.shape)} "
                         f"v_block{tuple(v_block.shape)} keys{tuple(keys.shape)} {keys.dtype} "
                         f"bias{tuple(bias.shape)}")
    if (use_triton(q) and q.dtype in (torch.bfloat16, torch.float16) and hd & (hd - 1) == 0 and 16 <= hd <= 256
            and T <= 64):
        from edgespec.kernels.attention.triton_block_attention import block_attention_triton
        return block_attention_triton(q, k_block, v_block, keys, values, bias, scale)
    return block_attention_ref(q, k_block, v_block, keys, values, bias, scale)
