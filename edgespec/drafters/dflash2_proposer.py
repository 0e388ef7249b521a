"""DFlash2 proposer: the DFlash proposer's block forward and context window, drafting the candidate selector's path.

Everything about the context window (one feature per committed token, seeded from the prompt tail, K/V computed
once per feature) and the block forward at the anchor's position is the DFlash proposer's
(:mod:`edgespec.drafters.dflash_proposer`); the network adds its convolutions inside the block forward
(:class:`~edgespec.drafters.dflash2_net.DFlash2DraftModel`). What changes is how the block's rows become drafts:
instead of each row's argmax, the head's top-``K`` tokens of every row are the candidates and the selector walks the
best path from the anchor (:mod:`edgespec.kernels.draft.selector`). The path is causal (position ``d`` depends only on
the choices before it), so a draft of ``k`` tokens is the path's first ``k``.

In graph mode the whole draft -- block forward, head, top-k, selector scores and walk -- is one CUDA graph at a
device-held position, as for DFlash. :attr:`last_candidates` keeps every position's candidates and scores for a
tree (:meth:`SelectorCandidates.tree`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgespec.drafters.base import Draft
from edgespec.drafters.dflash2_net import DFlash2DraftModel
from edgespec.drafters.dflash_proposer import DFlashProposer
from edgespec.drafters.tree import DraftTree, tree_from_logits
from edgespec.kernels.verify.argmax import row_argmax
from edgespec.models.decoder import TargetModel


@dataclass(frozen=True)
class SelectorCandidates:
    """The selector's view of one draft: per position ``d`` (depth ``d + 1``) the candidate tokens ``ids [D, K]``,
    their scores given the greedy path's predecessor ``scores [D, K]`` (fp32; the path takes each row's argmax) and
    the bilinear term of every step ``transitions [D, K, K]`` (``[d, p, c]``: from candidate ``p`` of position
    ``d - 1``, the anchor for ``d = 0``, to candidate ``c``), so a tree builder can score any parent. Views of
    the draft's buffers: valid until the next propose."""

    ids: torch.Tensor
    scores: torch.Tensor
    transitions: torch.Tensor

    def tree(self, budget: int, chain_first: bool = False) -> DraftTree:
        """A draft tree under ``budget`` nodes, best-first by the path-conditioned scores (softmax over each
        position's candidates); its first-child path is the selector's greedy path."""
        ids = self.ids.cpu()
        shape = tree_from_logits(self.scores.cpu(), budget, chain_first=chain_first)   # tokens = candidate indices
        tokens = ids[shape.depths - 1, shape.tokens]
        return DraftTree(tokens, shape.parents, shape.depths, shape.probs)


class DFlash2Proposer(DFlashProposer):
    """Drafts ``k <= block_size - 1`` tokens per cycle: the selector's greedy path through the head's top-k of the
    block rows. ``use_selector`` False drafts each row's argmax instead (the drafter as a DFlash drafter, for
    comparison). Window, seeding and graphs as :class:`DFlashProposer`."""

    name = "dflash2"

    def __init__(self, drafter: DFlash2DraftModel, target: TargetModel, *, window_size: int = 128,
                 window_seed: bool = True, cuda_graphs: bool = False, use_selector: bool = True) -> None:
        super().__init__(drafter, target, window_size=window_size, window_seed=window_seed, cuda_graphs=cuda_graphs)
        self.use_selector = use_selector
        self.top_k = min(drafter.cfg.selector_top_k, self._head_weight.shape[0])
        self.last_candidates: SelectorCandidates | None = None

    def reset(self) -> None:
        super().reset()
        self.last_candidates = None

    @torch.inference_mode()
    def propose(self, last_token: int, k: int) -> Draft | None:
        if not self.history or self.history[-1] != last_token or len(self.history) != self.window.end + 1:
            raise RuntimeError("dflash2 proposer out of step with the session: every emitted token must be "
                               "committed once, in order, before the next propose")
        k = min(k, self.block_size - 1)
        if self.cuda_graphs:
            raw, tokens, cands = self._run_static(last_token)
        else:
            raw, tokens, cands = self._draft_rows(self.block_hidden(last_token)[1:1 + k])
        self._last_scores = raw[:k]
        self.last_candidates = None if cands is None else SelectorCandidates(*(t[:k] for t in cands))
        return Draft(tokens[:k])

    def propose_tree(self, last_token: int, k: int, budget: int, chain_first: bool = False) -> DraftTree | None:
        """The selector's candidates expanded best-first under ``budget`` (one block forward, as for a chain); the
        first-child path is the chain :meth:`propose` returns."""
        self.propose(last_token, k)
        if self.last_candidates is None:
            return tree_from_logits(self.last_logits, budget, chain_first=chain_first)
        return self.last_candidates.tree(budget, chain_first=chain_first)

    # -- drafting -----------------------------------------------------------------------------------------------
    def _draft_rows(self, hidden: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Final-normed draft rows ``hidden [D, H]`` -> (head output in its dtype ``[D, V]``, draft tokens ``[D]``,
        the selector's ``(ids, scores, transitions)`` or None without the selector). No host sync."""
        raw = self._head(hidden)
        if not self.use_selector:
            return raw, row_argmax(raw), None
        drafter: DFlash2DraftModel = self.drafter
        # The multiplier (> 0) and the soft cap keep the order, so the top-k of the raw head output are the
        # drafter's top-k; only those K logits are scaled.
        top, ids = raw.topk(self.top_k, dim=-1)
        unary = drafter.head_scores(top)
        tokens, scores, trans = drafter.candidate_selector.candidates(hidden, self._block_ids[:1], ids, unary)
        return raw, tokens, (ids, scores, trans)

    def _static_draft(self):
        """Graph body: the draft of all ``bs - 1`` rows at the device position (see :meth:`_draft_rows`)."""
        return self._draft_rows(self._block_forward(0, self._pos)[1:])


__all__ = ["DFlash2Proposer", "SelectorCandidates"]
