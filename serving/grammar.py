"""JSON mode: a :class:`~edgespec.speculative.cycle.TokenConstraint` backed by an llguidance matcher.

The session drives it once per cycle: :meth:`JsonConstraint.valid_prefix` truncates the drafts at the first
token the grammar rejects, :meth:`JsonConstraint.row_masks` gives one allowed-token mask per verify row (the
matcher is advanced through the drafts and rolled back), and :meth:`JsonConstraint.commit` advances it by
exactly the tokens the target committed. A draft tree is judged the same way node by node
(:meth:`JsonConstraint.tree_valid` drops the nodes the grammar rejects, :meth:`JsonConstraint.tree_masks` gives
each verify row the mask of its own path's state, walking the tree depth first and rolling the matcher back to
each parent), so constrained requests verify trees losslessly. Generation ends when the value is complete
(:meth:`is_finished`); while the grammar is in an accepting state the masks also allow the end-of-sequence tokens,
so a model may stop there.

Every schema is bounded before it is compiled (:func:`bounded_schema`): an integer or number without limits may
not exceed ``±JSON_MAX_INTEGER`` (2**53 - 1, the largest integer a double holds exactly), a number without
``multipleOf`` has at most six decimals (``JSON_NUMBER_STEP``), and a string without ``maxLength``, ``enum``,
``const``, ``pattern`` or ``format`` holds at most ``JSON_MAX_STRING`` (1024) characters, so a model cannot write
digits or text until ``max_tokens``. A schema's own limits always win.

By default JSON is generated without free whitespace (``{"a": 1, "b": [2, 3]}`` style: one space after ``:``
and ``,``, no newlines), so an undertrained or random model cannot spin in whitespace until ``max_tokens``. A
schema can override this with llguidance's ``x-guidance`` options.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
import numpy as np
import torch

from edgespec.errors import RequestError
from edgespec.loading.tokenizer import ChatTokenizer

# Applied before a schema's own "x-guidance" options, which therefore win.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
JSON_MAX_INTEGER = 2**53 - 1
JSON_NUMBER_STEP = 1e-6
JSON_MAX_STRING = 1024
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains")


def bounded_schema(schema: Any, close_objects: bool = False) -> Any:
    """A copy of ``schema`` with the default bounds of the module doc on every number and string that has none; with
    ``close_objects`` also ``additionalProperties: false`` on every object schema that does not say otherwise (a
    forced tool call must not grow invented keys)."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    kind = out.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    fixed = "enum" in out or "const" in out
    if kinds & {"integer", "number"} and not fixed:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -JSON_MAX_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = JSON_MAX_INTEGER
        if "number" in kinds and "multipleOf" not in out:
            out["multipleOf"] = JSON_NUMBER_STEP
    if "string" in kinds and not fixed and not {"maxLength", "pattern", "format"} & out.keys():
        out["maxLength"] = JSON_MAX_STRING
    if close_objects and ("object" in kinds or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_schema(s, close_objects) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {k: bounded_schema(s, close_objects) for k, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), Mapping):
            out[key] = bounded_schema(out[key], close_objects)
    return out
MAX_SCHEMA_BYTES = 64 * 1024


class GrammarError(RequestError):
    """The request's grammar failed mid-generation (e.g. a schema that recurses without end hits llguidance's
    parser limits): the request's fault, answered 400, and the server carries on."""


