"""Tool calls and reasoning in model output: split the text into ``reasoning_content``, ``content`` and ``tool_calls``.

Two tool-call formats, both wrapped in ``<tool_call>...</tool_call>`` (which one a model speaks is read from its
chat template, :func:`tool_format`):

* ``json`` (Qwen3, Hermes): ``<tool_call>\\n{"name": "grip", "arguments": {"force": 2}}\\n</tool_call>``
* ``xml`` (Qwen3.5 / Qwen3.6, Qwen3-Coder): ``<tool_call>\\n<function=grip>\\n<parameter=force>\\n2\\n</parameter>\\n
  </function>\\n</tool_call>``; a parameter's text is a string unless the tool's schema types it otherwise, then
  it is read as JSON.

:class:`OutputSplitter` works on the text stream as it is decoded: reasoning (the text inside ``<think>`` ..
``</think>``, or before ``</think>`` when the prompt opened the block) goes to ``reasoning_content``; a complete
tool call becomes one ``tool_calls`` entry; text that may still turn into a marker is held back until it cannot.
A ``<tool_call>`` block that does not parse stays in ``content`` (nothing is silently dropped). This is what
vLLM's and SGLang's reasoning and tool parsers do for the same models.

:func:`tool_grammar` builds the llguidance grammar that forces a tool call whose arguments follow the tool's JSON
schema, for ``tool_choice: "required"`` or a named function (``auto`` leaves the model free, as vLLM does).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .grammar import JSON_MAX_STRING, bounded_schema

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


_TOOLS_VAR = re.compile(r"\btools\b")

GENERIC_TOOLS_INTRO = """# Tools

You may call one or more functions to help with the request. The functions, as JSON schemas:
<tools>
{tools}
</tools>

To call a function, answer with one block per call, each holding a JSON object with the function's name and its
arguments:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>
A function's result comes back in a <tool_response> block."""


def renders_tools(chat_template: str | None) -> bool:
    """True when the chat template has a tool section (it reads the ``tools`` variable)."""
    return bool(chat_template) and _TOOLS_VAR.search(chat_template) is not None


