"""The experts of one MoE layer stacked into one set of tensors per format: int4 (:class:`StackedInt4`), NVFP4
(:class:`StackedNVFP4`) and block FP8 (:class:`StackedFP8Block`), their sizes, layout checks and fp32 decode.

Plain data read by both sides of each product: the torch references and dispatchers
(:mod:`edgespec.kernels.moe.moe_quant` for int4, :mod:`edgespec.kernels.moe.moe_packed` for NVFP4 and block FP8,
whose docstrings give the layouts) and their Triton kernels, which import the stacks from here rather than from
the references that dispatch to them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from edgespec.kernels.quant.quant_ref import FP8_BLOCK, NVFP4_BLOCK, dequant_fp8_block, dequant_nvfp4

# Group sizes the Triton kernel takes (a quantization group is one tensor-core K tile); other int4 experts stay
# per expert, grouped on the host.
KERNEL_GROUPS = (32, 64, 128, 256)


class StackShape:
    """The sizes every expert stack reads off its ``q13`` / ``q2`` codes (``CODES_PER_BYTE`` codes in a byte):
    :class:`StackedInt4`, :class:`StackedNVFP4` and :class:`StackedFP8Block`."""

    CODES_PER_BYTE = 1
    q13: torch.Tensor
    q2: torch.Tensor

    @property
    def experts(self) -> int:
        """Stacked experts, the shared one included."""
        return self.q13.shape[0]

    @property
    def hidden(self) -> int:
        return self.q2.shape[1]

    @property
    def width(self) -> int:
        return self.q2.shape[2] * self.CODES_PER_BYTE


@dataclass
class StackedInt4(StackShape):
    """int4 experts of one layer: ``q13 [E', 2I, H/2]`` / ``s13``, ``z13 [E', 2I, H/g]`` (each expert's gate
    rows then its up rows, the merged ``gate_up_proj``) and ``q2 [E', H, I/2]`` / ``s2``, ``z2 [E', H, I/g]``.
    ``shared``: the last of the E' experts is the shared expert (E' = routed experts + 1)."""

    q13: torch.Tensor
    s13: torch.Tensor
    z13: torch.Tensor
    q2: torch.Tensor
    s2: torch.Tensor
    z2: torch.Tensor
    group_size: int
    shared: bool
    CODES_PER_BYTE = 2

    def check(self) -> None:
        """Shapes and dtypes of the contract layout; a named error otherwise."""
        E, H, I, g = self.experts, self.hidden, self.width, self.group_size
        want = {"q13": ((E, 2 * I, H // 2), torch.uint8), "s13": ((E, 2 * I, H // g), torch.float16),
                "z13": ((E, 2 * I, H // g), torch.uint8), "q2": ((E, H, I // 2), torch.uint8),
                "s2": ((E, H, I // g), torch.float16), "z2": ((E, H, I // g), torch.uint8)}
        if H % g or I % g:
            raise ValueError(f"stacked int4 experts: group size {g} must divide hidden {H} and width {I}")
        for name, (shape, dtype) in want.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"stacked int4 experts: {name} is {tuple(t.shape)} {t.dtype}, expected "
                                 f"{shape} {dtype}, contiguous")


class ExpertStack(Protocol):
    """What the routing side reads of any stacked expert set (int4, NVFP4 or block FP8):
    how many experts, and whether the last one is the shared expert."""

    shared: bool

    @property
    def experts(self) -> int: ...


# Inputs per kernel tile (one tensor-core K step of 128, as the dense NVFP4 and block-FP8 tiles take)
TILE = 128


def _check_shapes(kind: str, want: dict[str, tuple[tuple[int, ...], torch.dtype]], stack: object) -> None:
    for name, (shape, dtype) in want.items():
        t = getattr(stack, name)
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"stacked {kind} experts: {name} is {tuple(t.shape)} {t.dtype}, expected {shape} "
                             f"{dtype}, contiguous")


def _check_tiles(kind: str, hidden: int, width: int) -> None:
    if hidden % TILE or width % TILE:
        raise ValueError(f"stacked {kind} experts: hidden {hidden} and width {width} must be multiples of {TILE} "
                         "(the kernel's tile)")


@dataclass
class StackedNVFP4(StackShape):
    """NVFP4 experts of one layer (layout: :mod:`edgespec.kernels.moe.moe_packed`); ``shared``: the last expert is the
    shared one."""

    q13: torch.Tensor
    s13: torch.Tensor
    g13: torch.Tensor
    q2: torch.Tensor
    s2: torch.Tensor
    g2: torch.Tensor
    shared: bool
    format = "nvfp4"
    CODES_PER_BYTE = 2

    def check(self) -> None:
        """Shapes and dtypes of the layout, whole kernel tiles; a named error otherwise."""
        E, H, I = self.experts, self.hidden, self.width
        _check_tiles("nvfp4", H, I)
        e4m3 = torch.float8_e4m3fn
        _check_shapes("nvfp4", {
            "q13": ((E, 2 * I, H // 2), torch.uint8), "s13": ((E, 2 * I, H // NVFP4_BLOCK), e4m3),
            "g13": ((E, 2), torch.float32), "q2": ((E, H, I // 2), torch.uint8),
            "s2": ((E, H, I // NVFP4_BLOCK), e4m3), "g2": ((E,), torch.float32)}, self)

    def dequant(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e``'s ``(w13 [2I, H], w2 [H, I])`` in fp32 (gate and up rows each under their global scale)."""
        I = self.width
        gate = dequant_nvfp4(self.q13[e, :I], self.s13[e, :I], self.g13[e, 0], torch.float32)
        up = dequant_nvfp4(self.q13[e, I:], self.s13[e, I:], self.g13[e, 1], torch.float32)
        return torch.cat([gate, up]), dequant_nvfp4(self.q2[e], self.s2[e], self.g2[e], torch.float32)


@dataclass
class StackedFP8Block(StackShape):
    """Block-FP8 (128x128) experts of one layer (layout: :mod:`edgespec.kernels.moe.moe_packed`); ``shared``: the last
    expert is the shared one."""

    q13: torch.Tensor
    s13: torch.Tensor
    q2: torch.Tensor
    s2: torch.Tensor
    shared: bool
    format = "fp8_block"

    def check(self) -> None:
        """Shapes and dtypes of the layout, whole kernel tiles; a named error otherwise."""
        E, H, I, b = self.experts, self.hidden, self.width, FP8_BLOCK
        _check_tiles("fp8_block", H, I)
        e4m3 = torch.float8_e4m3fn
        _check_shapes("fp8_block", {
            "q13": ((E, 2 * I, H), e4m3), "s13": ((E, 2 * I // b, H // b), torch.float32),
            "q2": ((E, H, I), e4m3), "s2": ((E, H // b, I // b), torch.float32)}, self)

    def dequant(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e``'s ``(w13 [2I, H], w2 [H, I])`` in fp32."""
        return (dequant_fp8_block(self.q13[e], self.s13[e], 0, torch.float32),
                dequant_fp8_block(self.q2[e], self.s2[e], 0, torch.float32))


StackedPacked = StackedNVFP4 | StackedFP8Block
