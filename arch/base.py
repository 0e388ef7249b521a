"""Portable hook set: the stages of a speculative cycle in plain torch, runnable on CPU.

The session calls only these methods; subclasses in ``rtx`` and ``thor`` change defaults and override stages.
Rollback strategies (both available on every arch, chosen by the ``rollback`` setting or the arch default):

* ``checkpoint``: verify saves the GDN state after every row; rollback copies one slot back (constant time).
* ``replay``: snapshot the GDN state before verify; on a partial accept restore it and re-run the accepted rows
  (a second, shorter forward; needs no per-row slots). Attention-only models never replay: truncating their
  KV cache is O(1), so both strategies reduce to setting the length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgespec.cache.model_cache import ModelCache
from edgespec.models.decoder import ForwardOutput, TargetModel


@dataclass
class ArchDefaults:
    """Hardware-dependent defaults; a setting left at auto/None takes these."""

    kv_fp8: bool = False
    rollback: str = "checkpoint"
    prefill_chunk: int = 512
    window_size: int = 128
    window_seed: bool = True
    cuda_graphs: bool = False


class ArchHooks:
    """Portable stages (also the CPU path). See the module doc for the rollback strategies."""

    name = "base"

    def __init__(self) -> None:
        self.defaults = self.make_defaults()

    def make_defaults(self) -> ArchDefaults:
        return ArchDefaults()

    # -- cache --------------------------------------------------------------------------------------------------
    def new_cache(self, model: TargetModel, max_len: int, kv_fp8: bool, rollback: str, max_rows: int) -> ModelCache:
        """Allocate the request cache; checkpoint rollback needs one state slot per verify row."""
        return model.new_cache(max_len, kv_fp8=kv_fp8,
                               checkpoint_rows=max_rows if rollback == "checkpoint" else 0)

    # -- stages -------------------------------------------------------------------------------------------------
    def prefill(self, model: TargetModel, cache: ModelCache, prompt: torch.Tensor, chunk: int,
                taps: Sequence[int]) -> ForwardOutput:
        """Fill the cache with the prompt; logits of the last row, hidden/taps of every row."""
        return model.prefill(prompt, cache, chunk=chunk, taps=taps)

    def verify(self, model: TargetModel, cache: ModelCache, rows: torch.Tensor, taps: Sequence[int],
               rollback: str) -> ForwardOutput:
        """One target forward over ``rows = [current, drafts...]``; saves what the rollback strategy needs."""
        if rollback == "replay":
            cache.snapshot()
        return model.forward(rows, cache, taps=taps, checkpoint=rollback == "checkpoint" and cache.has_state,
                             chunked=False)

    def rollback(self, model: TargetModel, cache: ModelCache, rows: torch.Tensor, keep: int, taps: Sequence[int],
                 rollback: str) -> ForwardOutput | None:
        """Keep the first ``keep`` verify rows in the cache. Returns a replay forward's output when one ran."""
        start = cache.length - rows.shape[0]
        if keep == rows.shape[0]:
            return None
        if rollback == "replay" and cache.has_state:
            cache.restore_snapshot()
            return model.forward(rows[:keep], cache, taps=taps, chunked=False, logits="none")
        cache.rollback(start + keep)
        return None

    def decode(self, model: TargetModel, cache: ModelCache, token: torch.Tensor, taps: Sequence[int]) -> ForwardOutput:
        """A plain single-token step (no draft this cycle)."""
        return model.forward(token.view(1), cache, taps=taps, chunked=False)
