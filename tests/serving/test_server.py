"""The agent server (edgespec.serving) end to end: a real uvicorn on 127.0.0.1 driven by the official openai client.

A tiny random chat model (tests/serving_helpers.py) keeps every request to milliseconds; ``SlowEngine`` stretches
generation where a test needs work in flight (queueing, disconnects, timeouts).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from serving_helpers import ServerThread, app_for, write_tiny_chat_model
from test_grammar import ROBOT_PLAN, check_robot_plan

from edgespec.config import Settings
from edgespec.engine import Completion, Engine, Request
from edgespec.errors import ConfigError
from edgespec.plan import build_plan
from edgespec.serving import is_loopback, run_server

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Pick up the red cup and put it on the shelf."}]


# ---- fixtures -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("server") / "tiny")


def settings_for(model_dir: Path, **overrides: Any) -> Settings:
    base = dict(model=str(model_dir), max_seq_len=512, drafter="ngram", served_model_name=MODEL, max_tokens=32)
    base.update(overrides)
    return Settings(**base)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[Engine]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one thread is ~100x faster than two fighting other jobs
    yield Engine.load(build_plan(settings_for(tiny_dir)))
    torch.set_num_threads(threads)


class SlowEngine:
    """Wraps an engine: sleeps ``delay`` s per decode cycle and can fail on demand; records every result."""

    def __init__(self, engine: Engine, delay: float = 0.0) -> None:
        self._engine = engine
        self.delay = delay
        self.fail_next: list[BaseException] = []
        self.results: list[Completion] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def complete(self, req: Request) -> Completion:
        if self.fail_next:
            raise self.fail_next.pop(0)
        inner = req.cancelled

        def cancelled() -> bool:
            time.sleep(self.delay)
            return bool(inner and inner())

        req.cancelled = cancelled
        result = self._engine.complete(req)
        req.cancelled = inner   # a paused (preempted) request comes back: wrap its own check again, not ours
        self.results.append(result)
        return result


def serve(engine: Any, tiny_dir: Path, **overrides: Any) -> ServerThread:
    return ServerThread(app_for(settings_for(tiny_dir, **overrides), engine))


@pytest.fixture(scope="module")
def server(engine: Engine, tiny_dir: Path) -> Iterator[ServerThread]:
    with serve(engine, tiny_dir) as s:
        yield s


def client_for(s: ServerThread, **kw: Any) -> Any:
    kw.setdefault("max_retries", 0)
    kw.setdefault("timeout", 60)
    return openai.OpenAI(base_url=s.url + "/v1", api_key=kw.pop("api_key", "unused"), **kw)


@pytest.fixture()
def client(server: ServerThread) -> Any:
    return client_for(server)


def metric(url: str, name: str, **labels: str) -> float:
    """Value of one sample from /metrics (0 when absent)."""
    text = httpx.get(url + "/metrics").text
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_idle(url: str, timeout: float = 10.0) -> float:
    """Seconds until /health reports nothing running or waiting."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        h = httpx.get(url + "/health").json()
        if h.get("running") == 0 and h.get("waiting") == 0:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"server still busy after {timeout}s: {h}")


# ---- happy paths ----------------------------------------------------------------------------------------------


def test_health_and_models(server: ServerThread, client: Any) -> None:
    h = httpx.get(server.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ready" and h.json()["drafter"] == "ngram"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_plain(client: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 10 and 1 <= u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.completion_tokens_details.reasoning_tokens >= 0
    tel = r.model_extra["edgespec"]
    for key in ("drafter", "cycles", "acceptance_length", "per_position_rate", "accepted_per_pos", "prefill_ms",
                "decode_ms", "decode_tok_s", "queue_ms"):
        assert key in tel, key
    assert tel["drafter"] == "ngram" and tel["acceptance_length"] >= 1.0
    # max_completion_tokens wins over max_tokens; greedy output is deterministic.
    r2 = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, max_completion_tokens=12)
    assert r2.choices[0].message.content == choice.message.content


def test_chat_stream_is_incremental_and_ends_with_usage(engine: Engine, tiny_dir: Path, client: Any) -> None:
    reference = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24)
    with serve(SlowEngine(engine, delay=0.02), tiny_dir) as slow:
        stream = client_for(slow).chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=24, stream=True, stream_options={"include_usage": True})
        chunks, arrivals = [], []
        for chunk in stream:
            chunks.append(chunk)
            arrivals.append(time.monotonic())
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content]
    assert len(content) >= 3
    # Pieces arrive as they are generated, not in one burst at the end.
    assert arrivals[content[-1]] - arrivals[content[0]] > 0.1
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].model_extra["edgespec"]["drafter"] == "ngram"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == reference.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.choices[0].message.content


