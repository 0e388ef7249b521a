"""Portable hook set: the stages of a speculative cycle in plain torch, runnable on CPU.

The session calls only these methods; subclasses in ``rtx`` and ``thor`` change defaults and override stages.
How a verify leaves the GDN state and how rejected rows are taken back is a rollback strategy
(``edgespec.arch.rollback``) that the session passes in: the hooks learn no mode of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from edgespec.arch.graphs import StaticForward
from edgespec.arch.rollback import RollbackStrategy, TreeVerify
from edgespec.arch.tree_graphs import StaticTreeForward, graph_budgets
from edgespec.cache.model_cache import ModelCache
from edgespec.cache.state import StateMode
from edgespec.models.decoder import ForwardOutput, TargetModel
from edgespec.models.moe import moe_blocks
from edgespec.models.multimodal import ImageRows
from edgespec.weights.base import PackedWeight


@dataclass(frozen=True)
class ArchDefaults:
    """Hardware-dependent defaults; a setting left at auto/None takes these (resolved once, into the runtime plan
    of ``edgespec.plan``; nothing edits them in place)."""

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
    # ``draft_tree: auto``: tree nodes whose path the drafter gives a lower joint probability are not verified
    # (0: none dropped by a fixed floor; the CPU sizes its trees by cost instead, below).
    tree_min_joint: float = 0.0
    # ``draft_tree: auto``: the node budget when no profile chose one (``edgespec profile`` writes the budget it
    # measured best as a number).
    tree_budget: int = 16
    # Tree sizing by cost (edgespec.speculative.tree_size): the prior of what one more verify row costs as a share
    # of a cycle's fixed cost, until the session has measured it; 0 = no sizing, every node of the budget is
    # verified (the GPU hooks: a byte-bound verify's extra rows cost little). On a CPU every row is arithmetic over
    # all the weights, a fair share of the draft and fixed verify cost (docs/benchmarks.md, "Trees sized by cost").
    tree_row_cost: float = 0.15
    # A prefill that continues a non-empty cache (a follow-up turn resumed by prefix reuse) of at most this many
    # tokens goes through the captured verify forward in chunks of its rows instead of one eager forward: on a GPU
    # an eager forward of a few dozen rows is bound by its hundreds of kernel launches, a graph replay is not.
    # 0: always eager. A fresh prompt always prefills eagerly. The GPU hooks (rtx, thor) set 128, for one 32-row
    # capture per graph session (follow-up TTFT: docs/benchmarks.md, "Multi-turn agent conversation"). Off here
    # (CPU: no graphs to replay).
    graph_prefill_max: int = 0
    # Rows of a static forward captured for those prefills when it is wider than the verify forward: one replay of
    # 32 rows instead of seven of K+1=5 for a 30-token turn. Captured for attention-only models and the deferred
    # rollback (which keeps a few KB of inputs per row); checkpoint rollback would need a whole GDN state per row,
    # so it prefills through its verify forward. 32: the widest the Triton attention takes (kernels.attention).
    graph_prefill_rows: int = 32


class ArchHooks:
    """Portable stages (also the CPU path); the rollback strategies are in ``edgespec.arch.rollback``."""

    name = "base"

    def __init__(self) -> None:
        self.defaults = self.make_defaults()
        self.static: dict[int, StaticForward] = {}   # row count -> static (graph-mode) forward, built by prepare()
        self.static_trees: dict[int, StaticTreeForward] = {}   # rows -> captured tree verify (draft_tree, graphs)
        self.graph_prefill_max = 0                    # resumed prefills this short replay the widest of them

    @classmethod
    def make_defaults(cls) -> ArchDefaults:
        return ArchDefaults()

    # -- cache --------------------------------------------------------------------------------------------------
    def new_cache(self, model: TargetModel, max_len: int, kv_fp8: bool, rollback: RollbackStrategy,
                  max_rows: int) -> ModelCache:
        """Allocate the request cache with the per-row room ``rollback`` needs for verifies of ``max_rows`` rows
        (and the wide static forward of ``ArchDefaults.graph_prefill_rows``)."""
        rows = rollback.cache_rows(max_rows, self.defaults.graph_prefill_rows)
        return model.new_cache(max_len, kv_fp8=kv_fp8, checkpoint_rows=rows.checkpoint_rows,
                               defer_rows=rows.defer_rows)

    def prepare(self, model: TargetModel, cache: ModelCache, verify_rows: int, taps: Sequence[int],
                rollback: RollbackStrategy, graphs: bool, graph_prefill_max: int) -> None:
        """Build the static decode (1 row) and verify (``verify_rows``) forwards, in the state mode ``rollback``
        gives a verify, and a wider one for resumed prefills of up to ``graph_prefill_max`` tokens
        (``ArchDefaults.graph_prefill_rows``; 0: none); capture them as CUDA graphs when ``graphs`` and the model
        is on CUDA. A tree rollback (``draft_tree``) with ``graphs`` also gets the static tree verifies of its
        budget (:mod:`edgespec.arch.tree_graphs`). Leaves the cache reset. Without ``graphs`` stages run eagerly."""
        self.static.clear()
        self.static_trees.clear()
        self.graph_prefill_max = graph_prefill_max
        # MoE layers run as graphs only with every expert stacked (device-side ids, edgespec.kernels.moe.triton_moe and
        # triton_moe_int4); other packed experts are grouped on the host (edgespec.kernels.moe.moe) and run eagerly.
        graphs = graphs and all(b.device_routed for b in moe_blocks(model))
        self.choose_weight_kernels(model)   # before any capture: graphs record the chosen products
        if cache.states is not None:
            cache.states.graph_commits = graphs and model.device.type == "cuda"
        if graphs:
            mode = rollback.verify_mode(cache)
            self.static[1] = StaticForward(model, cache, 1, taps, StateMode.ADVANCE, capture=True)
            if verify_rows > 1:
                self.static[verify_rows] = StaticForward(model, cache, verify_rows, taps, mode, capture=True)
            wide = self.defaults.graph_prefill_rows
            if graph_prefill_max and wide > verify_rows and rollback.wide_prefill(cache):
                self.static[wide] = StaticForward(model, cache, wide, taps, mode, capture=True)
            if isinstance(rollback, TreeVerify) and verify_rows > 1:
                for budget in graph_budgets(rollback.budget):
                    self.static_trees[budget + 1] = StaticTreeForward(model, cache, budget, taps, capture=True,
                                                                      max_path=verify_rows)
        cache.reset()

    # -- weights ------------------------------------------------------------------------------------------------
    def weight_kernel(self, packed: PackedWeight, capability: tuple[int, int] | None = None) -> Callable | None:
        """The fast product for one packed weight on this hardware, or None for its torch reference (CPU).
        ``capability``: choose for that compute capability without the device (``edgespec.bench.compile_targets``
        records the launches of a GPU it does not have); the buffers are then left as they are."""
        if capability is None:
            if packed.device.type != "cuda":
                return None
            capability = torch.cuda.get_device_capability(packed.device)
        return self.packed_kernel(packed, capability)

    def packed_kernel(self, packed: PackedWeight, capability: tuple[int, int]) -> Callable | None:
        """The portable choice on a CUDA device of ``capability``: the Triton products of
        ``edgespec.kernels.quant.triton_quant_gemv`` where they take the format and shape (the weights decoded to the
        activation type for the tensor cores), MXFP4 on ``tl.dot_scaled`` (native from compute capability 10,
        emulated before), GGUF K-quants and per-row FP8 on kernels of their own."""
        from edgespec.kernels.quant.triton_quant_gemv import choose_quant_kernel, prepare_for_kernel
        kernel = choose_quant_kernel(packed, capability)
        if kernel is not None:
            if packed.device.type == "cuda":
                prepare_for_kernel(packed)
            return kernel
        from edgespec.kernels.quant.triton_block_scaled import choose_block_scaled_kernel
        if packed.format == "mxfp4":
            return choose_block_scaled_kernel(packed, native_only=False, capability=capability)
        if packed.device.type != "cuda":
            return None
        # Formats read in their own layout by kernels of their own: GGUF K-quants, per-row FP8.
        from edgespec.kernels.quant.triton_fp8_row import choose_fp8_row_kernel
        from edgespec.kernels.quant.triton_kquant import choose_kquant_kernel
        return choose_kquant_kernel(packed) or choose_fp8_row_kernel(packed)

    def kernel_names(self, capability: tuple[int, int]) -> dict[str, str]:
        """Which product each packed format gets on ``capability`` (``edgespec doctor``), by the kernel's name."""
        from edgespec.kernels.quant.quant_ref import pack
        names = {}
        for fmt in ("int4", "nvfp4", "mxfp4", "fp8_block"):
            probe = pack(fmt, torch.zeros(128, 256))
            kernel = self.weight_kernel(probe, capability)
            names[fmt] = getattr(kernel, "__name__", "torch reference") if kernel is not None else "torch reference"
        return names

    def choose_weight_kernels(self, *modules: torch.nn.Module) -> int:
        """Store :meth:`weight_kernel` in every packed weight of ``modules`` (the target, a drafter); returns how
        many got a fast kernel. Dense layers are unaffected (``edgespec.kernels.quant.linear`` routes them)."""
        chosen = 0
        for module in modules:
            for sub in module.modules():
                if isinstance(sub, PackedWeight):
                    sub.kernel = self.weight_kernel(sub)
                    chosen += sub.kernel is not None
        return chosen

    # -- stages -------------------------------------------------------------------------------------------------
    def prefill(self, model: TargetModel, cache: ModelCache, prompt: torch.Tensor, chunk: int,
                taps: Sequence[int], logits: bool = True, images: ImageRows | None = None) -> ForwardOutput:
        """Fill the cache with the prompt; logits of the last row (``logits=False``: a piece whose logits nobody
        reads may skip them), hidden/taps of every row. ``images``: image rows among the prompt's and every row's
        M-RoPE position (:mod:`edgespec.models.multimodal`); such a prefill runs eagerly."""
        if images is not None:
            return model.prefill(prompt, cache, chunk=chunk, taps=taps, logits=logits, images=images)
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
        if static is None or static.rows < 2 or n > self.graph_prefill_max or cache.length == 0:
            return None
        if cache.has_state and static.mode is StateMode.ADVANCE:
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

    def verify(self, model: TargetModel, cache: ModelCache, rows: torch.Tensor, taps: Sequence[int],
               rollback: RollbackStrategy) -> ForwardOutput:
        """One target forward over ``rows = [current, drafts...]``; saves what ``rollback`` needs to take rows back.

        With a static verify forward of R rows, shorter drafts are padded to R (a batch-1 forward costs the same
        for any row count up to ~16: it reads the weights once); the returned output is cut to the real rows.
        Padding rows sit after the real ones, so causality keeps them out of the real rows' results, and the
        rollback drops them with the rejected drafts.
        """
        rollback.before_verify(cache)
        n = rows.shape[0]
        mode = rollback.verify_mode(cache)
        static = self._static_verify(n)
        if static is None:
            return model.forward(rows, cache, taps=taps, mode=mode, chunked=False)
        if static.mode is not mode:
            raise ValueError(f"verify with rollback {rollback.name!r} through a forward prepared for "
                             f"{static.mode.value} state")
        if n < static.rows:
            rows = torch.cat([rows, rows[-1:].expand(static.rows - n)])
        out = static.run(rows, cache)
        if n == static.rows:
            return out
        return ForwardOutput(out.logits[:n], out.hidden[:n], None if out.taps is None else out.taps[:n],
                             out.greedy)

    def rollback(self, model: TargetModel, cache: ModelCache, start: int, rows: torch.Tensor, keep: int,
                 taps: Sequence[int], strategy: RollbackStrategy) -> ForwardOutput | None:
        """Keep the first ``keep`` of the verify ``rows`` written at ``start`` the way ``strategy`` says (its
        :meth:`~edgespec.arch.rollback.RollbackStrategy.rollback`); returns a replay forward's output when one ran."""
        return strategy.rollback(model, cache, start, rows, keep, taps)

    def tree_forward(self, cache: ModelCache, rows: int) -> StaticTreeForward | None:
        """The smallest static tree verify that takes a tree of ``rows`` rows in ``cache`` now (None: verify it
        eagerly, e.g. near the end of the cache, where the padded rows would not fit)."""
        fits = [r for r, static in self.static_trees.items() if static.fits(cache, rows)]
        return self.static_trees[min(fits)] if fits else None

    def _static_verify(self, n: int) -> StaticForward | None:
        candidates = [r for r in self.static if r >= n and r > 1]
        return self.static[min(candidates)] if candidates else None

    def decode(self, model: TargetModel, cache: ModelCache, token: torch.Tensor, taps: Sequence[int]) -> ForwardOutput:
        """A plain single-token step (no draft this cycle)."""
        static = self.static.get(1)
        if static is not None:
            return static.run(token.view(1), cache)
        return model.forward(token.view(1), cache, taps=taps, chunked=False)
