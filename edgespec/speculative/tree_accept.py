"""Accepting a path of a verified draft tree.

The tree forward scores every verify row (row 0 = the root, row ``i + 1`` = node ``i`` of the
:class:`~edgespec.drafters.tree.DraftTree`); row r's logits give the target's distribution of the token after r's
path. Both rules walk down from the root and return the accepted path (rows, root first) and the committed tokens:
the accepted drafts, then one token from the last accepted row.

* Greedy: go to the child whose token is the target's argmax; stop where no child has it. The path is the one
  plain greedy decoding takes, so the output equals plain greedy decoding.
* Sampling: recursive rejection sampling over siblings (SpecInfer, multi-draft speculative sampling). At a row with
  target distribution p, try the children in order: child token x is accepted with probability
  ``p(x) / q(x)`` where q puts all its mass on x (the builders' drafts are deterministic: top-k or looked-up
  tokens, distinct among siblings), i.e. with probability p(x); on rejection p becomes ``normalise(p - q)``, p with
  x removed. When every child is rejected the next token is drawn from what is left of p. Each emitted token then
  has exactly the target's distribution given the tokens before it: x_1 comes out with probability p(x_1), x_2 with
  (1 - p(x_1)) p(x_2) / (1 - p(x_1)) = p(x_2), and so on; any other token with p(y) / (1 - sum p(x_i)) times the
  remaining mass. Stochastic drafts (children sampled from a distribution q) are not taken here: the rule would need
  their q rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgespec.drafters.tree import DraftTree
from edgespec.speculative.acceptance import AcceptancePolicy, RejectionSampling
from edgespec.speculative.sampling import target_probs


@dataclass
class TreeVerdict:
    """Accepted path of a tree verify: ``rows`` root first (``len(rows) - 1`` accepted drafts), ``tokens`` = the
    accepted drafts + the next token, ``sibling``: some accepted node was not its parent's first child (a chain of
    the first choices would have lost it)."""

    rows: list[int]
    tokens: list[int]
    sibling: bool

    @property
    def accepted(self) -> int:
        return len(self.rows) - 1


def greedy_tree_accept(logits: torch.Tensor, tree: DraftTree) -> TreeVerdict:
    """Longest path whose every token is the target argmax of its parent row (``logits [N + 1, V]``)."""
    targets = logits.argmax(-1).tolist()                        # one host copy
    tokens = tree.tokens.tolist()
    kids = tree.children()
    row, rows = 0, [0]
    while True:
        want = targets[row]
        nxt = next((c for c in kids[row] if tokens[c - 1] == want), None)
        if nxt is None:
            return path_verdict(tree, rows, want)
        rows.append(nxt)
        row = nxt


def path_verdict(tree: DraftTree, rows: list[int], next_token: int) -> TreeVerdict:
    """The verdict of an accepted path ``rows`` (root first) and the token after it: the tokens to commit and
    whether some accepted node was not its parent's first child. The captured tree verify hands its device-chosen
    path here (:mod:`edgespec.arch.tree_graphs`)."""
    tokens = tree.tokens.tolist()
    kids = tree.children()
    sibling = any(kids[a][0] != b for a, b in zip(rows, rows[1:], strict=False))
    return TreeVerdict(list(rows), [tokens[r - 1] for r in rows[1:]] + [next_token], sibling)


def sample_tree_accept(logits: torch.Tensor, tree: DraftTree, policy: RejectionSampling) -> TreeVerdict:
    """Recursive rejection sampling over siblings (see the module doc) with the policy's sampling parameters and
    generator."""
    p_all = target_probs(logits, policy.params)                 # [N + 1, V]
    tokens = tree.tokens.tolist()
    kids = tree.children()
    row, rows, sibling = 0, [0], False
    while True:
        p = p_all[row]
        taken = None
        for rank, c in enumerate(kids[row]):
            x = tokens[c - 1]
            px = float(p[x])
            u = float(torch.rand((), generator=policy.gen, device=p.device))
            if u < px:                                          # accept with probability p(x) / q(x), q one-hot
                taken = c
                sibling |= rank > 0
                break
            # Rejected: the residual max(p - q, 0) is p without x, renormalised.
            residual = p.clone()
            residual[x] = 0.0
            total = residual.sum()
            if not total > 0:
                break   # p was all on x, so x cannot be rejected but for rounding: keep p
            p = residual / total
        if taken is None:
            bonus = int(torch.multinomial(p, 1, generator=policy.gen))
            return TreeVerdict(rows, [tokens[r - 1] for r in rows[1:]] + [bonus], sibling)
        rows.append(taken)
        row = taken


def accept_tree(policy: AcceptancePolicy, logits: torch.Tensor, tree: DraftTree) -> TreeVerdict:
    """The tree rule of ``policy``: sampling for :class:`RejectionSampling`, strict greedy for every greedy policy
    (a tree is judged strictly: the relaxed thinking rule judges chains only)."""
    if isinstance(policy, RejectionSampling):
        return sample_tree_accept(logits, tree, policy)
    return greedy_tree_accept(logits, tree)