class JsonConstraint:
    """One request's grammar state (not shared between requests; used from the worker thread only)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m = matcher
        self._vocab = vocab_size
        self._words = (vocab_size + 31) // 32

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"the JSON grammar failed during generation: {self._short_error()}")

    def _short_error(self) -> str:
        return self._m.get_error().split("\n", 1)[0][:300]

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar accepts from the current state."""
        if not drafts:
            return 0
        return int(self._m.validate_tokens([int(t) for t in drafts]))

    def row_masks(self, drafts: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
        """Bool ``[len(drafts)+1, vocab_size]``: row i = tokens allowed after the first i drafts."""
        self._check()
        rows = len(drafts) + 1
        bits = np.zeros((rows, self._words), dtype=np.int32)
        consumed = 0
        for i in range(rows):
            if i > 0:
                if self._m.is_stopped() or not self._m.consume_token(int(drafts[i - 1])):
                    # Cannot happen after valid_prefix truncation; keep later rows equal to the last good one.
                    self._check()
                    bits[i:] = bits[i - 1]
                    break
                consumed += 1
            self._m.unsafe_compute_mask_ptr(bits[i].ctypes.data, bits[i].nbytes)
        if consumed:
            self._m.rollback(consumed)
        self._check()
        mask = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        out = torch.zeros((rows, vocab_size), dtype=torch.bool)
        n = min(vocab_size, self._vocab)
        out[:, :n] = torch.from_numpy(mask[:, :n].astype(np.bool_))
        return out.to(device)

    def tree_valid(self, tokens: Sequence[int], parents: Sequence[int]) -> list[bool]:
        """Per draft-tree node (pre-order; ``parents[i]`` -1 for the root's children): whether the grammar accepts
        its whole path from the current state. The matcher ends where it began."""
        return self._walk_tree(tokens, parents, None)

    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int], vocab_size: int,
                   device: torch.device) -> torch.Tensor:
        """Bool ``[N + 1, vocab_size]`` for a tree verify: row 0 = tokens allowed in the current state, row
        ``i + 1`` = tokens allowed after node ``i``'s path (each node's mask from its own ancestors' state, never a
        sibling's). Every node must be valid (:meth:`tree_valid`); the matcher ends where it began."""
        self._check()
        bits = np.zeros((len(tokens) + 1, self._words), dtype=np.int32)
        valid = self._walk_tree(tokens, parents, bits)
        if not all(valid):
            raise ValueError(f"tree_masks: node {valid.index(False)} is not valid under the grammar (prune first)")
        return self._unpack(bits, vocab_size, device)

    def _walk_tree(self, tokens: Sequence[int], parents: Sequence[int], bits: np.ndarray | None) -> list[bool]:
        """Depth-first over the tree in its pre-order: each node's token is tried in its parent's state (the
        matcher rolled back to it), consumed when valid, its mask written to ``bits[i + 1]`` (row 0: the current
        state's). A node in a stopped state (after a complete value or an end-of-sequence token) is a leaf: it is
        valid when the grammar allows it there, never consumed, and its row allows everything (nothing after it is
        emitted). Rolls every consumed token back at the end."""
        m = self._m
        if bits is not None:
            m.unsafe_compute_mask_ptr(bits[0].ctypes.data, bits[0].nbytes)
        valid = [False] * len(tokens)
        leaf = [False] * len(tokens)
        path: list[int] = []                     # consumed nodes from the root down to the current state
        for i, (tok, parent) in enumerate(zip(tokens, parents, strict=True)):
            if parent >= 0 and (not valid[parent] or leaf[parent]):
                continue                         # below a rejected or final node
            up = 0
            while path and path[-1] != parent:   # pre-order: the parent is on the path of the previous node
                path.pop()
                up += 1
            if up:
                m.rollback(up)
            if m.is_stopped():
                valid[i] = leaf[i] = m.validate_tokens([int(tok)]) == 1
                if bits is not None:
                    bits[i + 1] = -1
                continue
            if m.validate_tokens([int(tok)]) != 1:
                continue
            m.consume_token(int(tok))
            path.append(i)
            valid[i] = True
            if bits is not None:
                m.unsafe_compute_mask_ptr(bits[i + 1].ctypes.data, bits[i + 1].nbytes)
        if path:
            m.rollback(len(path))
        self._check()
        return valid

    def _unpack(self, bits: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
        """Bool ``[rows, vocab_size]`` from llguidance's 32-bit mask words; a row that allows nothing (past a final
        token: never emitted) allows everything, so no row's distribution is empty."""
        mask = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        out = torch.zeros((bits.shape[0], vocab_size), dtype=torch.bool)
        n = min(vocab_size, self._vocab)
        out[:, :n] = torch.from_numpy(mask[:, :n].astype(np.bool_))
        out[~out.any(dim=1)] = True
        return out.to(device)

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance by exactly the committed tokens."""
        if not self._m.consume_tokens([int(t) for t in tokens]):
            raise GrammarError(f"the JSON grammar failed during generation: {self._short_error()}")

    def is_finished(self) -> bool:
        """True once a complete JSON value has been produced (nothing but end-of-sequence may follow)."""
        return self._m.is_stopped() and not self._m.is_error()


class GrammarCompiler:
    """Builds :class:`JsonConstraint` objects for one engine's tokenizer.

    The llguidance tokenizer is built once, on first use (about 0.2-1 s), from the same ``tokenizer.json`` the
    engine encodes with; ``vocab_size`` is the model's logits width, so masks cover every row of the logits.
    """

    def __init__(self, tokenizer: ChatTokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                stop = self._tokenizer.stop_token_ids
                self._ll = llguidance.LLTokenizer(self._tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size,
                                                  eos_token=stop or None)
            return self._ll

    def json_object(self) -> JsonConstraint:
        """Any JSON object (``response_format: {"type": "json_object"}``)."""
        return self.json_schema(ANY_OBJECT, param="response_format")

    def json_schema(self, schema: Mapping[str, Any], param: str = "response_format.json_schema.schema"
                    ) -> JsonConstraint:
        """Output that validates against ``schema``; a schema llguidance cannot compile is a RequestError."""
        try:
            text = json.dumps(bounded_schema(schema))
        except (TypeError, ValueError) as exc:
            raise RequestError(f"{param}: not serialisable JSON ({exc})") from None
        if len(text) > MAX_SCHEMA_BYTES:
            raise RequestError(f"{param}: schema of {len(text)} bytes exceeds {MAX_SCHEMA_BYTES}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
        except ValueError as exc:
            raise RequestError(f"{param}: {exc}") from None
        return self._constraint(grammar, param)

    def lark(self, text: str, param: str = "tools") -> JsonConstraint:
        """Output matching a Lark grammar (tool calls: :func:`edgespec.serving.tools.tool_grammar`)."""
        if len(text) > 4 * MAX_SCHEMA_BYTES:
            raise RequestError(f"{param}: grammar of {len(text)} bytes exceeds {4 * MAX_SCHEMA_BYTES}")
        try:
            grammar = llguidance.grammar_from("lark", text)
        except ValueError as exc:
            raise RequestError(f"{param}: {exc}") from None
        return self._constraint(grammar, param)

    def _constraint(self, grammar: str, param: str) -> JsonConstraint:
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"{param}: not supported: {matcher.get_error().splitlines()[0][:300]}")
        return JsonConstraint(matcher, self.vocab_size)


class AfterThink:
    """Leaves the reasoning free: ``inner`` constrains the output only after the ``</think>`` token (a thinking
    model asked for a tool call reasons first). Drafts are cut after a drafted ``</think>``, so at most the last
    verify row is past it."""

    def __init__(self, inner: JsonConstraint, close_id: int) -> None:
        self.inner = inner
        self.close_id = close_id
        self.thinking = True

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        if not self.thinking:
            return self.inner.valid_prefix(drafts)
        drafts = list(drafts)
        return drafts.index(self.close_id) + 1 if self.close_id in drafts else len(drafts)

    def row_masks(self, drafts: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
        if not self.thinking:
            return self.inner.row_masks(drafts, vocab_size, device)
        out = torch.ones((len(drafts) + 1, vocab_size), dtype=torch.bool, device=device)
        if drafts and drafts[-1] == self.close_id:
            out[-1] = self.inner.row_masks([], vocab_size, device)[0]
        return out

    def tree_valid(self, tokens: Sequence[int], parents: Sequence[int]) -> list[bool]:
        """While thinking, every node not below a drafted ``</think>`` (as a chain's drafts are cut after it)."""
        if not self.thinking:
            return self.inner.tree_valid(tokens, parents)
        below = [False] * len(tokens)
        for i, p in enumerate(parents):
            below[i] = p >= 0 and (below[p] or int(tokens[p]) == self.close_id)
        return [not b for b in below]

    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int], vocab_size: int,
                   device: torch.device) -> torch.Tensor:
        if not self.thinking:
            return self.inner.tree_masks(tokens, parents, vocab_size, device)
        out = torch.ones((len(tokens) + 1, vocab_size), dtype=torch.bool, device=device)
        closes = [i + 1 for i, t in enumerate(tokens) if int(t) == self.close_id]
        if closes:
            out[closes] = self.inner.row_masks([], vocab_size, device)[0]
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        if self.thinking and self.close_id in tokens:
            self.thinking = False
            tokens = tokens[tokens.index(self.close_id) + 1:]
        if not self.thinking and tokens:
            self.inner.commit(tokens)

    def is_finished(self) -> bool:
        return not self.thinking and self.inner.is_finished()
