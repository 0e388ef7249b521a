"""Regression tests for issue 39 (a service a robot can trust): max_tokens bounded by the context, short requests
never waiting behind a long generation, the prefix cache isolated per client, strict request types, a code on
every 4xx, and slow clients cut off at the connection layer."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from serving_helpers import ServerThread, app_for, write_tiny_chat_model
from test_server import SlowEngine

from edgespec.config import Settings
from edgespec.engine import Engine
from edgespec.plan import build_plan
from edgespec.serving.transport import guarded_protocol

MODEL = "tiny-trust"
CHAT = [{"role": "user", "content": "hello robot"}]
MAX_LEN = 512


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("trust") / "tiny")


def settings_for(model_dir: Path, **overrides: Any) -> Settings:
    base = dict(model=str(model_dir), max_seq_len=MAX_LEN, drafter="ngram", served_model_name=MODEL, max_tokens=32)
    base.update(overrides)
    return Settings(**base)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[Engine]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.load(build_plan(settings_for(tiny_dir)))
    torch.set_num_threads(threads)


def serve(engine: Any, tiny_dir: Path, **overrides: Any) -> ServerThread:
    settings = settings_for(tiny_dir, **overrides)
    return ServerThread(app_for(settings, engine),
                        http=guarded_protocol(settings.read_timeout_s, settings.max_connections))


@pytest.fixture(scope="module")
def server(engine: Engine, tiny_dir: Path) -> Iterator[ServerThread]:
    with serve(engine, tiny_dir) as s:
        yield s


def chat(url: str, **body: Any) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, **body}, timeout=120)


def prompt_len(engine: Engine) -> int:
    return len(engine.tokenizer.encode_chat(CHAT, enable_thinking=engine.plan.requests.enable_thinking))


# ---- 1. fairness ----------------------------------------------------------------------------------------------


def test_max_tokens_beyond_the_context_is_refused(server: ServerThread, engine: Engine) -> None:
    r = chat(server.url, max_tokens=10**9)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    room = MAX_LEN - prompt_len(engine)
    assert f"at most {room}" in err["message"]
    assert chat(server.url, max_tokens=room, edgespec={"num_draft_tokens": 0}).status_code == 200
    assert chat(server.url, max_tokens=room + 1).status_code == 400


def test_default_max_tokens_is_cut_to_the_context(engine: Engine, tiny_dir: Path) -> None:
    with serve(engine, tiny_dir, max_tokens=100_000) as s:
        r = chat(s.url)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= MAX_LEN - prompt_len(engine)


@pytest.mark.parametrize("short_user", ["robot", "someone-else"])
def test_short_request_does_not_wait_behind_a_long_one(engine: Engine, tiny_dir: Path, short_user: str) -> None:
    long_body = {"max_tokens": 200, "user": "robot", "stop": [], "edgespec": {"num_draft_tokens": 0}}
    alone = chat_alone = None
    with serve(engine, tiny_dir) as s:
        chat_alone = chat(s.url, **long_body)
    assert chat_alone.status_code == 200
    alone = chat_alone.json()
    if alone["usage"]["completion_tokens"] < 40:
        pytest.skip("the tiny model stopped early; nothing long to preempt")
    paced = SlowEngine(engine, delay=0.05)
    with serve(paced, tiny_dir) as s:
        box: dict[str, httpx.Response] = {}
        long_thread = threading.Thread(target=lambda: box.setdefault("long", chat(s.url, **long_body)))
        long_thread.start()
        while httpx.get(s.url + "/health").json()["running"] == 0:
            time.sleep(0.01)
        time.sleep(0.3)  # the long request is decoding
        t0 = time.monotonic()
        short = chat(s.url, max_tokens=3, user=short_user)
        waited = time.monotonic() - t0
        long_thread.join(120)
        assert short.status_code == 200, short.text
        # The short request paused the long one at its next cycle instead of waiting out ~200 paced cycles.
        assert short.json()["edgespec"]["queue_ms"] < 1000.0 and waited < 5.0
        assert any(c.finish_reason == "preempted" for c in paced.results)
        assert "edgespec:request_preemptions_total 1.0" in httpx.get(s.url + "/metrics").text
        long = box["long"].json()
    # Paused and continued (from the prefix cache, or from scratch for another client's key), the long answer is
    # the one it gives uninterrupted.
    assert long["choices"][0]["message"] == alone["choices"][0]["message"]
    assert long["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"]


def test_arrival_order_when_short_priority_is_off(engine: Engine, tiny_dir: Path) -> None:
    paced = SlowEngine(engine, delay=0.05)
    with serve(paced, tiny_dir, short_request_tokens=0) as s:
        long_thread = threading.Thread(target=lambda: chat(s.url, max_tokens=60, stop=[],
                                                           edgespec={"num_draft_tokens": 0}))
        long_thread.start()
        while httpx.get(s.url + "/health").json()["running"] == 0:
            time.sleep(0.01)
        assert chat(s.url, max_tokens=3).status_code == 200
        long_thread.join(120)
    assert not any(c.finish_reason == "preempted" for c in paced.results)


# ---- 4. prefix cache per client --------------------------------------------------------------------------------


SECRET = [{"role": "system", "content": "The door code is 4711. Never tell it."},
          {"role": "user", "content": "open the door"}]


def cached(url: str, messages: list[dict[str, str]], headers: dict[str, str] | None = None,
           **body: Any) -> int:
    r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2, **body},
                   headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_prefix_cache_is_not_shared_between_clients(server: ServerThread) -> None:
    guess = [SECRET[0], {"role": "user", "content": "what is the code"}]
    cached(server.url, SECRET, user="owner")
    assert cached(server.url, guess, user="intruder") == 0          # another user: nothing reused
    cached(server.url, SECRET, user="owner")
    assert cached(server.url, guess, prompt_cache_key="intruder", user="owner") == 0   # the cache key wins
    cached(server.url, SECRET, user="owner")
    assert cached(server.url, guess, headers={"Authorization": "Bearer other"}, user="owner") == 0
    cached(server.url, SECRET, user="owner")
    assert cached(server.url, guess, user="owner") > 0               # the same client keeps its reuse


# ---- 3. strict types and error codes ----------------------------------------------------------------------------


STRICT = [
    ("max_tokens as text", "/v1/chat/completions", {"messages": CHAT, "max_tokens": "10"}, "max_tokens"),
    ("temperature NaN text", "/v1/chat/completions", {"messages": CHAT, "temperature": "NaN"}, "temperature"),
    ("stream as int", "/v1/chat/completions", {"messages": CHAT, "stream": 1}, "stream"),
    ("strict as int", "/v1/chat/completions",
     {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f", "strict": 0}}]},
     "tools[0].function.strict"),
    ("prompt of booleans", "/v1/completions", {"prompt": [False]}, "prompt"),
    ("user as number", "/v1/chat/completions", {"messages": CHAT, "user": 7}, "user"),
]


@pytest.mark.parametrize("case,path,body,param", STRICT, ids=[c[0] for c in STRICT])
def test_loose_types_are_refused(server: ServerThread, case: str, path: str, body: Any, param: str) -> None:
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "validation_error" and err["param"] is not None and err["param"].startswith(param), err


def test_nan_literal_is_not_a_bound_violation(server: ServerThread) -> None:
    # Python's JSON reader takes a bare NaN; it is a non-finite number, not "above 5.0".
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages":[{"role":"user","content":"a"}],'
                   b'"temperature":NaN}', headers={"content-type": "application/json"})
    assert r.status_code == 422 and "finite" in r.json()["error"]["message"]


def test_every_4xx_has_a_code(server: ServerThread) -> None:
    url = server.url + "/v1/chat/completions"
    json_type = {"content-type": "application/json"}

    def chunks() -> Iterator[bytes]:
        for _ in range(40):
            yield b" " * 65536

    cases = {
        "chunked body over the limit": httpx.post(url, content=chunks(), headers=json_type),
        "invalid UTF-8": httpx.post(url, content=b'{"messages": "\xff\xfe"}', headers=json_type),
        "10k-deep JSON": httpx.post(url, content=b"[" * 10_000 + b"]" * 10_000, headers=json_type),
    }
    expect = {"chunked body over the limit": (413, "body_too_large"), "invalid UTF-8": (400, "invalid_json"),
              "10k-deep JSON": (400, "invalid_json")}
    for name, r in cases.items():
        assert (r.status_code, r.json()["error"]["code"]) == expect[name], (name, r.text)


def read_all(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout)
    out = b""
    while piece := sock.recv(65536):
        out += piece
    return out


def raw(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_all(sock, timeout)


def test_unparsable_http_is_a_json_400(server: ServerThread) -> None:
    reply = raw(server.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n{}")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert httpx.Response(400, content=body).json()["error"]["code"] == "invalid_http"


def test_bad_tool_schema_is_refused_under_every_tool_choice(server: ServerThread) -> None:
    tool = {"type": "function", "function": {"name": "grip", "parameters": {
        "type": "object", "properties": {"force": {"type": "nonsense"}}}}}
    for choice in ("auto", "none", "required", {"type": "function", "function": {"name": "grip"}}, None):
        body: dict[str, Any] = {"tools": [tool], "max_tokens": 4}
        if choice is not None:
            body["tool_choice"] = choice
        r = chat(server.url, **body)
        assert r.status_code == 400, (choice, r.text)
        assert r.json()["error"]["code"] == "invalid_schema" and r.json()["error"]["param"] == "tools", choice


# ---- 2. slow clients ---------------------------------------------------------------------------------------------


def open_fds() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))


def test_partial_connections_are_cut_off_while_requests_are_answered(engine: Engine, tiny_dir: Path) -> None:
    with serve(engine, tiny_dir, read_timeout_s=1.0, max_connections=400) as s:
        before = open_fds()
        socks = []
        for i in range(300):
            sock = socket.create_connection(("127.0.0.1", s.port))
            if i % 2:   # half send part of the headers, half the headers and part of a body
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            else:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n{\"messages\"")
            socks.append(sock)
        t0 = time.monotonic()
        assert chat(s.url, max_tokens=3).status_code == 200      # a normal request is served meanwhile
        answers = []
        for sock in socks:
            answers.append(read_all(sock, 5.0))
            sock.close()
        cleared = time.monotonic() - t0
        assert cleared < 1.0 + 3.0
        assert all(a.startswith(b"HTTP/1.1 408") and b"request_timeout" in a for a in answers), answers[:2]
        time.sleep(0.2)
        assert open_fds() <= before + 5     # the server side closed them all


def test_connections_over_the_cap_get_a_json_503(engine: Engine, tiny_dir: Path) -> None:
    with serve(engine, tiny_dir, max_connections=4) as s:
        held = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(4)]
        time.sleep(0.1)
        reply = raw(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 503") and b"too_many_connections" in reply
        for sock in held:
            sock.close()
        time.sleep(0.1)
        assert httpx.get(s.url + "/health").status_code == 200


def test_shutdown_is_not_held_by_a_partial_body(engine: Engine, tiny_dir: Path) -> None:
    s = serve(engine, tiny_dir, read_timeout_s=30.0)
    with s:
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        time.sleep(0.2)
        t0 = time.monotonic()
        s.app.state.edgespec.begin_drain()     # what SIGTERM does first
        reply = read_all(sock, 5.0)
        assert reply.startswith(b"HTTP/1.1 503") and b"draining" in reply and b"application/json" in reply
        sock.close()
    assert time.monotonic() - t0 < 15.0, time.monotonic() - t0   # not the 30 s read timeout


# ---- 3. signals from the first instant ----------------------------------------------------------------------------


def sigterm_caught(pid: int) -> bool:
    """True once the process has a SIGTERM handler (bit 15 of SigCgt in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


@pytest.mark.parametrize("entry", [["-m", "edgespec.serving"], ["-m", "edgespec.cli", "serve"]])
@pytest.mark.parametrize("when", ["first handler", "0.6 s"])
def test_sigterm_during_start_up_exits_0_with_a_line(tiny_dir: Path, entry: list[str], when: str) -> None:
    proc = subprocess.Popen([sys.executable, *entry, "--model", str(tiny_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if when == "first handler":
        # The first instant Python code of ours runs (the interpreter's own start-up comes before any handler):
        # torch and FastAPI are still to be imported.
        deadline = time.monotonic() + 30
        while not sigterm_caught(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.002)
    else:
        time.sleep(0.6)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    text = out.decode()
    if when == "first handler":
        assert "edgespec: SIGTERM during start-up, before serving; exiting 0" in text, text
    else:
        assert "SIGTERM during start-up" in text or "draining" in text or "while the model was loading" in text, text


# ---- 6. ready only once the model answers ---------------------------------------------------------------------


def test_health_is_ready_only_after_a_warm_up_answer(engine: Engine, tiny_dir: Path) -> None:
    served = engine.totals.requests
    with ServerThread(app_for(settings_for(tiny_dir), lambda: engine)) as s:
        assert httpx.get(s.url + "/health").json()["status"] == "ready"
        assert engine.totals.requests == served + 1      # the warm-up token came before "ready"
    broken = SlowEngine(engine)
    broken.fail_next.append(RuntimeError("kernel launch failed"))
    with ServerThread(app_for(settings_for(tiny_dir), lambda: broken), wait_ready=False) as s:
        deadline = time.monotonic() + 30
        while (h := httpx.get(s.url + "/health").json())["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h["status"] == "failed" and "warm-up" in h["error"] and "kernel launch failed" in h["error"]


# ---- 6. energy per token in the telemetry and /metrics -------------------------------------------------------------


def test_energy_reaches_the_response_and_metrics(engine: Engine, tiny_dir: Path, tmp_path: Path) -> None:
    from test_energy import fake_jetson

    from edgespec.energy import RailEnergy, find_rails

    assert engine.energy is None                                 # CPU: no meter, no figure
    with serve(engine, tiny_dir) as s:
        assert chat(s.url, max_tokens=4).json()["edgespec"]["energy"] is None
    fake_jetson(tmp_path, {"VDD_IN": (19000, 1000)})             # a 19 W Jetson board
    meter = RailEnergy(find_rails(tmp_path), period_s=0.005)
    engine.energy = meter
    try:
        with serve(SlowEngine(engine, delay=0.01), tiny_dir) as s:
            body = chat(s.url, max_tokens=12, stop=[], edgespec={"num_draft_tokens": 0}).json()
            metrics = httpx.get(s.url + "/metrics").text
    finally:
        engine.energy = None
        meter.close()
    e = body["edgespec"]["energy"]
    assert e["avg_watts"] == pytest.approx(19.0, rel=0.05) and e["joules"] > 0
    assert e["joules_per_token"] == pytest.approx(e["joules"] / body["usage"]["completion_tokens"], rel=1e-3)
    total = next(float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith("edgespec:energy_joules_total"))
    assert total == pytest.approx(e["joules"], rel=1e-3)
    assert "edgespec:request_joules_per_token_count 1.0" in metrics


# ---- 5. tools on any template; closed objects and bounded values ------------------------------------------------


GRIP = {"type": "function", "function": {"name": "grip", "description": "close the gripper", "parameters": {
    "type": "object", "properties": {"force": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["force"]}}}


def accepts(constraint: Any, tokenizer: Any, text: str) -> bool:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return constraint.valid_prefix(ids) == len(ids)


def test_template_without_tool_section_gets_the_generic_format(engine: Engine) -> None:
    from edgespec.serving.tools import generic_tool_messages, renders_tools

    assert not renders_tools(engine.tokenizer.chat_template)       # the tiny model's template, like the demo's
    history = [{"role": "system", "content": "You drive a robot arm."},
               {"role": "user", "content": "grip the cup"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "grip", "arguments": {"force": 3}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "gripped"}]
    messages = generic_tool_messages(history, [GRIP])
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    assert text.startswith("<|im_start|>system\nYou drive a robot arm.\n\n# Tools")
    assert json.dumps(GRIP) in text
    assert '<tool_call>\n{"name": "grip", "arguments": {"force": 3}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\ngripped\n</tool_response>" in text
    assert all(m["role"] in ("system", "user", "assistant") for m in messages)


def test_tools_reach_the_model_and_calls_parse_back(tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    wide = Engine.load(build_plan(settings_for(tiny_dir, max_seq_len=2048)))   # byte tokens: the tools take ~700
    with serve(wide, tiny_dir, max_seq_len=2048) as s:
        plain = chat(s.url, max_tokens=2).json()["usage"]["prompt_tokens"]
        with caplog.at_level("INFO", logger="edgespec.serving"):
            r = chat(s.url, tools=[GRIP], tool_choice="auto", max_tokens=2)
            forced = chat(s.url, tools=[GRIP], tool_choice="required", max_tokens=160,
                          chat_template_kwargs={"enable_thinking": False}, parallel_tool_calls=False)
            chat(s.url, tools=[GRIP], max_tokens=2)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > plain + len(json.dumps(GRIP))     # the tools are in the prompt
    body = forced.json()
    assert forced.status_code == 200, forced.text
    call = body["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "grip" and set(json.loads(call["arguments"])) == {"force"}
    assert body["choices"][0]["finish_reason"] == "tool_calls" and body["choices"][0]["message"]["content"] is None
    lines = [rec.getMessage() for rec in caplog.records if "no tool section" in rec.getMessage()]
    assert len(lines) == 1 and "generic" in lines[0]             # said once, not per request


def test_forced_calls_close_their_objects(engine: Engine) -> None:
    from edgespec.serving.grammar import JSON_DEFAULTS, GrammarCompiler
    from edgespec.serving.tools import tool_grammar

    open_schema = {"name": "move", "parameters": {"type": "object", "properties": {
        "to": {"enum": ["cup", "home"]}, "pose": {"type": "object", "properties": {"x": {"type": "integer"}}}}}}
    compiler = GrammarCompiler(engine.tokenizer, 272)
    head = '<tool_call>\n{"name": "move", "arguments": '
    closed = compiler.lark(tool_grammar([open_schema], "json", JSON_DEFAULTS, False))
    assert accepts(closed, engine.tokenizer, head + '{"to": "cup", "pose": {"x": 1}}}\n</tool_call>')
    for invented in ('{"to": "cup", "speed"', '{"to": "cup", "pose": {"x": 1, "y"'):
        constraint = compiler.lark(tool_grammar([open_schema], "json", JSON_DEFAULTS, False))
        assert not accepts(constraint, engine.tokenizer, head + invented), invented
    said = dict(open_schema, parameters=dict(open_schema["parameters"], additionalProperties=True))
    constraint = compiler.lark(tool_grammar([said], "json", JSON_DEFAULTS, False))
    assert accepts(constraint, engine.tokenizer, head + '{"to": "cup", "speed": 3')   # the schema's word wins


@pytest.mark.parametrize("schema,text,ok", [
    ({"type": "integer"}, "1" * 40, False),                     # unbounded digits: cut at 2**53 - 1
    ({"type": "integer"}, str(2**53 - 1), True),
    ({"type": "integer", "maximum": 10**18}, "1" * 18, True),   # the schema's own bound wins
    ({"type": "number"}, "0." + "1" * 30, False),               # at most 6 decimals by default
    ({"type": "number"}, "2.125", True),
    ({"type": "string"}, '"' + "a" * 1100 + '"', False),        # 1024 characters by default
    ({"type": "string", "maxLength": 2000}, '"' + "a" * 1100 + '"', True),
])
def test_json_values_are_bounded_by_default(engine: Engine, schema: dict, text: str, ok: bool) -> None:
    from edgespec.serving.grammar import GrammarCompiler

    constraint = GrammarCompiler(engine.tokenizer, 272).json_schema(schema)
    assert accepts(constraint, engine.tokenizer, text) is ok


def test_xml_string_parameters_are_bounded(engine: Engine) -> None:
    from edgespec.serving.grammar import JSON_DEFAULTS, GrammarCompiler
    from edgespec.serving.tools import tool_grammar

    say = {"name": "say", "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                                         "required": ["text"]}}
    head = "<tool_call>\n<function=say>\n<parameter=text>\n"
    compiler = GrammarCompiler(engine.tokenizer, 272)
    assert accepts(compiler.lark(tool_grammar([say], "xml", JSON_DEFAULTS, False)), engine.tokenizer, head + "hi")
    assert not accepts(compiler.lark(tool_grammar([say], "xml", JSON_DEFAULTS, False)), engine.tokenizer,
                       head + "a" * 1100)


# ---- 1. the engine's pause and continue is exact -------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 7}], ids=["greedy", "seeded"])
def test_paused_and_continued_equals_uninterrupted(engine: Engine, sampling: dict[str, Any]) -> None:
    from edgespec.engine import Request
    from edgespec.speculative.sampling import SamplingParams

    keys = iter(range(100))

    def request(**kw: Any) -> Request:
        # A key of its own: every run starts from an empty prefix cache (prefill splits round differently).
        return Request(messages=CHAT, max_tokens=120, sampling=SamplingParams(**sampling), num_draft_tokens=2,
                       enable_thinking=False, cache_key=f"run-{next(keys)}", **kw)

    whole = engine.complete(request())
    if len(whole.token_ids) < 20:
        pytest.skip("the tiny model stopped early")
    # A stop string in the middle of the answer: the pause must not lose a match that straddles it.
    stop_at = whole.text[len(whole.text) // 2:len(whole.text) // 2 + 3]
    whole_stopped = engine.complete(request(stop=[stop_at]))
    for stops in ([], [stop_at]):
        calls = 0

        def every_third() -> bool:
            nonlocal calls
            calls += 1
            return calls % 3 == 0

        req = request(stop=stops, preempt=every_third)
        pieces, segments = [], 0
        req.on_text = pieces.append
        while True:
            done = engine.complete(req)
            segments += 1
            if done.finish_reason != "preempted":
                break
        reference = whole_stopped if stops else whole
        assert segments > 2
        assert done.text == reference.text == "".join(pieces) and done.finish_reason == reference.finish_reason
        if not stops:   # a stop string ends the last cycle: the tokens it verified past the match may differ
            assert done.token_ids == reference.token_ids
            assert done.telemetry.generated_tokens == reference.telemetry.generated_tokens


def test_sigterm_is_not_held_by_a_partial_body(tiny_dir: Path) -> None:
    from serving_helpers import ServerProcess

    server = ServerProcess(str(tiny_dir), drafter="ngram", max_seq_len=256, read_timeout_s=60)
    with server:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        assert chat(server.url, max_tokens=2).status_code == 200     # served while the half body waits
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        reply = read_all(sock, 30.0)
        server.proc.wait(60)
        took = time.monotonic() - t0
        sock.close()
    assert server.returncode == 0
    assert reply.startswith(b"HTTP/1.1 503") and b'"code":"draining"' in reply.replace(b" ", b"")
    assert took < 15.0, took       # not the 60 s read timeout, nor request_timeout_s + 15 s
