"""Tokenise a growing conversation by re-encoding only what changed since the last request.

Every request of a multi-turn chat re-sends the whole conversation, and encoding its rendered text costs time in
proportion to all of it (docs/benchmarks.md, "CPU launch choices"): with prefix reuse the rest of a follow-up turn
scales with its new tokens, so this would be the largest cost left on a GPU.

Why a piece can be re-encoded alone: the ``tokenizers`` pipeline first cuts the text at every added special token
(``normalized: false``), then normalises and pre-tokenises each piece on its own. So the ids of the text before a
turn-start token (the chat template's, ``ChatTokenizer.turn_markers``: ChatML's ``<|im_start|>``) do not depend on
what follows it, and when a new rendering shares its first ``c`` characters with the last one, the ids before the
last turn-start token that starts inside those ``c`` characters can be kept and only the text from that token on
is encoded. :class:`ResumableEncoder` refuses (and always encodes everything) when the template has no turn-start
token, when the tokenizer has a step that treats the start of the input differently from the start of any other
piece (a normaliser that prepends, Metaspace ``prepend_scheme: first``) or a turn token that is normalised or
strips whitespace to its left.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from tokenizers import Tokenizer


def common_chars(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (slice compares in C, O(log n) of them)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:             # invariant: a[:lo] == b[:lo], a[:hi+1] != b[:hi+1] once hi moved
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _walk(node: Any):
    """Every dict inside a tokenizer.json sub-tree (Sequence normalisers/pre-tokenisers nest their steps)."""
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _component(part: Any) -> Any:
    """A normaliser / pre-tokeniser as its tokenizer.json dict (None when the tokenizer has none)."""
    return None if part is None else json.loads(part.__getstate__())


def resumable_reason(tok: Tokenizer, marker: str | None) -> str | None:
    """Why ``tok`` cannot be resumed at ``marker`` (None: it can)."""
    if marker is None:
        return "the chat template has no token that opens every turn"
    entry = next((a for a in tok.get_added_tokens_decoder().values() if a.content == marker), None)
    if entry is None:
        return f"{marker} is not an added token"
    if entry.normalized or entry.lstrip:
        return f"{marker} is normalised or strips to its left"
    for node in _walk(_component(tok.normalizer)):
        if node.get("type") in ("Prepend", "Precompiled"):
            return f"normaliser step {node['type']} may treat the input's start differently"
    for node in _walk(_component(tok.pre_tokenizer)):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") == "first":
            return "Metaspace prepends only at the input's start"
    return None


class ResumableEncoder:
    """Encodes chat renderings, reusing the ids of the longest unchanged part of the previous one (see module doc).

    ``encode(text)`` returns exactly ``tok.encode(text, add_special_tokens=False).ids``; ``last_encoded_chars``
    says how many characters the last call actually encoded. With ``owner`` (whose text it is) a rendering is
    resumed only from the same owner's last one: how long encoding takes must not tell one client that another's
    conversation shares its start.
    """

    def __init__(self, tok: Tokenizer, marker: str | None) -> None:
        self.tok, self.marker = tok, marker
        self.marker_id = tok.token_to_id(marker) if marker is not None else None
        self.reason = resumable_reason(tok, marker)
        self.enabled = self.reason is None and self.marker_id is not None
        self._text = ""
        self._ids: list[int] = []
        self._marks: list[int] = []        # index in _ids of each marker, in order
        self._owner: str | None = None
        self.last_encoded_chars = 0
        self._lock = threading.Lock()    # the server tokenises requests in worker threads

    def encode(self, text: str, owner: str | None = None) -> list[int]:
        with self._lock:
            if owner != self._owner:
                self._text, self._ids, self._marks, self._owner = "", [], [], owner
            return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        start, keep, marks = 0, 0, 0
        if self.enabled and self._text:
            c = common_chars(self._text, text)
            # The last marker lying wholly inside the shared characters: the old ids before it stay valid.
            b = text.rfind(self.marker, 0, c)
            if b > 0:
                marks = text.count(self.marker, 0, b)
                if marks < len(self._marks) and self._ids[self._marks[marks]] == self.marker_id:
                    start, keep = b, self._marks[marks]
        new = self.tok.encode(text[start:], add_special_tokens=False).ids
        ids = self._ids[:keep] + new
        self._marks = self._marks[:marks] + [keep + i for i, t in enumerate(new) if t == self.marker_id]
        self._text, self._ids = text, ids
        self.last_encoded_chars = len(text) - start
        return list(ids)

    def forget(self) -> None:
        """Drop the remembered rendering (the next call encodes everything)."""
        with self._lock:
            self._text, self._ids, self._marks = "", [], []

