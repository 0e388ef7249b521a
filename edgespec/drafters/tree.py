"""Draft trees: several continuations verified in one target forward (tree verification).

A tree is a set of draft nodes below the *root*, the token the next verify starts from (the last emitted token).
Node ``i`` carries its token, its parent (``-1`` = the root, else an earlier node), its depth (1 for the root's
children) and the drafter's probability of its token given its parent's path. Nodes are kept in depth-first
pre-order, so every parent comes before its children: the verify forward can then treat the tree like a chain
whose causal mask is replaced by the ancestor mask (see :mod:`edgespec.kernels.verify.tree`), and triangular systems
stay triangular. Sibling tokens are distinct (a duplicate would be verified twice and break the multi-draft
sampling rule of :mod:`edgespec.speculative.tree_accept`).

Verify rows: row 0 is the root, row ``i + 1`` is node ``i``. :meth:`DraftTree.row_parents` and
:meth:`DraftTree.row_depths` give the per-row view the forward takes.

Builders:

* :func:`chain_tree` -- a chain of drafts is the one-branch tree.
* :func:`tree_from_logits` -- a block drafter's per-position logits (DFlash: row ``d`` scores the token at depth
  ``d + 1`` independently of the tokens before it), expanded best-first by joint probability under a node budget
  (DDTree).
* :func:`tree_from_branches` -- whole continuations with a weight (n-gram or suffix lookups: each earlier
  occurrence of the current suffix proposes what followed it; :class:`Branch` is the interface a lookup drafter
  hands over), merged into a trie, heaviest first, under the budget.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgespec.errors import ConfigError

# Largest node budget: a tree forward takes at most 64 rows (the root + 63 nodes), the width of the ancestor bit
# masks the Triton attention reads (edgespec.kernels.verify.tree.MAX_TREE_ROWS).
MAX_TREE_BUDGET = 63
# ``draft_tree: auto`` where the arch names no budget of its own (``ArchDefaults.tree_budget``).
AUTO_TREE_BUDGET = 32


@dataclass(frozen=True)
class Branch:
    """One continuation a lookup drafter proposes: ``tokens`` in order and how much evidence backs it (``count``:
    how many earlier occurrences of the current suffix were followed by these tokens; any positive weight works)."""

    tokens: tuple[int, ...]
    count: float = 1.0


@dataclass(frozen=True)
class DraftTree:
    """Draft nodes in depth-first pre-order (see the module doc). ``tokens``, ``parents``, ``depths`` ``[N]`` int64,
    ``probs [N]`` float32, all on the CPU (a tree is small; the verify copies the tokens to the device once)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    probs: torch.Tensor

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        for name in ("parents", "depths", "probs"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"draft tree: {name} has shape {tuple(getattr(self, name).shape)}, tokens ({n},)")
        parents = self.parents.tolist()
        depths = self.depths.tolist()
        seen: set[tuple[int, int]] = set()
        for i, (p, d) in enumerate(zip(parents, depths, strict=True)):
            if not -1 <= p < i:
                raise ValueError(f"draft tree: node {i} has parent {p}; parents must come first (pre-order)")
            if d != (1 if p < 0 else depths[p] + 1):
                raise ValueError(f"draft tree: node {i} has depth {d}, its parent {p} says otherwise")
            key = (p, int(self.tokens[i]))
            if key in seen:
                raise ValueError(f"draft tree: node {i} repeats token {key[1]} among its siblings")
            seen.add(key)

    @property
    def size(self) -> int:
        """Draft nodes (the verify forward has ``size + 1`` rows)."""
        return self.tokens.shape[0]

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if self.size else 0

    @property
    def is_chain(self) -> bool:
        """True when every node is the child of the one before it (a plain draft chain)."""
        return bool((self.parents == torch.arange(-1, self.size - 1)).all())

    def joint_probs(self) -> torch.Tensor:
        """``[N]`` product of the draft probabilities along each node's path: the drafter's chance that the whole
        path is right (its expected share of the acceptance length, for a calibrated drafter)."""
        joint = self.probs.clone()
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                joint[i] *= joint[p]
        return joint

    def pruned(self, max_depth: int, max_nodes: int, min_joint: float = 0.0) -> DraftTree | None:
        """The nodes of depth at most ``max_depth`` and joint probability at least ``min_joint`` among the first
        ``max_nodes`` (pre-order, and a parent's joint probability is at least its child's: every kept node keeps
        its parent); None when none is left."""
        keep = (self.depths <= max_depth) & (torch.arange(self.size) < max_nodes)
        if min_joint > 0:
            keep &= self.joint_probs() >= min_joint
        return self.subset(keep)

    def likeliest(self, n: int) -> DraftTree | None:
        """The ``n`` nodes of highest joint probability (ties: the earlier node in pre-order, so a parent, whose
        joint probability is at least its child's, always goes before it and the kept nodes form a tree)."""
        if n >= self.size:
            return self
        order = torch.sort(-self.joint_probs(), stable=True).indices
        keep = torch.zeros(self.size, dtype=torch.bool)
        keep[order[:n]] = True
        return self.subset(keep)

    def subset(self, keep: torch.Tensor) -> DraftTree | None:
        """The nodes where ``keep [N]`` (bool) is set, renumbered; every kept node's parent must be kept too.
        None when none is kept."""
        if bool(keep.all()):
            return self
        if not bool(keep.any()):
            return None
        new_index = torch.cumsum(keep.long(), 0) - 1
        parents = self.parents[keep]
        parents = torch.where(parents < 0, parents, new_index[parents.clamp_min(0)])
        return DraftTree(self.tokens[keep], parents, self.depths[keep], self.probs[keep])

    def row_parents(self) -> torch.Tensor:
        """Parent row of every verify row ``[N + 1]`` (row 0, the root: -1)."""
        return torch.cat([torch.tensor([-1]), self.parents + 1])

    def row_depths(self) -> torch.Tensor:
        """Depth of every verify row ``[N + 1]`` (row 0, the root: 0): its position is the verify start + depth."""
        return torch.cat([torch.tensor([0]), self.depths])

    def children(self) -> list[list[int]]:
        """Child rows of every row (row 0 = the root), in node order (the builders put the likeliest first)."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i + 1)
        return out

    def path_to(self, row: int) -> list[int]:
        """Rows from the root (row 0) down to ``row``, both included."""
        parents = self.row_parents().tolist()
        path = [row]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        return path[::-1]

    def first_path(self) -> torch.Tensor:
        """``[N]`` bool: the nodes on the path that always takes the first child (what a chain would verify)."""
        mask = torch.zeros(self.size, dtype=torch.bool)
        kids = self.children()
        row = 0
        while kids[row]:
            row = kids[row][0]
            mask[row - 1] = True
        return mask

    def first_chain(self) -> torch.Tensor:
        """Tokens of the path that always takes the first child: what a chain drafter would have proposed."""
        kids = self.children()
        row, out = 0, []
        while kids[row]:
            row = kids[row][0]
            out.append(int(self.tokens[row - 1]))
        return torch.tensor(out, dtype=torch.long)


def _from_nodes(nodes: Sequence[tuple[int, int, float]]) -> DraftTree:
    """A tree from ``(parent, token, prob)`` triples in any order where parents come first; reordered into
    depth-first pre-order keeping each node's children in the given order."""
    kids: list[list[int]] = [[] for _ in range(len(nodes) + 1)]
    for i, (p, _, _) in enumerate(nodes):
        kids[p + 1].append(i)
    order: list[int] = []
    new_index: dict[int, int] = {}
    stack = list(reversed(kids[0]))
    while stack:
        i = stack.pop()
        new_index[i] = len(order)
        order.append(i)
        stack.extend(reversed(kids[i + 1]))
    parents, depths, tokens, probs = [], [], [], []
    for i in order:
        p, tok, prob = nodes[i]
        np_ = -1 if p < 0 else new_index[p]
        parents.append(np_)
        depths.append(1 if np_ < 0 else depths[np_] + 1)
        tokens.append(tok)
        probs.append(prob)
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                     torch.tensor(depths, dtype=torch.long), torch.tensor(probs, dtype=torch.float32))


