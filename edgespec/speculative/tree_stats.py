"""What became of every draft-tree node: per-node acceptance statistics and the drafter's calibration from them.

Each tree cycle starts from a *candidate* tree (what the proposer offered, before sizing by cost) of which some nodes
are verified. Under strict greedy acceptance the target's own continuation after the root is known up to one token
past the accepted path (the accepted drafts, then the token chosen after them), which decides most candidate nodes
whether they were verified or not: a node is right exactly when its parent is right (or is the root) and its token
is the target's next token there. Only the children of a right node that was sized out of the verify, one token past
the accepted path, stay unknown. So a session that verifies chains still learns what the tree's other nodes would
have brought, and a tree that would pay is found without verifying it first. Under sampling a node's fate is random,
so only verified nodes are counted (accepted = on the accepted path).

Nodes are counted by *class*: whether they lie on the chain of first choices ("chain") or beside it ("side"), and
their depth (the last depth bucket holds the deeper ones). :class:`NodeStats` keeps, per class, the nodes whose fate
is known, their summed joint draft probability (what a calibrated drafter expects to be right) and the right ones;
:meth:`NodeStats.factor` is right / expected (with one calibrated pseudo-node per class, so it starts at 1), the
correction the cost model applies to the drafter's joint probability of a node of that class
(:mod:`edgespec.speculative.tree_size`). The session keeps one decaying :class:`NodeStats` for its choices and one
plain count per request for telemetry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from edgespec.drafters.tree import DraftTree

DEPTH_BUCKETS = 8          # depths above this one share the last bucket
KINDS = ("chain", "side")


def node_classes(tree: DraftTree) -> list[tuple[str, int]]:
    """``(kind, depth bucket)`` of every node of ``tree``."""
    chain = tree.first_path().tolist()
    return [(KINDS[0] if on else KINDS[1], min(int(d), DEPTH_BUCKETS)) for on, d in zip(chain, tree.depths.tolist(),
                                                                                         strict=True)]


def node_outcomes(tree: DraftTree, verified: Sequence[bool], accepted_nodes: Sequence[int],
                  target_tokens: Sequence[int] | None) -> list[bool | None]:
    """Per node of the candidate ``tree``: True (right), False (wrong) or None (unknown).

    ``verified [N]``: which nodes the verify held; ``accepted_nodes``: the candidate indices of the accepted path
    (root excluded), in order; ``target_tokens``: the target's greedy continuation after the root (the accepted
    drafts then the next token), or None under sampling, where only verified nodes are decided."""
    n = tree.size
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    if target_tokens is None:
        on_path = set(accepted_nodes)
        return [(i in on_path) if verified[i] else None for i in range(n)]
    known = len(target_tokens)                     # the target's tokens at depths 1 .. known
    out: list[bool | None] = [None] * n
    for i in range(n):
        p, d = parents[i], depths[i]
        parent = True if p < 0 else out[p]
        if parent is False:
            out[i] = False
        elif parent is None:
            out[i] = None
        elif d <= known:
            out[i] = tokens[i] == target_tokens[d - 1]
        # a right parent at depth ``known`` (sized out of the verify): its children's fate is not known
    return out


@dataclass
class ClassCounts:
    """One node class: nodes of known fate, their summed joint probability, the right ones; and the verified
    nodes and how many of them were accepted."""

    nodes: float = 0.0
    joint: float = 0.0
    right: float = 0.0
    verified: float = 0.0
    accepted: float = 0.0

    def scale(self, by: float) -> None:
        self.nodes *= by
        self.joint *= by
        self.right *= by
        self.verified *= by
        self.accepted *= by


@dataclass
class NodeStats:
    """Per-class node counts (see the module doc); ``decay`` < 1 weighs recent cycles most (each cycle scales the
    earlier counts by it), 1 keeps plain counts (telemetry)."""

    decay: float = 1.0
    classes: dict[tuple[str, int], ClassCounts] = field(default_factory=dict)
    cycles: int = 0

    def record(self, tree: DraftTree, verified: Sequence[bool], outcomes: Sequence[bool | None],
               accepted_nodes: Sequence[int]) -> None:
        """One cycle of candidate ``tree``: which nodes were verified, each node's fate, the accepted path."""
        if self.decay < 1.0:
            for c in self.classes.values():
                c.scale(self.decay)
        self.cycles += 1
        joint = tree.joint_probs().tolist()
        on_path = set(accepted_nodes)
        for i, key in enumerate(node_classes(tree)):
            c = self.classes.setdefault(key, ClassCounts())
            if outcomes[i] is not None:
                c.nodes += 1
                c.joint += joint[i]
                c.right += bool(outcomes[i])
            if verified[i]:
                c.verified += 1
                c.accepted += i in on_path

    def factor(self, key: tuple[str, int]) -> float:
        """Right / expected for nodes of class ``key``, from one calibrated pseudo-node (1 at the start)."""
        c = self.classes.get(key)
        if c is None:
            return 1.0
        return (c.right + 1.0) / (c.joint + 1.0)

    def estimates(self, tree: DraftTree) -> torch.Tensor:
        """``[N]`` each node's chance of being right: its joint probability times its class's factor, never above
        its parent's (a node is right only with its parent) nor 1."""
        joint = tree.joint_probs().tolist()
        parents = tree.parents.tolist()
        out: list[float] = []
        for i, key in enumerate(node_classes(tree)):
            cap = 1.0 if parents[i] < 0 else out[parents[i]]
            out.append(min(cap, joint[i] * self.factor(key)))
        return torch.tensor(out, dtype=torch.float32)

    def add(self, other: NodeStats) -> None:
        """Add ``other``'s counts to these (a request's into a total)."""
        self.cycles += other.cycles
        for key, c in other.classes.items():
            mine = self.classes.setdefault(key, ClassCounts())
            mine.nodes += c.nodes
            mine.joint += c.joint
            mine.right += c.right
            mine.verified += c.verified
            mine.accepted += c.accepted

    def to_dict(self) -> dict[str, dict[str, float]]:
        """``{"chain@1": {...}, "side@2": {...}}``: per class the counts, rounded (the JSON telemetry)."""
        out = {}
        for (kind, depth), c in sorted(self.classes.items()):
            label = f"{kind}@{depth}" + ("+" if depth == DEPTH_BUCKETS else "")
            out[label] = {"nodes": round(c.nodes, 2), "joint": round(c.joint, 3), "right": round(c.right, 2),
                          "verified": round(c.verified, 2), "accepted": round(c.accepted, 2)}
        return out
