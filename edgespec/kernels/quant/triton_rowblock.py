"""Launch plumbing shared by the weight-only products that run activations in 16-row blocks with a K split
(``edgespec.kernels.quant.triton_kquant``, ``edgespec.kernels.quant.triton_fp8_row``): the output and partial-sum
buffers, the split choice, and the fixed-order sum of the K splits (``edgespec.kernels.quant.triton_gemv``'s
split-sum kernel, no atomics: the same bits on every run)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from edgespec.kernels.quant.triton_gemv import _split_sum_kernel


@triton.jit
def row_block_program(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's activation rows ``m`` and weight rows ``n`` (with their masks) and its K split. Grid axis 0
    is (weight block, row block) with the row blocks of one weight tile side by side (the tile then comes from L2
    for all but the first); axis 1 is the K split."""
    m_blocks = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % m_blocks
    pid_n = tl.program_id(0) // m_blocks
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return m, m < M, n, n < N, tl.program_id(1)


def choose_splits(n_blocks: int, n_tiles: int, sms: int, waves: int = 4, min_tiles: int = 1) -> int:
    """K splits of a product with ``n_blocks`` weight-row blocks over ``n_tiles`` K tiles: about ``waves`` programs
    per SM on narrow matrices, each split at least ``min_tiles`` tiles, and a divisor of ``n_tiles`` (every split
    the same length). It depends on the matrix only, never on the row count."""
    want = waves * sms
    target = 1 if n_blocks >= want // 2 else max(1, min(triton.cdiv(want, n_blocks), n_tiles // min_tiles))
    return max(d for d in range(1, target + 1) if n_tiles % d == 0)


@dataclass
class RowBlockOutputs:
    """``y [M, N]`` in the activation dtype, and the fp32 partials ``part [splits, M, N]`` when K is split (else
    ``part`` is ``y``, written directly)."""

    y: torch.Tensor
    part: torch.Tensor
    splits: int

    @classmethod
    def new(cls, M: int, N: int, splits: int, x: torch.Tensor) -> RowBlockOutputs:
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
        part = y if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
        return cls(y, part, splits)

    @property
    def direct(self) -> bool:
        return self.splits == 1

    @property
    def part_strides(self) -> tuple[int, int]:
        return (0, 0) if self.direct else (self.part.stride(0), self.part.stride(1))

    def finish(self, bias: torch.Tensor | None, pdl: dict) -> torch.Tensor:
        """``y`` after summing the splits (with the bias) when K was split; ``y`` as written otherwise."""
        if not self.direct:
            M, N = self.y.shape
            _split_sum_kernel[(M, triton.cdiv(N, 1024))](
                self.part, bias if bias is not None else self.part, self.y, M, N, self.splits, self.part.stride(0),
                self.part.stride(1), self.y.stride(0), HAS_BIAS=bias is not None,
                SPLITS_P2=max(2, triton.next_power_of_2(self.splits)), BLOCK=1024, num_warps=4, PDL=bool(pdl), **pdl)
        return self.y