def chain_tree(tokens: torch.Tensor | Sequence[int], probs: torch.Tensor | None = None) -> DraftTree:
    """A draft chain as the one-branch tree (``probs``: the draft probability of each token, else 1)."""
    toks = torch.as_tensor(tokens, dtype=torch.long).cpu().view(-1)
    n = toks.shape[0]
    p = torch.ones(n) if probs is None else torch.as_tensor(probs, dtype=torch.float32).cpu().view(-1)
    return DraftTree(toks, torch.arange(-1, n - 1), torch.arange(1, n + 1), p)


def tree_setting(setting: int | str | None, auto_min_joint: float, auto_budget: int = AUTO_TREE_BUDGET
                 ) -> tuple[int | None, float]:
    """``(budget, least joint probability)`` of a ``draft_tree`` setting: ``off`` -> (None, 0: chains); a whole
    number -> that budget, every node kept; ``auto`` -> ``auto_budget`` and ``auto_min_joint`` (the arch's; the
    session then sizes each tree by cost under that budget, :mod:`edgespec.speculative.tree_size`)."""
    budget = tree_budget(setting, auto_budget)
    auto = isinstance(setting, str) and setting.strip().lower() == "auto"
    return budget, auto_min_joint if auto else 0.0


def tree_budget(setting: int | str | None, auto_budget: int = AUTO_TREE_BUDGET) -> int | None:
    """The node budget a ``draft_tree`` setting asks for: None for ``off`` (chains), a whole number from 1 to
    :data:`MAX_TREE_BUDGET`, or ``auto`` (``auto_budget``). Anything else is refused by name."""
    word = setting.strip().lower() if isinstance(setting, str) else setting
    # YAML reads a bare ``off`` as false, which the settings then hold as the string "False".
    if word is None or word in ("off", "false", "none"):
        return None
    if word == "auto":
        return check_budget(auto_budget)
    value = word
    if isinstance(word, str):
        try:
            value = int(word)
        except ValueError:
            raise ConfigError(f"draft_tree {setting!r} must be off, auto or a node budget from 1 to "
                              f"{MAX_TREE_BUDGET}") from None
    check_budget(value)
    if value > MAX_TREE_BUDGET:
        raise ConfigError(f"draft_tree budget {value} is above the largest tree forward: {MAX_TREE_BUDGET} nodes "
                          f"(+ the root = {MAX_TREE_BUDGET + 1} verify rows)")
    return value