def test_text_completions(client: Any, engine: Engine) -> None:
    r = client.completions.create(model=MODEL, prompt="The robot arm", max_tokens=8)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8 and "edgespec" in r.model_extra
    ids = engine.tokenizer.encode("The robot arm")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8)
    assert by_ids.usage.prompt_tokens == len(ids)
    pieces = list(client.completions.create(model=MODEL, prompt="The robot arm", max_tokens=8, stream=True))
    assert pieces[-1].choices[0].finish_reason is not None
    streamed = "".join(p.choices[0].text for p in pieces)
    assert streamed == r.choices[0].text


def test_json_schema_robot_plan(client: Any) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "robot_plan", "schema": ROBOT_PLAN, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=300, response_format=fmt)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    check_robot_plan(json.loads(r.choices[0].message.content))
    streamed = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=300, response_format=fmt,
                                              stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == r.choices[0].message.content
    obj = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=300,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_stop_strings_cut_the_text(client: Any) -> None:
    prompt = [{"role": "user", "content": "count: 1 2 3 4 5 6 7 8 9"}]
    full = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=40).choices[0].message.content
    printable = [m.group(0) for m in re.finditer(r"[^\ufffd]{2}", full)]
    assert printable, f"need two printable characters in {full!r}"
    stop = printable[len(printable) // 2]
    cut = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=40, stop=[stop, "never-seen"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[:full.find(stop)]
    single = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=40, stop=stop)
    assert single.choices[0].message.content == cut.choices[0].message.content


def test_thinking_switch(client: Any) -> None:
    def ask(flag: bool) -> Any:
        return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": flag}})
    on, off = ask(True), ask(False)
    # Thinking off closes an empty think block in the prompt; on leaves <think> open for the model.
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert on.usage.completion_tokens_details.reasoning_tokens > 0
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_per_request_draft_knob(client: Any) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40,
                                           extra_body={"edgespec": {"num_draft_tokens": 0}})
    spec = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40)
    assert plain.model_extra["edgespec"]["drafts"] == 0
    assert plain.choices[0].message.content == spec.choices[0].message.content  # lossless greedy


def test_metrics_counters_move(server: ServerThread, client: Any) -> None:
    names = ["edgespec:request_success_total", "edgespec:prompt_tokens_total", "edgespec:generation_tokens_total",
             "edgespec:spec_decode_num_drafts_total", "edgespec:spec_decode_num_draft_tokens_total",
             "edgespec:e2e_request_latency_seconds_count", "edgespec:time_to_first_token_seconds_count"]

    def snapshot() -> dict[str, float]:
        out = {n: metric(server.url, n) for n in names if n != "edgespec:request_success_total"}
        out["success"] = metric(server.url, "edgespec:request_success_total", finished_reason="length")
        return out

    before = snapshot()
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=48)
    after = snapshot()
    assert r.choices[0].finish_reason == "length"
    assert after["success"] == before["success"] + 1
    assert after["edgespec:prompt_tokens_total"] - before["edgespec:prompt_tokens_total"] == r.usage.prompt_tokens
    assert (after["edgespec:generation_tokens_total"] - before["edgespec:generation_tokens_total"]
            == r.usage.completion_tokens)
    tel = r.model_extra["edgespec"]
    assert after["edgespec:spec_decode_num_drafts_total"] - before["edgespec:spec_decode_num_drafts_total"] == \
        tel["drafts"]
    assert tel["drafts"] > 0, "the n-gram drafter should find the random model's loops"
    latency = "edgespec:e2e_request_latency_seconds_count"
    assert after[latency] == before[latency] + 1
    text = httpx.get(server.url + "/metrics").text
    assert 'edgespec:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text
    assert "edgespec:spec_decode_num_accepted_tokens_total" in text


# ---- bad inputs -----------------------------------------------------------------------------------------------

