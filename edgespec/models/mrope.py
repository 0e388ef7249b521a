"""Multimodal RoPE (M-RoPE) positions: which rotary channels turn with which axis, and a prompt's positions.

Pure functions over plain tensors (no model), shared by the rotary tables (:class:`edgespec.models.layers.
RotaryEmbedding`) and the prompt's image layout (:mod:`edgespec.models.multimodal`, whose module doc explains the
positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rotary_axes(section: Sequence[int], interleaved: bool, rotary_dim: int) -> torch.Tensor:
    """Which position axis (0 t, 1 h, 2 w) turns each of the ``rotary_dim`` channels of the cos/sin tables.

    Interleaved (Qwen3.5/3.6, Qwen3-VL; transformers' ``recomposition_frequencies``): frequency ``j`` follows h when
    ``j % 3 == 1`` and ``j < 3 * section[1]``, w when ``j % 3 == 2`` and ``j < 3 * section[2]``, else t. Otherwise
    (Qwen2-VL) the first ``section[0]`` frequencies follow t, the next ``section[1]`` h, the rest w. Both halves of
    the table (rotate-half pairs) share the frequency's axis. Example: section (2, 1, 1), interleaved -> frequencies
    t h w t -> channels [0, 1, 2, 0, 0, 1, 2, 0]."""
    half = rotary_dim // 2
    if interleaved:
        axes = [1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
                for j in range(half)]
    else:
        axes = [0] * section[0] + [1] * section[1] + [2] * section[2]
    return torch.tensor(axes + axes, dtype=torch.long)


def prompt_positions(n_rows: int, images: Sequence[tuple[int, tuple[int, int, int]]], merge: int
                     ) -> tuple[torch.Tensor, int]:
    """M-RoPE positions ``[n_rows, 3]`` of a prompt whose images ``(first row, grid)`` are given in order, and the
    rope delta after it (position minus cache index of the rows that follow).

    Example: 2 text rows, an image of merged grid 2 x 3 (6 rows), 1 text row -> text (0,0,0) (1,1,1); image
    t 2, h 2 2 2 3 3 3, w 2 3 4 2 3 4; text (5,5,5); delta 5 + 1 - 9 = -3."""
    pos = torch.empty(n_rows, 3, dtype=torch.long)
    row = cur = 0
    for first, (t, h, w) in images:
        text = first - row
        pos[row:first] = (torch.arange(text) + cur)[:, None]
        cur += text
        gh, gw = h // merge, w // merge
        frames = torch.arange(t).view(t, 1, 1).expand(t, gh, gw)
        rows = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
        cols = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
        n = t * gh * gw
        pos[first:first + n] = torch.stack([frames, rows, cols], dim=-1).reshape(n, 3) + cur
        cur += max(gh, gw)
        row = first + n
    pos[row:] = (torch.arange(n_rows - row) + cur)[:, None]
    cur += n_rows - row
    return pos, cur - n_rows
