"""DFlash proposer: drafts a block per cycle from a per-token context window of target features.

A DFlash drafter is a small transformer that drafts a whole block in one forward: the block is
``[anchor, MASK x (bs-1)]`` at positions ``p .. p+bs-1`` (``p`` = position of the anchor = the last emitted
token), and every block query also attends to *context* keys computed from the target's tapped hidden states.

Which token each context feature belongs to
-------------------------------------------
Tap row ``i`` of a target forward is the tapped hidden state *of the token at that row*, computed at that token's
position. Position ``t`` therefore gets exactly one feature, ``hidden_norm(fc(cat(taps of token t)))``, and
the feature exists only once token ``t`` has been through a target forward:

* prefill runs prompt tokens ``x_0 .. x_{n-1}``: features of positions ``0 .. n-1`` (the window is seeded from
  the last ``min(W, n)`` of them, or only the last one with seeding off). The first emitted token ``x_n`` has
  no feature yet: it is the first anchor.
* a verify runs ``rows = [last, d_1 .. d_K]`` at positions ``p .. p+K`` where ``last`` (position ``p``) is the
  previous cycle's bonus token. With ``a`` drafts accepted, rows ``0 .. a`` (``last, d_1 .. d_a``) are
  committed to the target cache, so their features are appended at positions ``p .. p+a``. The new bonus token
  (position ``p+a+1``) is the next anchor and gets its feature in the next cycle, as row 0.
* a plain decode step (no draft) runs ``[last]`` alone: one feature, position ``p``.

So after every commit the window holds the features of the committed tokens ``end-W .. end-1`` in order, where
``end`` = the target cache length = the position of the pending anchor. A replay rollback returns a forward over
exactly the accepted rows; a checkpoint rollback returns the full verify -- both ways rows ``0 .. accepted`` are
the committed ones.

Context K/V depend only on the feature (they skip the residual stream), so each drafter layer's context key
(k_norm + RoPE at the token's absolute position) and value are computed once, when the feature is appended, and
kept in the ring buffer of :class:`~edgespec.drafters.window.FeatureWindow`. A draft is then one block of ``bs``
queries against ``W + bs`` keys per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edgespec.arch.graphs import capture_graph
from edgespec.drafters.base import Draft, Proposer
from edgespec.drafters.dflash_net import DFlashDraftModel
from edgespec.drafters.tree import DraftTree, tree_from_logits
from edgespec.drafters.window import FeatureWindow
from edgespec.kernels.quant.linear import linear
from edgespec.kernels.verify.argmax import row_argmax
from edgespec.models.decoder import ForwardOutput, TargetModel
from edgespec.models.layers import RotaryEmbedding, gather_rows, merge_all_projections
from edgespec.weights.base import is_packed


class DFlashProposer(Proposer):
    """Drafts ``k <= block_size - 1`` tokens per cycle from one block forward over the cached context window.

    ``window_size`` (W): how many committed tokens' features the block attends to. ``window_seed``: fill the
    window from the last ``min(W, prompt)`` prompt tokens at prefill; when off, only the last prompt token's
    feature is kept (the block always needs the target's view of the position before the anchor), so the
    window fills from generated tokens. ``cuda_graphs``: run the block forward (+ lm_head + argmax) and the
    window append with their positions held on the device, so CUDA graphs captured at first use serve every
    position -- one for the block (every shape is static: bs queries, W + bs keys) and one per appended row
    count (1 .. bs); without CUDA the same path runs eagerly. The module docstring explains which token each
    feature belongs to.
    """

    name = "dflash"

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel, *, window_size: int = 128,
                 window_seed: bool = True, cuda_graphs: bool = False) -> None:
        cfg = drafter.cfg
        if drafter.layers[0].self_attn.qkv_proj is None:
            # The forward below runs on merged projections (q/k/v, gate/up); the loader has loaded the checkpoint
            # under its own names by now, so merging here keeps those names loadable.
            merge_all_projections(drafter)
        self.drafter = drafter.eval().requires_grad_(False)
        self.target = target
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.default_k = self.max_k = cfg.block_size - 1
        self.window_seed = window_seed
        # Unique tap ids for the session (one capture per layer), and how to lay them out in config order.
        self.taps = tuple(dict.fromkeys(cfg.target_layer_ids))
        order = [self.taps.index(i) for i in cfg.target_layer_ids]
        self._tap_order: list[int] | None = None if order == list(range(len(self.taps))) else order
        device, dtype = target.device, drafter.fc.weight.dtype
        self.dtype = dtype
        # Block positions reach past the target's last cache row by up to bs-1.
        max_pos = target.rope.cos.shape[0] + cfg.block_size
        self.rope = RotaryEmbedding(cfg.model_config(max_pos), max_pos).to(device)
        # fp32 window: block attention keeps fp32 scores and probabilities (see
        # edgespec.kernels.attention.block_attention)
        # and reads the cached K/V as they are, with no cast per layer and cycle. Features and K/V are rounded to
        # the drafter dtype before they get here, which is what lets the CUDA kernel narrow them back exactly.
        self.window = FeatureWindow(window_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                    cfg.head_dim, torch.float32, device, scratch_rows=cfg.block_size)
        # Every layer's k_norm weight, so one head_norm_rope serves the context keys of all layers.
        self._context_k_norm = drafter.context_k_norm()
        self._block_ids = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long, device=device)
        self._block_offsets = torch.arange(cfg.block_size, device=device)
        self._embed_weight = (drafter.embed_tokens if drafter.embed_tokens is not None
                              else target.model.embed_tokens).weight
        if drafter.lm_head is not None:
            self._head_weight = drafter.lm_head.weight
        elif drafter.embed_tokens is not None and cfg.tie_word_embeddings:
            self._head_weight = drafter.embed_tokens.weight
        else:
            self._head_weight = target.lm_head_weight
        self.block_rows = "full"            # set_cpu_step: the rows of a draft's block forward
        # set_draft_vocab: the draft vocabulary's token ids (the ranked ones, then the request's own) and the head's
        # rows of the ranked ones and of the request's (None: the full head).
        self._draft_ids: torch.Tensor | None = None
        self._head_subset: torch.Tensor | None = None
        self._ranked_ids: torch.Tensor | None = None
        self._in_draft_vocab: torch.Tensor | None = None     # [V] bool: the ids _draft_ids holds
        self._request_rows: torch.Tensor | None = None
        self.history: list[int] = []     # prompt + emitted tokens; the window covers history[end-length : end]
        # Head output of the last propose in the head's dtype (see last_logits); in graph mode a view of the static
        # output, valid until the next propose.
        self._last_scores: torch.Tensor | None = None
        # Graph mode: the block start lives on the device; the graph and its output buffers are made lazily.
        self.cuda_graphs = cuda_graphs
        self._pos = torch.zeros(1, dtype=torch.long, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static_out: tuple[torch.Tensor, torch.Tensor] | None = None
        self._append_pos = torch.zeros(1, dtype=torch.long, device=device)
        self._append_in: dict[int, torch.Tensor] = {}                # row count -> static taps input
        self._append_graphs: dict[int, torch.cuda.CUDAGraph] = {}    # row count -> captured append

    @property
    def window_size(self) -> int:
        return self.window.capacity

    @property
    def resume_rows(self) -> int:
        """A resumed prefill must still cover the prompt rows :meth:`begin` seeds the window with."""
        return self.window.capacity if self.window_seed else 1

    @property
    def last_logits(self) -> torch.Tensor | None:
        """Float32 draft logits ``[k, V]`` of the last propose (telemetry, tests), valid until the next propose;
        with a draft vocabulary (:meth:`set_draft_vocab`) the ids outside it are ``-inf``. Converted on access:
        drafting itself needs only the argmax, which the head's own dtype gives exactly."""
        if self._last_scores is None:
            return None
        if self._draft_ids is None:
            return self._last_scores.float()
        full = torch.full((self._last_scores.shape[0], self._head_vocab()), float("-inf"),
                          device=self._last_scores.device)
        full[:, self._draft_ids] = self._last_scores.float()
        return full

    # -- protocol -----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.window.reset()
        self.history = []
        self._last_scores = None
        if self._ranked_ids is not None:
            self._set_vocab(self._ranked_ids)

    @torch.inference_mode()
    def begin(self, prompt_ids: Sequence[int], prefill: ForwardOutput) -> None:
        self.reset()
        self.history = list(prompt_ids)
        self._add_request_tokens(self.history)
        n = len(self.history)
        keep = min(self.window.capacity, n) if self.window_seed else 1
        # The prefill covers the last ``rows`` prompt positions (all of them unless a cached prefix was resumed).
        taps = self._require_taps(prefill, keep, "prefill")
        rows = taps.shape[0]
        self._append(taps[rows - keep:rows], n - keep)

    @torch.inference_mode()
    def commit(self, tokens: Sequence[int], accepted: int, verify: ForwardOutput | None,
               drafted: int = 0) -> None:
        if verify is not None:
            # Rows 0 .. accepted of the forward are [previous anchor, accepted drafts]: the tokens at positions
            # end .. end+accepted, now in the target cache.
            rows = accepted + 1
            taps = self._require_taps(verify, rows, "verify")
            self._append(taps[:rows], self.window.end)
        self.history.extend(int(t) for t in tokens)
        self._add_request_tokens(tokens)

    @torch.inference_mode()
    def propose(self, last_token: int, k: int) -> Draft | None:
        if not self.history or self.history[-1] != last_token or len(self.history) != self.window.end + 1:
            raise RuntimeError("dflash proposer out of step with the session: every emitted token must be "
                               "committed once, in order, before the next propose")
        k = min(k, self.block_size - 1)
        if self.cuda_graphs:
            scores, tokens = self._run_static(last_token)
            # Views of static buffers the next replay overwrites: the session copies the drafts into its verify
            # rows before that, and last_logits is documented as valid until the next propose.
            scores, tokens = scores[:k], tokens[:k]
        else:
            rows = k + 1 if self.block_rows == "drafts" else self.block_size
            scores = self._draft_head(self.block_hidden(last_token, rows)[1:1 + k])
            tokens = scores.argmax(-1)
            if self._draft_ids is not None:       # subset position -> token id
                tokens = self._draft_ids[tokens]
        self._last_scores = scores
        return Draft(tokens)

    def propose_tree(self, last_token: int, k: int, budget: int, chain_first: bool = False) -> DraftTree | None:
        """The block's per-position logits expanded best-first under ``budget`` (DDTree): one block forward, as
        for a chain; the first-child path is the chain :meth:`propose` returns."""
        self.propose(last_token, k)
        return tree_from_logits(self.last_logits, budget, chain_first=chain_first)

    # -- drafter forward ------------------------------------------------------------------------------------------
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed block rows -> float32 logits with the head in use (own or the target's)."""
        return self._head(hidden).float()

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's output in its own dtype. Drafts are its argmax, the same token as the argmax of the float32
        logits (the conversion is exact and keeps the order), without writing and reading back a float32 copy of
        ``[bs-1, V]`` each cycle (15 MB for a 248k vocabulary)."""
        return linear(hidden.to(self._head_weight.dtype), self._head_weight)

    def _draft_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`_head` over the draft vocabulary (:meth:`set_draft_vocab`: column ``j`` scores token
        ``_draft_ids[j]``), else over all of it."""
        if self._head_subset is None:
            return linear(hidden.to(self._head_weight.dtype), self._head_weight)
        scores = linear(hidden.to(self._head_subset.dtype), self._head_subset)
        if self._request_rows is None:
            return scores
        return torch.cat([scores, linear(hidden.to(self._request_rows.dtype), self._request_rows)], dim=-1)

    def _head_vocab(self) -> int:
        w = self._head_weight
        return w.out_features if is_packed(w) else w.shape[0]

    def set_cpu_step(self, block_rows: str = "full") -> None:
        """Trade draft quality for a cheaper draft step (what a CPU needs: there a draft costs per row, unlike a
        GPU's). ``block_rows``: ``full`` runs the block of ``block_size`` rows the drafter was trained on;
        ``drafts`` only the anchor and the k drafts asked for (the later mask rows, which the full layers'
        bidirectional attention also reads, are left out). It cannot change the output, only which drafts the
        target is asked to verify."""
        if block_rows not in ("full", "drafts"):
            raise ValueError(f"block_rows {block_rows!r}: give full or drafts")
        self.block_rows = block_rows

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Score only the token ids ``ids`` (:mod:`edgespec.drafters.draft_vocab`; None: the full head) and the
        request's own tokens (prompt and output: answers copy the request's words, rare ones included): the ranked
        ids' head rows are gathered once into a small packed copy (GGUF blocks or dense rows, as the head stores
        them), the request's other tokens' rows per request and as they appear, and each draft is the argmax over
        them all. Lossless (the target verifies every draft); only which drafts it is asked to verify can change.
        Not in CUDA graph mode (the captured graph scores the full head)."""
        self._draft_ids = self._head_subset = self._ranked_ids = self._in_draft_vocab = self._request_rows = None
        if ids is None:
            return
        if self.cuda_graphs:
            raise ValueError("a draft vocabulary is not served in CUDA graph mode (cuda_graphs on): the captured "
                             "draft graph scores the full head")
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        vocab = self._head_vocab()
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"draft vocabulary: ids must be a non-empty list within 0..{vocab - 1}")
        if ids.numel() >= vocab:      # the whole head: nothing to gain
            return
        self._ranked_ids = ids.to(self.target.device)
        self._head_subset = _gathered_rows(self._head_weight, self._ranked_ids)
        self._set_vocab(self._ranked_ids)
        self._add_request_tokens(self.history)

    def _set_vocab(self, ranked: torch.Tensor) -> None:
        """The draft vocabulary back to the ranked ids alone (a new request)."""
        self._draft_ids, self._request_rows = ranked, None
        self._in_draft_vocab = torch.zeros(self._head_vocab(), dtype=torch.bool, device=ranked.device)
        self._in_draft_vocab[ranked] = True

    def _add_request_tokens(self, tokens: Sequence[int]) -> None:
        """Add the request's tokens outside the draft vocabulary to it (their head rows gathered)."""
        if self._in_draft_vocab is None or not len(tokens):
            return
        t = torch.as_tensor(list(tokens), dtype=torch.long, device=self._in_draft_vocab.device)
        t = t[(t >= 0) & (t < self._in_draft_vocab.numel())]
        new = t[~self._in_draft_vocab[t]].unique()
        if not new.numel():
            return
        self._in_draft_vocab[new] = True
        self._draft_ids = torch.cat([self._draft_ids, new])
        extra = self._draft_ids[self._ranked_ids.numel():]
        self._request_rows = _gathered_rows(self._head_weight, extra)

    @torch.inference_mode()
    def block_hidden(self, anchor: int, rows: int | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[rows, H]`` of the block ``[anchor, MASK x (rows-1)]`` (rows: block_size
        unless given) at positions ``end ..`` attending to the cached window (row 0 is the anchor; rows 1.. give
        the drafts)."""
        self._block_ids[0] = anchor
        return self._block_forward(self.window.end, None, rows or self.block_size)

    def _block_forward(self, start: int, pos_t: torch.Tensor | None, rows: int | None = None) -> torch.Tensor:
        """The drafter's block forward over the first ``rows`` (default all) of ``self._block_ids`` at ``start``
        (or the device position ``pos_t``), attending to the window."""
        rows = rows or self.block_size
        h = gather_rows(self._embed_weight, self._block_ids[:rows]).to(self.dtype)
        if self.cfg.input_embedding_scale != 1.0:
            h = h * self.cfg.input_embedding_scale
        q_pos = (start if pos_t is None else pos_t) + self._block_offsets[:rows]
        biases = self.drafter.attn_biases(q_pos, torch.cat([self.window.positions, q_pos]))
        cs = self.rope.angles(start, rows, pos_t, h.dtype)      # block rows: queries and own keys alike
        keys, values = self.window.keys, self.window.values
        if rows < self.block_size:     # the window and the first scratch rows: the block's K/V go right after it
            keys, values = keys[:, :self.window.capacity + rows], values[:, :self.window.capacity + rows]
        return self.drafter.block_forward(h, keys, values, biases, cs)

    # -- graph mode ---------------------------------------------------------------------------------------------
    def _static_draft(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Graph body: all ``bs-1`` draft scores (head dtype) and tokens of the block at the device position."""
        scores = self._head(self._block_forward(0, self._pos)[1:])
        return scores, row_argmax(scores)

    def _run_static(self, anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Host -> device writes, no sync. A fill of a one-element view: item assignment (``ids[0] = anchor``) goes
        # through torch's indexing machinery, tens of microseconds of host time in front of the block's launch.
        self._block_ids[:1].fill_(anchor)
        self._pos.fill_(self.window.end)
        if self.target.device.type != "cuda":
            return self._static_draft()  # CPU: the same device-position path, eagerly (tests cover it)
        if self._graph is None:
            self._capture()
        self._graph.replay()
        return self._static_out

    def _capture(self) -> None:
        # The block forward writes only the scratch K/V rows, so warming up and capturing mid-request leave the
        # window untouched.
        self._graph, self._static_out = capture_graph(self._static_draft)

    def _append_body(self, rows: int) -> None:
        """Graph body of an append of ``rows`` tap rows from the static input at the device position."""
        feats, keys, values = self._context_kv(self._append_in[rows], 0, self._append_pos)
        self.window.write_at(self._append_pos, feats, keys, values)

    def _append_static(self, taps: torch.Tensor, start: int) -> None:
        rows = taps.shape[0]
        self.window.check_next(start)
        buf = self._append_in.get(rows)
        if buf is None:
            buf = self._append_in[rows] = torch.empty_like(taps)
        buf.copy_(taps)
        self._append_pos.fill_(start)
        if self.target.device.type != "cuda":
            self._append_body(rows)
        else:
            graph = self._append_graphs.get(rows)
            if graph is None:
                # Warm-up runs write exactly the rows this append writes (same input, same position), so
                # capturing on first use is harmless; the replay below writes them once more.
                graph = self._append_graphs[rows] = capture_graph(lambda: self._append_body(rows))[0]
            # Replayed at once: the session commits at the start of the draft stage, so the device runs the
            # append while the host prepares the propose.
            graph.replay()
        self.window.advance(start, rows)

    def _append(self, taps: torch.Tensor, start: int) -> None:
        """Turn tap rows of positions ``start ..`` into features, their per-layer K/V, and store them."""
        W = self.window.capacity
        if self.cuda_graphs and taps.shape[0] <= min(W, self.block_size):   # a cycle's rows (not the seed)
            self._append_static(taps, start)
            return
        if taps.shape[0] > W:          # only the newest W survive the append: skip computing the rest
            start += taps.shape[0] - W
            taps = taps[-W:]
        self.window.append(start, *self._context_kv(taps, start))

    def _context_kv(self, taps: torch.Tensor, start: int, pos_t: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tap rows of positions ``start ..`` (or ``pos_t[0] ..``) -> the drafter's context features and per-layer
        K/V (:meth:`DFlashDraftModel.context_kv`), with the taps in config order and the rows' rotary angles."""
        if self._tap_order is not None:
            taps = taps[:, self._tap_order]
        cs = self.rope.angles(start, taps.shape[0], pos_t, self.dtype)
        return self.drafter.context_kv(taps.to(self.dtype), cs, self._context_k_norm)

    def _require_taps(self, out: ForwardOutput, rows: int, what: str) -> torch.Tensor:
        if out.taps is None or out.taps.shape[1] != len(self.taps):
            raise RuntimeError(f"dflash needs the {what} forward to capture target layers {self.taps}; got "
                               f"{None if out.taps is None else out.taps.shape[1]} tapped layer(s)")
        if out.taps.shape[0] < rows:
            raise RuntimeError(f"dflash needs {rows} tapped row(s) from the {what} forward, got {out.taps.shape[0]}")
        return out.taps

    # -- inspection (tests, debugging) -------------------------------------------------------------------------------
    def window_tokens(self) -> list[int]:
        """Token ids whose features the window holds, oldest first."""
        return self.history[self.window.end - self.window.length:self.window.end]


def _gathered_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a head weight as a new, small weight of the same format (dense rows, or GGUF blocks with
    the same product kernel): an ``ids``-row copy, not a second copy of the head."""
    from edgespec.weights.gguf import GGUFBlockWeight

    if not is_packed(weight):
        return weight.index_select(0, ids).contiguous()
    if isinstance(weight, GGUFBlockWeight):
        rows = type(weight)(weight.blocks.index_select(0, ids), ids.numel(), weight.in_features,
                            weight.compute_dtype)
        rows.kernel = weight.kernel
        return rows
    raise ValueError(f"a draft vocabulary needs a dense or GGUF head; this head is {type(weight).__name__}")


__all__ = ["DFlashProposer"]
