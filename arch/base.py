"""Portable hook set: the stages of a speculative cycle in plain torch, runnable on CPU.

The session calls only these methods; subclasses in ``rtx`` and ``thor`` change defaults and override stages.
Rollback strategies (both available on every arch, chosen by the ``rollback`` setting or the arch default):

* ``checkpoint``: verify saves the GDN state after every row; rollback copies one slot back (constant time).
* ``replay``: snapshot the GDN state before verify; on a partial accept restore it and re-run the accepted rows
  (a second, shorter forward; needs no per-row slots).
* ``deferred``: verify leaves the GDN state untouched and keeps each row's inputs (a few KB); the accept stage
  advances the state by the accepted rows in one launch for all layers. Fewest state bytes of the three: one read
  in the verify, one read + write in the commit (checkpoints write the state once per verify row).

Attention-only models never replay or defer: truncating their KV cache is O(1), so every strategy reduces to
setting the length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from edgespec.arch.graphs import StaticForward
from edgespec.cache.model_cache import ModelCache
from edgespec.models.decoder import ForwardOutput, TargetModel
from edgespec.models.moe import moe_blocks
from edgespec.weights.base import PackedWeight

# The rollback strategies every arch offers (see the module doc).
ROLLBACK_STRATEGIES: tuple[str, ...] = ("checkpoint", "replay", "deferred")


@dataclass
class ArchDefaults:
    """Hardware-dependent defaults; a setting left at auto/None takes these."""

    kv_fp8: bool = False
    rollback: str = "checkpoint"
    prefill_chunk: int = 512
    window_size: int = 128
    window_seed: bool = True
    cuda_graphs: bool = False
    # Adapt the drafts per cycle to recent acceptance. On CPU every verify row costs (a multi-row product is
    # compute-heavy on a few cores), so drafting only as far as drafts are being accepted pays; on a GPU the
    # verify runs as a static graph of K+1 rows whatever is drafted, so shorter drafts would only lose tokens.
    adaptive_k: bool = True
    # A prefill that continues a non-empty cache (a follow-up turn resumed by prefix reuse) of at most this many
    # tokens goes through the captured verify forward in chunks of its rows instead of one eager forward: on a GPU
    # an eager forward of a few dozen rows is bound by its hundreds of kernel launches, a graph replay is not.
    # 0: always eager. A fresh prompt always prefills eagerly. The GPU hooks (rtx, thor) set 128: on an H100 a
    # follow-up turn of 42-63 new tokens after 3k tokens answered its first token in 3-10 ms against 20-77 ms
    # eager (edgespec bench --multi-turn; docs/benchmarks.md), for one 32-row capture per graph session. Off
    # here (CPU: no graphs to replay).
    graph_prefill_max: int = 0
    # Rows of a static forward captured for those prefills when it is wider than the verify forward: one replay of
    # 32 rows instead of seven of K+1=5 for a 30-token turn. Captured for attention-only models and the deferred
    # rollback (which keeps a few KB of inputs per row); checkpoint rollback would need a whole GDN state per row,
    # so it prefills through its verify forward. 32: the widest the Triton attention takes (kernels.attention).
    graph_prefill_rows: int = 32


class ArchHooks:
    """Portable stages (also the CPU path). See the module doc for the rollback strategies."""

    name = "base"

    def __init__(self) -> None:
        self.defaults = self.make_defaults()
        self.static: dict[int, StaticForward] = {}   # row count -> static (graph-mode) forward
        self.rollback_mode = self.defaults.rollback   # set by prepare(); verify and rollback follow it

    def make_defaults(self) -> ArchDefaults:
        return ArchDefaults()

    # -- cache --------------------------------------------------------------------------------------------------
    def new_cache(self, model: TargetModel, max_len: int, kv_fp8: bool, rollback: str, max_rows: int) -> ModelCache:
        """Allocate the request cache; checkpoint rollback needs one state slot per verify row, deferred rollback
        room for each verify row's inputs."""
        defer_rows = max(max_rows, self.defaults.graph_prefill_rows) if rollback == "deferred" else 0
        return model.new_cache(max_len, kv_fp8=kv_fp8,
                               checkpoint_rows=max_rows if rollback == "checkpoint" else 0, defer_rows=defer_rows)

    def prepare(self, model: TargetModel, cache: ModelCache, verify_rows: int, taps: Sequence[int],
                rollback: str, graphs: bool) -> None:
        """Fix the rollback strategy (one of ``ROLLBACK_STRATEGIES``) that :meth:`verify` and :meth:`rollback`
        follow, and build the static decode (1 row) and verify (``verify_rows``) forwards, and a wider one for short
        resumed prefills (``ArchDefaults.graph_prefill_rows``); capture them as CUDA graphs when ``graphs`` and the
        model is on CUDA. Leaves the cache reset. Without ``graphs`` stages run eagerly."""
        self.rollback_mode = rollback
        self.static.clear()
        # MoE layers run as graphs only with every expert stacked (device-side ids, edgespec.kernels.triton_moe);
        # packed experts are grouped on the host (edgespec.kernels.moe) and run eagerly.
        graphs = graphs and all(b.w13 is not None for b in moe_blocks(model))
        self.choose_weight_kernels(model)   # before any capture: graphs record the chosen products
        if cache.states is not None:
            cache.states.graph_commits = graphs and model.device.type == "cuda"
        if graphs:
            checkpoint = rollback == "checkpoint" and cache.has_state
            defer = rollback == "deferred" and cache.has_state
            self.static[1] = StaticForward(model, cache, 1, taps, False, capture=True)
            if verify_rows > 1:
                self.static[verify_rows] = StaticForward(model, cache, verify_rows, taps, checkpoint, capture=True,
                                                         defer=defer)
            wide = self.defaults.graph_prefill_rows
            if self.defaults.graph_prefill_max and wide > verify_rows and (defer or not cache.has_state):
                self.static[wide] = StaticForward(model, cache, wide, taps, False, capture=True, defer=defer)
        cache.reset()

    # -- weights ------------------------------------------------------------------------------------------------
    def weight_kernel(self, packed: PackedWeight) -> Callable | None:
        """The fast product for one packed weight on this hardware, or None for its torch reference. Base: the
        Triton products of ``edgespec.kernels.triton_quant_gemv`` where they run (CUDA, Triton, a capability and
        shape they accept); on CPU the GGUF formats keep their own compiled path."""
        if packed.device.type != "cuda":
            return None
        from edgespec.kernels.triton_quant_gemv import choose_quant_kernel, prepare_for_kernel
        kernel = choose_quant_kernel(packed)
        if kernel is not None:
            prepare_for_kernel(packed)
        return kernel

    def choose_weight_kernels(self, *modules: torch.nn.Module) -> int:
        """Store :meth:`weight_kernel` in every packed weight of ``modules`` (the target, a drafter); returns how
        many got a fast kernel. Dense layers are unaffected (``edgespec.kernels.linear`` routes them)."""
        chosen = 0
        for module in modules:
            for sub in module.modules():
                if isinstance(sub, PackedWeight):
                    sub.kernel = self.weight_kernel(sub)
                    chosen += sub.kernel is not None
        return chosen

    # -- stages -------------------------------------------------------------------------------------------------
    def prefill(self, model: TargetModel, cache: ModelCache, prompt: torch.Tensor, chunk: int,
                taps: Sequence[int], logits: bool = True) -> ForwardOutput:
        """Fill the cache with the prompt; logits of the last row (``logits=False``: a piece whose logits nobody
        reads may skip them), hidden/taps of every row."""
        out = self._graph_prefill(cache, prompt)
        return out if out is not None else model.prefill(prompt, cache, chunk=chunk, taps=taps, logits=logits)

    def _graph_prefill(self, cache: ModelCache, prompt: torch.Tensor) -> ForwardOutput | None:
        """A short resumed prefill through the widest static forward, ``rows`` tokens per replay (None: stay eager).

        The last chunk is padded with its last token; its padding rows are dropped as a rejected draft's would be
        (``cache.rollback``, which also commits a deferred forward's rows and, after a checkpointed one, keeps the
        state of the last real row). A replay-strategy verify keeps no per-row state, so a hybrid model with it
        stays eager. The outputs live in the graph's buffers and are copied before the next replay.
        """
        n = prompt.shape[0]
        static = self.static[max(self.static)] if self.static else None
        if static is None or static.rows < 2 or n > self.defaults.graph_prefill_max or cache.length == 0:
            return None
        if cache.has_state and not (static.checkpoint or static.defer):
            return None
        if cache.length + -(-n // static.rows) * static.rows > cache.max_len:
            return None     # the padded last chunk would not fit a cache nearly full
        hidden, taps, out, m = [], [], None, 0
        for s in range(0, n, static.rows):
            piece = prompt[s:s + static.rows]
            m = piece.shape[0]
            if m < static.rows:
                piece = torch.cat([piece, piece[-1:].expand(static.rows - m)])
            start = cache.length
            out = static.run(piece, cache)
            cache.rollback(start + m)
            hidden.append(out.hidden[:m].clone())
            if out.taps is not None:
                taps.append(out.taps[:m].clone())
        return ForwardOutput(out.logits[m - 1:m].clone(), torch.cat(hidden), torch.cat(taps) if taps else None)

    def verify(self, model: TargetModel, cache: ModelCache, rows: torch.Tensor, taps: Sequence[int]) -> ForwardOutput:
        """One target forward over ``rows = [current, drafts...]``; saves what the rollback strategy needs.

        With a static verify forward of R rows, shorter drafts are padded to R (a batch-1 forward costs the same
        for any row count up to ~16: it reads the weights once); the returned output is cut to the real rows.
        Padding rows sit after the real ones, so causality keeps them out of the real rows' results, and the
        rollback drops them with the rejected drafts.
        """
        rollback = self.rollback_mode
        if rollback == "replay":
            cache.snapshot()
        n = rows.shape[0]
        static = self._static_verify(n)
        if static is None:
            return model.forward(rows, cache, taps=taps, checkpoint=rollback == "checkpoint" and cache.has_state,
                                 defer=rollback == "deferred", chunked=False)
        if n < static.rows:
            rows = torch.cat([rows, rows[-1:].expand(static.rows - n)])
        out = static.run(rows, cache)
        if n == static.rows:
            return out
        return ForwardOutput(out.logits[:n], out.hidden[:n], None if out.taps is None else out.taps[:n],
                             out.greedy)

    def _static_verify(self, n: int) -> StaticForward | None:
        candidates = [r for r in self.static if r >= n and r > 1]
        return self.static[min(candidates)] if candidates else None

    def rollback(self, model: TargetModel, cache: ModelCache, start: int, rows: torch.Tensor, keep: int,
                 taps: Sequence[int]) -> ForwardOutput | None:
        """Keep the first ``keep`` of the verify rows written at ``start``. Returns a replay forward's output when
        one ran (its taps then cover exactly the kept rows)."""
        if self.rollback_mode == "replay" and cache.has_state:
            if start + keep == cache.length:
                return None
            cache.restore_snapshot()
            return model.forward(rows[:keep], cache, taps=taps, chunked=False, logits="none")
        # Also when every row is kept: a deferred verify's rows are committed here.
        cache.rollback(start + keep)
        return None

    def decode(self, model: TargetModel, cache: ModelCache, token: torch.Tensor, taps: Sequence[int]) -> ForwardOutput:
        """A plain single-token step (no draft this cycle)."""
        static = self.static.get(1)
        if static is not None:
            return static.run(token.view(1), cache)
        return model.forward(token.view(1), cache, taps=taps, chunked=False)
