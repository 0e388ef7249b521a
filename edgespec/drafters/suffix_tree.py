"""A depth-bounded suffix trie with occurrence counts, and the pure functions that draft from it.

Every substring of up to ``max_depth`` tokens of the stored sequences is a path from the root; a node's count is
how many times its path occurs (one per start position, summed over sequences; sequences never join across their
ends). So for a matched context ``s`` and a child token ``t``, ``count(s + t) / count(s)`` is how often ``t``
followed ``s``: the frequency SuffixDecoding (arXiv 2411.04975) drafts from. Sequences can be removed again (counts
go down, empty subtrees are freed), which a suffix automaton cannot do; that is what lets a cache evict its oldest
outputs.

The drafting functions (:func:`match_suffix`, :func:`greedy_draft`, :func:`suffix_branches`,
:func:`draft_budget`) only read the trie. Worked examples build one from a few token lists.
"""

from __future__ import annotations

import heapq
import math
import sys
from array import array
from collections.abc import Iterable, Sequence

# Bytes of one int object past the small-int cache (a token id, a node id, a packed edge); measured, not assumed.
_INT_BYTES = sys.getsizeof(1 << 40)
_SHIFT = 32                        # a packed edge: token << 32 | child (node ids stay below 2**32)
_MASK = (1 << _SHIFT) - 1