def check_budget(budget: int) -> int:
    """A node budget must be a positive whole number; returns it."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ConfigError(f"draft_tree budget {budget!r} must be a whole number >= 1")
    return budget


def tree_from_logits(logits: torch.Tensor, budget: int, max_children: int = 8, spine_only: bool = False,
                     chain_first: bool = False) -> DraftTree:
    """Best-first tree from per-depth draft logits ``[D, V]`` (row ``d`` scores the token at depth ``d + 1``).

    A node's score is the joint probability of its path, the product of the per-depth softmax probabilities of its
    tokens. Expansion is the DDTree frontier: starting from the root's best child, each popped node offers two
    candidates, its own best child (next depth, rank 0) and its next sibling (same depth, next rank), so the
    ``budget`` nodes taken are exactly the ``budget`` most probable paths-prefixes that form a tree. ``max_children``
    caps the ranks tried per depth (the top-k read from each row).

    ``spine_only``: only the chain of first choices has children, every other node is a leaf -- for an
    autoregressive drafter (MTP), whose row ``d`` was computed after the first-choice tokens only, so its top-k are
    the right alternatives there and nowhere else.

    ``chain_first``: the chain of first choices (all ``D`` depths, cut at the budget) is taken before the
    best-first expansion fills the rest of the budget: the tree then holds everything a chain verify would, and a
    tree sized by cost (:mod:`edgespec.speculative.tree_size`) adds only the other nodes worth their rows."""
    check_budget(budget)
    if logits.dim() != 2 or logits.shape[0] == 0:
        raise ValueError(f"tree_from_logits needs logits [depth, vocab], got {tuple(logits.shape)}")
    width = min(max_children, logits.shape[1], budget)
    top_p, top_i = torch.softmax(logits.float(), dim=-1).topk(width, dim=-1)      # [D, width]
    logp = top_p.clamp_min(1e-30).log().tolist()
    ids = top_i.tolist()
    probs = top_p.tolist()
    D = logits.shape[0]
    nodes: list[tuple[int, int, float]] = []
    # Heap entries: (-joint log prob, tie order, parent node, depth index, rank, parent's joint log prob).
    heap: list[tuple[float, int, int, int, int, float]] = []
    spine = {-1}                                                   # the first-choice chain (and the root)
    tie = 0

    def push(neg: float, parent: int, d: int, rank: int, base: float) -> None:
        nonlocal tie
        heapq.heappush(heap, (neg, tie, parent, d, rank, base))
        tie += 1

    def take(neg: float, parent: int, d: int, rank: int, base: float, child: bool) -> None:
        """Add the node and offer its next sibling and (``child``) its best child."""
        nodes.append((parent, ids[d][rank], probs[d][rank]))
        me = len(nodes) - 1
        if rank == 0 and parent in spine:
            spine.add(me)
        if rank + 1 < width:                                       # next sibling: same parent, next rank
            push(-(base + logp[d][rank + 1]), parent, d, rank + 1, base)
        if child and d + 1 < D and (me in spine or not spine_only):    # best child: next depth, rank 0
            push(neg - logp[d + 1][0], me, d + 1, 0, -neg)

    if chain_first:
        neg = 0.0
        for d in range(min(D, budget)):
            last = d == min(D, budget) - 1                         # only the chain's end offers its child
            take(neg - logp[d][0], len(nodes) - 1, d, 0, -neg, last)
            neg -= logp[d][0]
    else:
        push(-logp[0][0], -1, 0, 0, 0.0)
    while heap and len(nodes) < budget:
        neg, _, parent, d, rank, base = heapq.heappop(heap)
        take(neg, parent, d, rank, base, True)
    return _from_nodes(nodes)


def tree_from_branches(branches: Sequence[Branch], budget: int) -> DraftTree:
    """Merge continuations into a trie under ``budget`` nodes: heaviest branch first (ties keep the given order),
    each adding the nodes it does not share with the branches before it, the last one cut at the budget.

    A node's draft probability is its subtree's weight over its siblings' total weight (what the counts say the
    lookup believes); siblings are ordered heaviest first, so the first-child path is the heaviest branch."""
    check_budget(budget)
    for b in branches:
        if not b.count > 0:
            raise ValueError(f"branch {b.tokens[:8]}... has weight {b.count}; weights must be positive")
    order = sorted(range(len(branches)), key=lambda i: -branches[i].count)
    # Trie: (parent node, token) -> node; weight per node.
    index: dict[tuple[int, int], int] = {}
    parent_of: list[int] = []
    token_of: list[int] = []
    weight: list[float] = []
    for bi in order:
        b = branches[bi]
        parent = -1
        for tok in b.tokens:
            key = (parent, int(tok))
            node = index.get(key)
            if node is None:
                if len(token_of) >= budget:
                    break
                node = index[key] = len(token_of)
                parent_of.append(parent)
                token_of.append(int(tok))
                weight.append(0.0)
            weight[node] += b.count
            parent = node
    if not token_of:
        raise ValueError("tree_from_branches needs at least one non-empty branch")
    total: dict[int, float] = {}
    for node, p in enumerate(parent_of):
        total[p] = total.get(p, 0.0) + weight[node]
    # Children heaviest first (stable: on ties the earlier-inserted, i.e. heavier branch, stays first).
    nodes = [(parent_of[i], token_of[i], weight[i] / total[parent_of[i]]) for i in range(len(token_of))]
    # Parents before children (by depth), siblings heaviest first; _from_nodes keeps that sibling order.
    order = sorted(range(len(nodes)), key=lambda i: (_depth(parent_of, i), -weight[i], i))
    remap = {old: new for new, old in enumerate(order)}
    reordered = [(-1 if nodes[old][0] < 0 else remap[nodes[old][0]], nodes[old][1], nodes[old][2]) for old in order]
    return _from_nodes(reordered)


def _depth(parent_of: list[int], node: int) -> int:
    d = 1
    while parent_of[node] >= 0:
        node = parent_of[node]
        d += 1
    return d
