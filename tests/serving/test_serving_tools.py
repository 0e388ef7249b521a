# ruff: noqa: E501  (chat templates are kept on the lines a template author would write)
"""Tool calling and the reasoning split (edgespec.serving.tools) through the server and the official openai client.

The tiny random model cannot choose to call a tool, so calls are forced (``tool_choice`` required / named): the
grammar must produce a call whose arguments validate against the tool's schema, with n-gram speculation on. The
parser is checked on hand-written model output, fed in one piece and one character at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from serving_helpers import ServerThread, app_for, write_tiny_chat_model

from edgespec.config import Settings
from edgespec.serving.tools import OutputSplitter, parse_tool_call, tool_format

# Qwen3-style (JSON calls) and Qwen3.5-style (XML calls) templates, trimmed to what the tests render.
QWEN3_TOOLS_TEMPLATE = """\
{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}
{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant\\n' + m.content }}
{%- for c in m.tool_calls %}{{- '<tool_call>\\n{"name": "' + c.function.name + '", "arguments": ' + (c.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}"""
QWEN35_TOOLS_TEMPLATE = QWEN3_TOOLS_TEMPLATE.replace(
    """{{- '<tool_call>\\n{"name": "' + c.function.name + '", "arguments": ' + (c.function.arguments | tojson) + '}\\n</tool_call>' }}""",
    """{{- '<tool_call>\\n<function=' + c.function.name + '>\\n' }}{%- for k, v in c.function.arguments.items() %}"""
    """{{- '<parameter=' + k + '>\\n' + (v if v is string else v | tojson) + '\\n</parameter>\\n' }}{%- endfor %}"""
    """{{- '</function>\\n</tool_call>' }}""")

GRIP = {"type": "function", "function": {
    "name": "grip", "description": "close the gripper",
    "parameters": {"type": "object", "properties": {"force": {"type": "integer", "minimum": 1, "maximum": 9},
                                                    "hand": {"type": "string", "enum": ["left", "right"]}},
                   "required": ["force", "hand"]}}}
MOVE = {"type": "function", "function": {
    "name": "move_to", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50}, "label": {"type": "string", "maxLength": 12}}, "required": ["x", "label"]}}}
TOOLS = [GRIP, MOVE]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def _model(folder: Path, template: str) -> Path:
    write_tiny_chat_model(folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module", params=["json", "xml"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    template = QWEN3_TOOLS_TEMPLATE if request.param == "json" else QWEN35_TOOLS_TEMPLATE
    folder = _model(tmp_path_factory.mktemp("tools") / request.param, template)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    settings = Settings(model=str(folder), max_seq_len=1024, drafter="ngram", served_model_name="tiny",
                        max_tokens=160)
    with ServerThread(app_for(settings)) as srv:
        srv.fmt = request.param
        yield srv
    torch.set_num_threads(threads)


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _check_grip(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "grip"
    args = json.loads(call.function.arguments)
    assert set(args) == {"force", "hand"} and isinstance(args["force"], int) and 1 <= args["force"] <= 9
    assert args["hand"] in ("left", "right")


def test_template_format_detected(server: ServerThread) -> None:
    template = QWEN3_TOOLS_TEMPLATE if server.fmt == "json" else QWEN35_TOOLS_TEMPLATE
    assert tool_format(template) == server.fmt


def test_named_tool_call_follows_the_schema(server: ServerThread) -> None:
    r = _client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "grab the cup"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "grip"}}, extra_body=NO_THINK)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1 and not choice.message.content
    _check_grip(choice.message.tool_calls[0])
    assert r.model_extra["edgespec"]["drafter"] == "ngram"


def test_required_tool_call_streams_as_deltas(server: ServerThread) -> None:
    client = _client(server)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "move"}], tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, extra_body=NO_THINK)
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls", whole.choices[0]
    calls = whole.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("grip", "move_to")
    streamed: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            entry = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_tool_history_renders_and_thinking_goes_to_reasoning(server: ServerThread) -> None:
    history = [
        {"role": "user", "content": "grab the cup"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "grip", "arguments": '{"force": 3, "hand": "left"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "gripped"},
    ]
    # Thinking on: the prompt opens <think>, so the answer up to </think> is reasoning; the call comes after it.
    r = _client(server).chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "grip"}},
        max_tokens=200)
    msg = r.choices[0].message
    assert r.usage.prompt_tokens > 40
    if r.choices[0].finish_reason == "tool_calls":
        _check_grip(msg.tool_calls[0])
        assert "</think>" not in (msg.content or "") + (msg.model_extra.get("reasoning_content") or "")
    else:   # the random model may think until max_tokens: then everything it wrote is reasoning
        assert r.choices[0].finish_reason == "length" and msg.model_extra.get("reasoning_content")
        assert not msg.content


def test_bad_tool_requests(server: ServerThread) -> None:
    client = _client(server)
    msgs = [{"role": "user", "content": "x"}]
    cases = [
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}),
        dict(tools=[GRIP, GRIP]),
        dict(tools=[{"type": "function", "function": {"name": "bad", "parameters": {"type": "array"}}}]),
        dict(messages=[{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "grip", "arguments": "{not json"}}]}]),
        dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
    ]
    for kw in cases:
        kw.setdefault("messages", msgs)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", max_tokens=4, **kw)


# ---- the parser on its own -------------------------------------------------------------------------------------

SPECS = {"grip": GRIP["function"], "move_to": MOVE["function"]}


def _split(text: str, *, by_char: bool, **kw: Any) -> OutputSplitter:
    s = OutputSplitter(parse_tools=True, tools=SPECS, **kw)
    for piece in (list(text) if by_char else [text]):
        s.feed(piece)
    s.finish()
    return s


@pytest.mark.parametrize("by_char", [False, True])
def test_splitter_json_calls_and_reasoning(by_char: bool) -> None:
    text = ("I should grip.\n</think>\n\nSure.\n<tool_call>\n{\"name\": \"grip\", \"arguments\": {\"force\": 2, "
            "\"hand\": \"left\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"move_to\", \"arguments\": {\"x\": 1.5, "
            "\"label\": \"a<b\"}}\n</tool_call>")
    s = _split(text, by_char=by_char, in_think=True)
    assert "".join(s.reasoning) == "I should grip."
    assert "".join(s.content) == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in s.calls] == [
        ("grip", {"force": 2, "hand": "left"}), ("move_to", {"x": 1.5, "label": "a<b"})]


@pytest.mark.parametrize("by_char", [False, True])
def test_splitter_xml_calls(by_char: bool) -> None:
    text = ("<think>plan</think>ok <tool_call>\n<function=move_to>\n<parameter=x>\n-2\n</parameter>\n"
            "<parameter=label>\n12\n</parameter>\n</function>\n</tool_call>")
    s = _split(text, by_char=by_char, fmt="xml")
    assert "".join(s.reasoning) == "plan" and "".join(s.content) == "ok "
    # x is a number by its schema; label stays a string although it looks like one.
    assert [(c.name, json.loads(c.arguments)) for c in s.calls] == [("move_to", {"x": -2, "label": "12"})]


def test_splitter_keeps_what_does_not_parse() -> None:
    s = _split("a <tool_call>{broken</tool_call> b <tool_call>{\"name\": 1}", by_char=True)
    assert not s.calls
    assert "".join(s.content) == "a <tool_call>{broken</tool_call> b <tool_call>{\"name\": 1}"
    plain = OutputSplitter(parse_tools=False)
    out = plain.feed("x <tool_call>{}</tool_call> <thi") + plain.finish()
    assert "".join(d.content or "" for d in out) == "x <tool_call>{}</tool_call> <thi"
    assert parse_tool_call('{"name": "grip", "arguments": "{\\"force\\": 1}"}', "json", SPECS).arguments == \
        '{"force": 1}'
    assert parse_tool_call('{"name": "grip", "arguments": [1]}', "json", SPECS) is None