class SuffixTrie:
    """Counts of every substring of at most ``max_depth`` tokens of the sequences added, removable again.

    Node 0 is the root (count = tokens stored); ``counts[v]`` is the path's occurrence count. ``children[v]`` is
    None for a leaf, one packed int ``token << 32 | child`` for a node with one child, a dict token -> child for
    more: most nodes of a suffix trie sit on single-child chains, and a dict each would cost about five times the
    memory. Read it through :meth:`child` and :meth:`items`. Freed node ids are reused.
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"suffix trie max_depth {max_depth} must be >= 2 (a match and one continuation token)")
        self.max_depth = max_depth
        self.children: list[dict[int, int] | int | None] = [None]
        self.counts = array("q", [0])
        self._free: list[int] = []
        self._edge_bytes = 0        # every children dict (sys.getsizeof, kept as they grow) and edge int object
        self.edges = 0

    @property
    def nodes(self) -> int:
        return len(self.children) - len(self._free)

    @property
    def free_slots(self) -> int:
        """Node slots freed by :meth:`remove` and not yet reused."""
        return len(self._free)

    def nbytes(self) -> int:
        """Memory held: the two node arrays, the free list, every children dict and edge int object."""
        return (sys.getsizeof(self.children) + self.counts.buffer_info()[1] * self.counts.itemsize
                + self._edge_bytes + sys.getsizeof(self._free))

    def child(self, v: int, token: int) -> int | None:
        """The child of ``v`` on ``token`` (None when ``v`` never continued with it)."""
        kids = self.children[v]
        if kids is None:
            return None
        if type(kids) is int:
            return kids & _MASK if kids >> _SHIFT == token else None
        return kids.get(token)

    def items(self, v: int) -> list[tuple[int, int]]:
        """``(token, child)`` of every child of ``v``."""
        kids = self.children[v]
        if kids is None:
            return []
        if type(kids) is int:
            return [(kids >> _SHIFT, kids & _MASK)]
        return list(kids.items())

    # -- building -----------------------------------------------------------------------------------------------
    def _new_child(self, v: int, token: int) -> int:
        """Create the child of ``v`` on ``token`` (count 0)."""
        if self._free:
            c = self._free.pop()
            self.children[c] = None
            self.counts[c] = 0
        else:
            c = len(self.children)
            self.children.append(None)
            self.counts.append(0)
        kids = self.children[v]
        if kids is None:
            self.children[v] = token << _SHIFT | c
            self._edge_bytes += _INT_BYTES
        else:
            if type(kids) is int:        # a second child: the packed edge becomes a dict
                kids = self.children[v] = {kids >> _SHIFT: kids & _MASK}
                self._edge_bytes += sys.getsizeof(kids) + _INT_BYTES   # the packed int gave way to key + value
            before = sys.getsizeof(kids)
            kids[token] = c
            self._edge_bytes += sys.getsizeof(kids) - before + 2 * _INT_BYTES
        self.edges += 1
        return c

    def extend(self, active: list[int], token: int) -> list[int]:
        """Count one more token of a sequence. ``active[j]`` is the node of the sequence's last ``j + 1`` tokens
        (from the previous call; [] at a sequence start); returns the new ``active``. Each call counts the new
        token in every suffix of up to ``max_depth`` tokens that ends with it."""
        children, counts = self.children, self.counts
        counts[0] += 1
        out = []
        # The hot loop of the drafter's bookkeeping: an existing child is one lookup (packed edge or dict).
        for v in [0] + active[:self.max_depth - 1]:
            kids = children[v]
            if kids is None:
                c = None
            elif type(kids) is int:
                c = kids & _MASK if kids >> _SHIFT == token else None
            else:
                c = kids.get(token)
            if c is None:
                c = self._new_child(v, token)
            counts[c] += 1
            out.append(c)
        return out

    def add(self, tokens: Iterable[int]) -> None:
        """Count every substring of up to ``max_depth`` tokens of one sequence."""
        active: list[int] = []
        for t in tokens:
            active = self.extend(active, int(t))

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo :meth:`add` of the same sequence: counts go down, paths that reach 0 are freed."""
        n = len(tokens)
        self.counts[0] -= n
        for i in range(n):
            v = 0
            for t in tokens[i:i + self.max_depth]:
                t = int(t)
                c = self.child(v, t)
                self.counts[c] -= 1
                if self.counts[c] == 0:
                    # Every count below c is at most c's (each occurrence counts all its prefixes): all free.
                    self._detach(v, t)
                    self._release(c)
                    break
                v = c

    def _detach(self, v: int, token: int) -> None:
        """Drop the edge ``v -token->`` (its subtree is released by the caller)."""
        kids = self.children[v]
        if type(kids) is int:
            self.children[v] = None
            self._edge_bytes -= _INT_BYTES
        else:
            before = sys.getsizeof(kids)
            del kids[token]
            self._edge_bytes += sys.getsizeof(kids) - before - 2 * _INT_BYTES
            if not kids:                 # a leaf again: None, as every leaf (readers test for it)
                self._edge_bytes -= sys.getsizeof(kids)
                self.children[v] = None
        self.edges -= 1

    def _release(self, v: int) -> None:
        stack = [v]
        while stack:
            u = stack.pop()
            kids = self.children[u]
            if type(kids) is int:
                stack.append(kids & _MASK)
                self._edge_bytes -= _INT_BYTES
                self.edges -= 1
            elif kids is not None:
                stack.extend(kids.values())
                self._edge_bytes -= sys.getsizeof(kids) + 2 * _INT_BYTES * len(kids)
                self.edges -= len(kids)
            self.children[u] = None
            self.counts[u] = 0
            self._free.append(u)

    # -- reading ------------------------------------------------------------------------------------------------
    def walk(self, path: Sequence[int]) -> int | None:
        """The node of ``path`` (None when it never occurred)."""
        v: int | None = 0
        for t in path:
            v = self.child(v, int(t))
            if v is None:
                return None
        return v


def match_suffix(trie: SuffixTrie, context: Sequence[int], max_match: int, min_match: int = 1) -> tuple[int, int]:
    """``(node, length)`` of the longest suffix of ``context`` (``min_match`` to ``max_match`` tokens) that occurs
    in ``trie`` and was followed by something; ``(0, 0)`` when none does.

    Worked example: a trie of ``[5, 6, 7, 5, 6, 8]`` and context ``[1, 5, 6]``: the suffix ``[1, 5, 6]`` never
    occurred, ``[5, 6]`` did (twice, followed by 7 and by 8), so the match has length 2:

    >>> t = SuffixTrie(8); t.add([5, 6, 7, 5, 6, 8])
    >>> node, n = match_suffix(t, [1, 5, 6], max_match=4); n, t.counts[node]
    (2, 2)
    """
    L = len(context)
    for n in range(min(max_match, L, trie.max_depth - 1), min_match - 1, -1):
        v = trie.walk(context[L - n:])
        if v is not None and trie.children[v] is not None:
            return v, n
    return 0, 0


