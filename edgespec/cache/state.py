"""Recurrent and convolution state of one Gated DeltaNet layer, with per-step checkpoints for rollback.

A GDN layer carries no per-position cache: its whole past is folded into ``recurrent [Hv, dk, dv]`` (fp32, as the
reference keeps it) and ``conv [conv_dim, kernel-1]`` (the last pre-conv inputs). Such state cannot be truncated,
so speculative decoding needs one of two rollback strategies (see ``arch``):

* checkpoint: a multi-row forward called with ``checkpoint=True`` saves the state before row 0 in slot 0 and the
  state after row i in slot i+1; rolling back to "n rows accepted" copies slot n into the live state. Constant
  time, costs ``(K+2)`` state copies of memory.
* replay: the caller snapshots the live state (slot 0) before the forward, restores it, and re-runs the accepted
  rows. Needs one slot only.
"""

from __future__ import annotations

import torch


class GDNState:
    """Live and checkpointed state of one Gated DeltaNet layer (batch 1). ``ModelCache`` copies between the live
    tensors and the slots for all layers at once."""

    def __init__(self, conv_dim: int, conv_kernel: int, n_v_heads: int, k_head_dim: int, v_head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, checkpoint_slots: int = 1) -> None:
        self.conv = torch.zeros(conv_dim, conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(n_v_heads, k_head_dim, v_head_dim, dtype=torch.float32, device=device)
        # Slot 0 = state before the last checkpointed forward; slot i+1 = state after its row i.
        self.conv_slots = torch.zeros((checkpoint_slots, *self.conv.shape), dtype=dtype, device=device)
        self.recurrent_slots = torch.zeros((checkpoint_slots, *self.recurrent.shape), dtype=torch.float32,
                                           device=device)

    @property
    def checkpoint_slots(self) -> int:
        return self.conv_slots.shape[0]

    def reset(self) -> None:
        self.conv.zero_()
        self.recurrent.zero_()

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.conv, self.recurrent, self.conv_slots, self.recurrent_slots))