def generic_tool_messages(messages: Sequence[Mapping[str, Any]],
                          tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a chat template without a tool section (edgespec's generic tool format, docs/service.md): the
    tools described in the system turn (:data:`GENERIC_TOOLS_INTRO`, appended to the first system message or a new
    one), earlier assistant calls written out as ``<tool_call>`` blocks and tool results sent as user turns in
    ``<tool_response>`` blocks. Calls come back in the ``json`` format, which :class:`OutputSplitter` parses."""
    out: list[dict[str, Any]] = []
    for m in messages:
        msg = dict(m)
        calls = msg.pop("tool_calls", None)
        if calls:
            blocks = [CALL_OPEN + "\n" + json.dumps({"name": c["function"]["name"],
                                                      "arguments": c["function"]["arguments"]},
                                                     ensure_ascii=False) + "\n" + CALL_CLOSE for c in calls]
            msg["content"] = "\n".join(([msg["content"]] if msg.get("content") else []) + blocks)
        if msg.get("role") == "tool":
            msg = {"role": "user", "content": f"<tool_response>\n{msg.get('content', '')}\n</tool_response>"}
        msg.pop("tool_call_id", None)
        out.append(msg)
    if tools:
        intro = GENERIC_TOOLS_INTRO.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{intro}".lstrip("\n")}
        else:
            out.insert(0, {"role": "system", "content": intro})
    return out


def tool_format(chat_template: str | None) -> str:
    """``xml`` when the chat template writes ``<function=...>`` calls (Qwen3.5/3.6), else ``json``."""
    return "xml" if chat_template and "<function=" in chat_template else "json"


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is the JSON text OpenAI clients expect."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def key(self) -> tuple[str, str]:
        """What makes two calls the same: the name and the arguments (key order aside)."""
        try:
            args = json.dumps(json.loads(self.arguments), sort_keys=True, ensure_ascii=False)
        except ValueError:
            args = self.arguments
        return self.name, args

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _param_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    kind = (schema or {}).get("type")
    if kind == "string" or kind is None and text.strip()[:1] not in ("{", "[", '"') and not _is_number(text):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _is_number(text: str) -> bool:
    try:
        float(text.strip())
    except ValueError:
        return False
    return True


def parse_tool_call(body: str, fmt: str, tools: Mapping[str, Mapping[str, Any]]) -> ToolCall | None:
    """The call inside one ``<tool_call>`` block, or None when it is not a well-formed call."""
    if fmt == "xml" or body.lstrip().startswith("<function="):
        m = _XML_FUNCTION.search(body)
        if m is None:
            return None
        name = m.group(1).strip()
        props = ((tools.get(name) or {}).get("parameters") or {}).get("properties") or {}
        args = {p.strip(): _param_value(v, props.get(p.strip())) for p, v in _XML_PARAM.findall(m.group(2))}
        return ToolCall(name, json.dumps(args, ensure_ascii=False))
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


@dataclass
class Delta:
    """A piece of the split output: exactly one field is set."""

    reasoning: str | None = None
    content: str | None = None
    tool_call: ToolCall | None = None


def _partial_marker(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker (held back)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class OutputSplitter:
    """Streaming split of generated text into reasoning, content and tool calls (see the module doc)."""

    def __init__(self, *, in_think: bool = False, parse_tools: bool = False, fmt: str = "json",
                 tools: Mapping[str, Mapping[str, Any]] | None = None, split_reasoning: bool = True,
                 distinct: bool = False) -> None:
        self.in_think = in_think and split_reasoning
        self.distinct = distinct     # drop a call equal to an earlier one (forced parallel calls: DistinctCalls)
        self._seen: set[tuple[str, str]] = set()
        self.split_reasoning = split_reasoning
        self.parse_tools = parse_tools
        self.fmt = fmt
        self.tools = dict(tools or {})
        self._buf = ""
        self._in_call = False
        self.calls: list[ToolCall] = []
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self._leading = False    # just after </think>: the newlines that separate it from the answer are dropped

    def _markers(self) -> list[str]:
        if self.in_think:
            return [THINK_CLOSE]
        out = [THINK_OPEN] if self.split_reasoning else []
        if self.parse_tools:
            out.append(CALL_OPEN)
        return out

    def _text(self, kind: str, text: str, out: list[Delta]) -> None:
        if kind == "content" and self._leading:
            text = text.lstrip("\n")
            if not text:
                return
            self._leading = False
        if not text:
            return
        if kind == "reasoning":
            self.reasoning.append(text)
            out.append(Delta(reasoning=text))
        else:
            self.content.append(text)
            out.append(Delta(content=text))

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while self._buf:
            if self._in_call:
                end = self._buf.find(CALL_CLOSE)
                if end < 0:
                    return out
                body = self._buf[:end]
                self._buf = self._buf[end + len(CALL_CLOSE):]
                self._in_call = False
                call = parse_tool_call(body, self.fmt, self.tools)
                if call is None:
                    self._text("content", CALL_OPEN + body + CALL_CLOSE, out)
                elif not (self.distinct and call.key() in self._seen):
                    self._seen.add(call.key())
                    self.calls.append(call)
                    out.append(Delta(tool_call=call))
                self._buf = self._buf.lstrip("\n") if call is not None else self._buf
                continue
            kind = "reasoning" if self.in_think else "content"
            hits = [(self._buf.find(m), m) for m in self._markers()]
            hits = [(i, m) for i, m in hits if i >= 0]
            if not hits:
                keep = _partial_marker(self._buf, self._markers())
                # Newlines too where a marker that drops them may follow (</think>, <tool_call>).
                while (self.in_think or self.parse_tools) and keep < len(self._buf) \
                        and self._buf[len(self._buf) - keep - 1] == "\n":
                    keep += 1
                self._text(kind, self._buf[:len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            i, marker = min(hits)
            before = self._buf[:i]
            self._buf = self._buf[i + len(marker):]
            if marker == THINK_CLOSE:
                self._text("reasoning", before.rstrip("\n"), out)
                self.in_think = False
                self._leading = True
            elif marker == THINK_OPEN:
                self._text("content", before, out)
                self.in_think = True
                self._buf = self._buf.lstrip("\n")
            else:   # CALL_OPEN
                self._text("content", before.rstrip("\n"), out)
                self._in_call = True
        return out

    def finish(self) -> list[Delta]:
        """End of output: whatever is held back is text (an unclosed call stays visible as content)."""
        out: list[Delta] = []
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._text("content", CALL_OPEN + rest, out)
        else:
            self._text("reasoning" if self.in_think else "content", rest.rstrip("\n") if self.in_think else rest,
                       out)
        self._in_call = False
        return out


# ---- grammar for tool_choice required / named -------------------------------------------------------------------


def _lark_str(text: str) -> str:
    return json.dumps(text)


def _json_rule(schema: Mapping[str, Any], defaults: Mapping[str, Any]) -> str:
    # Forced calls close their objects and bound their numbers and strings (serving.grammar.bounded_schema).
    merged = bounded_schema(schema, close_objects=True)
    merged["x-guidance"] = {**defaults, **dict(schema.get("x-guidance") or {})}
    return "%json " + json.dumps(merged)


def tool_grammar(tools: Sequence[Mapping[str, Any]], fmt: str, json_defaults: Mapping[str, Any],
                 multiple: bool = True, max_calls: int = 8) -> str:
    """Lark grammar (llguidance) for one ``<tool_call>`` block calling one of ``tools`` (each ``{"name",
    "parameters"}``), or with ``multiple`` 1 to ``max_calls`` blocks; arguments validated against each tool's
    schema. (That the calls differ is :class:`DistinctCalls`'s part: a grammar cannot say it.)"""
    rules, calls = [], []
    for i, tool in enumerate(tools):
        name = tool["name"]
        params = dict(tool.get("parameters") or {"type": "object"})
        if fmt == "xml":
            props = params.get("properties") or {}
            required = set(params.get("required") or [])
            parts = []
            for j, (pname, pschema) in enumerate(props.items()):
                head = _lark_str(f"<parameter={pname}>\n")
                tail = _lark_str("\n</parameter>\n")
                enum = pschema.get("enum") if isinstance(pschema, Mapping) else None
                if enum and all(isinstance(v, str) for v in enum):
                    rules.append(f"p{i}_{j}: " + " | ".join(_lark_str(v) for v in enum))
                elif isinstance(pschema, Mapping) and pschema.get("type") == "string":
                    # Raw text without markup; maxLength (default JSON_MAX_STRING) bounds it.
                    n = pschema.get("maxLength")
                    n = n if isinstance(n, int) else JSON_MAX_STRING
                    rules.append(f"p{i}_{j}: /[^<]{{0,{int(n)}}}/")
                else:
                    sub = pschema if isinstance(pschema, Mapping) else {}
                    rules.append(f"p{i}_{j}: {_json_rule(sub, json_defaults)}")
                item = f"{head} p{i}_{j} {tail}"
                parts.append(item if pname in required else f"({item})?")
            body = " ".join(parts) if parts else ""
            rules.append(f"call{i}: {_lark_str(CALL_OPEN + chr(10) + f'<function={name}>' + chr(10))} {body} "
                         f"{_lark_str('</function>' + chr(10) + CALL_CLOSE)}")
        else:
            head = _lark_str(CALL_OPEN + "\n" + json.dumps({"name": name})[:-1] + ", \"arguments\": ")
            rules.append(f"args{i}: {_json_rule(params, json_defaults)}")
            rules.append(f"call{i}: {head} args{i} {_lark_str('}' + chr(10) + CALL_CLOSE)}")
        calls.append(f"call{i}")
    one = "call: " + " | ".join(calls)
    more = max(0, max_calls - 1) if multiple else 0
    start = f'start: call ("\\n" call){{0,{more}}}' if more else "start: call"
    return "\n".join([start, one, *rules]) + "\n"


class DistinctCalls:
    """A forced parallel-call grammar (``tool_choice: "required"`` with ``parallel_tool_calls: true``) that also ends
    the output at the first call repeating an earlier one (same name and arguments): a weak model otherwise
    repeats its call until the bound. The repeat itself is dropped by :class:`OutputSplitter` (``distinct``).
    ``detokenizer`` turns the committed ids into text (an :class:`~edgespec.loading.tokenizer.IncrementalDetokenizer`
    that keeps special tokens)."""

    def __init__(self, inner: Any, detokenizer: Any, fmt: str, tools: Mapping[str, Mapping[str, Any]]) -> None:
        self.inner, self._detok, self.fmt, self.tools = inner, detokenizer, fmt, dict(tools)
        self._text = ""
        self._seen: set[tuple[str, str]] = set()
        self.repeated = False

    def __getattr__(self, name: str) -> Any:    # anything else a constraint offers is the grammar's
        return getattr(self.inner, name)

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        return self.inner.valid_prefix(drafts)

    def row_masks(self, drafts: Sequence[int], vocab_size: int, device: Any) -> Any:
        return self.inner.row_masks(drafts, vocab_size, device)

    def commit(self, tokens: Sequence[int]) -> None:
        self.inner.commit(tokens)
        self._text += self._detok.add(list(tokens))
        while CALL_CLOSE in self._text:
            block, _, self._text = self._text.partition(CALL_CLOSE)
            call = parse_tool_call(block.split(CALL_OPEN, 1)[-1], self.fmt, self.tools)
            if call is None:
                continue
            if call.key() in self._seen:
                self.repeated = True
            self._seen.add(call.key())

    def is_finished(self) -> bool:
        return self.repeated or self.inner.is_finished()