def draft_budget(match_len: int, k: int, factor: float, offset: int = 0) -> int:
    """Draft tokens worth proposing after a match of ``match_len`` tokens: ``factor * match_len + offset``, within
    0..k. A long match predicts far (the context is pinned down); a one-token match predicts the next token only.

    >>> draft_budget(2, k=8, factor=1.5), draft_budget(10, k=8, factor=1.5), draft_budget(0, k=8, factor=1.5)
    (3, 8, 0)
    """
    if match_len <= 0:
        return 0
    return max(0, min(k, math.floor(factor * match_len) + offset))


def _ranked(trie: SuffixTrie, v: int) -> list[tuple[int, int, int]]:
    """``(count, token, child)`` of ``v``'s children, most frequent first (ties: the lower token id)."""
    return sorted(((trie.counts[c], t, c) for t, c in trie.items(v)), key=lambda x: (-x[0], x[1]))


def _followed(trie: SuffixTrie, v: int) -> int:
    """How many occurrences of ``v``'s path were followed by a token: the base of every share. (An occurrence at
    a sequence's end, like the current context itself in the request's trie, says nothing about what comes next.)"""
    return sum(trie.counts[c] for _, c in trie.items(v))


def greedy_draft(trie: SuffixTrie, node: int, max_len: int, min_prob: float = 0.0) -> tuple[list[int], float]:
    """The most frequent continuation after ``node``: each step takes the most frequent child while its share of
    the match's continued occurrences, ``count(child) / followed(node)``, stays at least ``min_prob``. Returns
    the tokens and their expected number of accepted tokens under those frequencies (the sum of the shares), a
    score to compare drafts from two tries.

    Worked example, ``[5, 6, 7, 9, 5, 6, 7, 9, 5, 6, 8]`` matched on ``[5, 6]`` (3 occurrences): 7 followed twice
    and 8 once; then 9, 5 and 6 followed both times (2/3 each), then 7 and 8 once each (1/3, under the bar of
    ``min_prob = 0.5``):

    >>> t = SuffixTrie(8); t.add([5, 6, 7, 9, 5, 6, 7, 9, 5, 6, 8])
    >>> draft, score = greedy_draft(t, t.walk([5, 6]), max_len=6, min_prob=0.5); draft, round(score, 3)
    ([7, 9, 5, 6], 2.667)
    """
    total = _followed(trie, node)
    out: list[int] = []
    score = 0.0
    v = node
    counts = trie.counts
    while len(out) < max_len and total > 0:
        kids = trie.items(v)
        if not kids:
            break
        # the most frequent child, ties to the lower token id (as _ranked orders them), without sorting them all
        token, c = max(kids, key=lambda tc: (counts[tc[1]], -tc[0]))
        count = counts[c]
        if count / total < min_prob:
            break
        out.append(token)
        score += count / total
        v = c
    return out, score


def suffix_branches(trie: SuffixTrie, node: int, max_len: int, max_branches: int,
                    min_prob: float = 0.0) -> list[tuple[list[int], int]]:
    """Up to ``max_branches`` continuations after ``node`` with their occurrence counts, most frequent first: the
    leaves of a best-first expansion (a path is extended by each of its ``max_branches`` most frequent children
    whose share ``count / followed(node)`` is at least ``min_prob``, up to ``max_len`` tokens). A tree verifier
    (``edgespec.drafters.tree``) merges them into one draft tree; the first is where most occurrences went.

    Worked example, the same trie as :func:`greedy_draft`: after ``[5, 6]`` came ``7 9`` twice and ``8`` once:

    >>> t = SuffixTrie(8); t.add([5, 6, 7, 9, 5, 6, 7, 9, 5, 6, 8])
    >>> suffix_branches(t, t.walk([5, 6]), max_len=2, max_branches=3)
    [([7, 9], 2), ([8], 1)]
    """
    total = _followed(trie, node)
    if total <= 0 or max_len <= 0 or max_branches <= 0:
        return []
    heap: list[tuple[int, list[int], int]] = [(-total, [], node)]
    out: list[tuple[list[int], int]] = []
    while heap and len(out) < max_branches:
        neg, path, v = heapq.heappop(heap)
        kids = [] if len(path) >= max_len else [k for k in _ranked(trie, v)[:max_branches] if k[0] / total >= min_prob]
        if not kids:
            if path:
                out.append((path, -neg))
            continue
        for count, token, c in kids:
            heapq.heappush(heap, (-count, path + [token], c))
    return out