LONG = "word " * 700
BAD_INPUTS: list[tuple[str, str, str, Any, int, str | None]] = [
    # (case, method, path, json body, status, param or code expected in the error)
    ("unknown route", "GET", "/v1/nothing", None, 404, "unknown_route"),
    ("wrong method", "GET", "/v1/chat/completions", None, 405, "method_not_allowed"),
    ("unknown model", "POST", "/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}, 404, "model"),
    ("unknown model card", "GET", "/v1/models/gpt-9", None, 404, "model"),
    ("no messages", "POST", "/v1/chat/completions", {"model": MODEL}, 422, "messages"),
    ("empty messages", "POST", "/v1/chat/completions", {"messages": []}, 422, "messages"),
    ("bad role", "POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 422,
     "messages[0].role"),
    ("temperature too high", "POST", "/v1/chat/completions", {"messages": CHAT, "temperature": 9}, 422,
     "temperature"),
    ("top_p zero", "POST", "/v1/chat/completions", {"messages": CHAT, "top_p": 0}, 422, "top_p"),
    ("max_tokens zero", "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 422, "max_tokens"),
    ("max_tokens string", "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": "many"}, 422,
     "max_tokens"),
    ("five stops", "POST", "/v1/chat/completions", {"messages": CHAT, "stop": list("abcde")}, 422, "stop"),
    ("n > 1", "POST", "/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "n"),
    ("tool_choice without tools", "POST", "/v1/chat/completions",
     {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("logprobs", "POST", "/v1/chat/completions", {"messages": CHAT, "logprobs": True}, 400, "logprobs"),
    ("stream_options without stream", "POST", "/v1/chat/completions",
     {"messages": CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("drafts above server K", "POST", "/v1/chat/completions",
     {"messages": CHAT, "edgespec": {"num_draft_tokens": 9}}, 400, "edgespec.num_draft_tokens"),
    ("drafts out of range", "POST", "/v1/chat/completions",
     {"messages": CHAT, "edgespec": {"num_draft_tokens": 99}}, 422, "edgespec.num_draft_tokens"),
    ("unknown edgespec knob", "POST", "/v1/chat/completions",
     {"messages": CHAT, "edgespec": {"warp": 1}}, 422, "edgespec.warp"),
    ("unknown template kwarg", "POST", "/v1/chat/completions",
     {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, 422, "chat_template_kwargs.tools"),
    ("bad response_format", "POST", "/v1/chat/completions",
     {"messages": CHAT, "response_format": {"type": "yaml"}}, 422, "response_format"),
    ("bad schema", "POST", "/v1/chat/completions",
     {"messages": CHAT, "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     400, "response_format"),
    ("recursive schema", "POST", "/v1/chat/completions",
     {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
         "type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}}}}, 400, "grammar_error"),
    ("image part", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]"),
    ("prompt too long", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": LONG}]}, 400, "context_length_exceeded"),
    ("token id out of vocab", "POST", "/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt"),
    ("batch of prompts", "POST", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("echo", "POST", "/v1/completions", {"prompt": "a", "echo": True}, 400, "echo"),
]


@pytest.mark.parametrize("case,method,path,body,status,expect", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs(server: ServerThread, case: str, method: str, path: str, body: Any, status: int,
                    expect: str | None) -> None:
    r = httpx.request(method, server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert expect in (err["param"], err["code"]), err


def test_malformed_bodies(server: ServerThread) -> None:
    url = server.url + "/v1/chat/completions"
    r = httpx.post(url, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url, content=b"x" * (2 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts the bytes as they come
        for _ in range(40):
            yield b" " * 65536

    r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = httpx.post(url, content=b"messages", headers={"content-type": "text/plain"})
    assert r.status_code == 422 and "error" in r.json()


def test_openai_client_sees_errors(client: Any) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, n=3)
    assert info.value.body["param"] == "n"


# ---- hardening ------------------------------------------------------------------------------------------------


def test_queue_full_is_429_with_retry_after(engine: Engine, tiny_dir: Path) -> None:
    slow = SlowEngine(engine, delay=0.03)
    with serve(slow, tiny_dir, max_queue=1) as s:
        results: list[Any] = []

        def ask() -> None:
            results.append(client_for(s).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20))

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        # The third request must find the first one running and the second queued: wait for that state (the
        # gauges) rather than for a fixed time, which a loaded machine overruns.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (metric(s.url, "edgespec:num_requests_running") >= 1
                                                   and metric(s.url, "edgespec:num_requests_waiting") >= 1):
            time.sleep(0.005)
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4})
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full"
        for t in threads:
            t.join(60)
        assert len(results) == 2 and all(x.usage.completion_tokens == 20 for x in results)
        assert metric(s.url, "edgespec:request_failure_total", reason="queue_full") == 1


def test_client_disconnect_cancels_running_work(engine: Engine, tiny_dir: Path) -> None:
    slow = SlowEngine(engine, delay=0.02)
    with serve(slow, tiny_dir) as s:
        body = {"messages": CHAT, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            seen = [next(lines) for _ in range(6)]
            assert all(x.startswith("data: ") or x == "" for x in seen)
        assert wait_idle(s.url) < 2.0
        assert slow.results[-1].finish_reason == "cancelled"
        assert slow.results[-1].completion_tokens < 400
        # Non-streaming: the client gives up after 0.5 s; the server notices and stops too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 400}, timeout=0.5)
        assert wait_idle(s.url) < 2.0
        assert slow.results[-1].finish_reason == "cancelled"
        assert metric(s.url, "edgespec:request_success_total", finished_reason="cancelled") == 2


def test_disconnect_withdraws_queued_request(engine: Engine, tiny_dir: Path) -> None:
    slow = SlowEngine(engine, delay=0.02)
    with serve(slow, tiny_dir) as s:
        runner = threading.Thread(target=lambda: client_for(s).chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=60))
        runner.start()
        time.sleep(0.2)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 60}, timeout=0.3)
        time.sleep(0.1)
        assert httpx.get(s.url + "/health").json()["waiting"] == 0
        runner.join(30)
        assert len(slow.results) == 1  # the withdrawn request never ran
        assert metric(s.url, "edgespec:request_failure_total", reason="cancelled") == 1


def test_request_timeout(engine: Engine, tiny_dir: Path) -> None:
    slow = SlowEngine(engine, delay=0.1)
    # Arrival order (no short-request priority): the 4-token request waits behind the long one and times out.
    with serve(slow, tiny_dir, request_timeout_s=0.5, short_request_tokens=0) as s:
        c = client_for(s)
        t0 = time.monotonic()
        r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=400)
        assert time.monotonic() - t0 < 3.0
        assert r.choices[0].finish_reason == "length" and r.model_extra["edgespec"]["timed_out"] is True
        assert 0 < r.usage.completion_tokens < 400
        chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=400, stream=True))
        finals = [x for x in chunks if x.choices and x.choices[0].finish_reason]
        assert finals[-1].choices[0].finish_reason == "length"
        # A request whose deadline passes while it waits in the queue never starts: 504.
        slow.delay = 0.4  # cycles end at 0.4 s (in time) and 0.8 s (timed out)
        first = threading.Thread(target=lambda: c.chat.completions.create(model=MODEL, messages=CHAT,
                                                                          max_tokens=400))
        first.start()
        while httpx.get(s.url + "/health").json()["running"] == 0:
            time.sleep(0.01)
        r2 = httpx.post(s.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}, timeout=30)
        first.join(30)
        assert r2.status_code == 504 and r2.json()["error"]["code"] == "timeout"


def test_out_of_memory_fails_one_request_only(engine: Engine, tiny_dir: Path) -> None:
    flaky = SlowEngine(engine)
    with serve(flaky, tiny_dir) as s:
        c = client_for(s)
        flaky.fail_next.append(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        with pytest.raises(openai.APIStatusError) as info:
            c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8)
        assert info.value.status_code == 503 and info.value.body["code"] == "out_of_memory"
        assert c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8).usage.completion_tokens > 0
        flaky.fail_next.append(RuntimeError("kernel exploded"))
        with pytest.raises(openai.InternalServerError):
            c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8)
        stream = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, stream=True)
        assert "".join(x.choices[0].delta.content or "" for x in stream if x.choices) is not None
        assert httpx.get(s.url + "/health").status_code == 200
        assert metric(s.url, "edgespec:request_failure_total", reason="out_of_memory") == 1
        # An engine failure after the stream started arrives as an error event.
        flaky.fail_next.append(RuntimeError("boom"))
        with httpx.stream("POST", s.url + "/v1/chat/completions", json={"messages": CHAT, "stream": True}) as r:
            events = [x for x in r.iter_lines() if x.startswith("data: ")]
        assert r.status_code == 200 and '"error"' in events[-2] and events[-1] == "data: [DONE]"


def test_api_key(engine: Engine, tiny_dir: Path) -> None:
    with serve(engine, tiny_dir, api_key="s3cret") as s:
        with pytest.raises(openai.AuthenticationError):
            client_for(s, api_key="wrong").models.list()
        r = httpx.get(s.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client_for(s, api_key="s3cret").models.list().data[0].id == MODEL
        assert httpx.get(s.url + "/health").status_code == 200  # probes stay open
        assert httpx.get(s.url + "/metrics").status_code == 200


def test_loading_then_ready_and_failed_load(engine: Engine, tiny_dir: Path) -> None:
    gate = threading.Event()

    def factory() -> Engine:
        gate.wait(30)
        return engine

    with ServerThread(app_for(settings_for(tiny_dir), factory), wait_ready=False) as s:
        h = httpx.get(s.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "loading"
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": CHAT})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_loading" and "retry-after" in r.headers
        gate.set()
        for _ in range(200):
            if httpx.get(s.url + "/health").status_code == 200:
                break
            time.sleep(0.02)
        assert httpx.get(s.url + "/health").json()["status"] == "ready"

    def broken() -> Engine:
        raise ConfigError("model folder /nowhere not found")

    with ServerThread(app_for(settings_for(tiny_dir), broken), wait_ready=False) as s:
        for _ in range(100):
            h = httpx.get(s.url + "/health")
            if h.json()["status"] == "failed":
                break
            time.sleep(0.02)
        assert h.status_code == 503 and "nowhere" in h.json()["error"]


def test_refuses_public_bind_without_api_key(tiny_dir: Path) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.20")
    with pytest.raises(ConfigError, match="api_key"):
        run_server(build_plan(settings_for(tiny_dir, host="0.0.0.0")))
