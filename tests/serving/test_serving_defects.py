"""Regression tests for the defects fuzzing found in the agent server: invalid Unicode, a vanishing top_p, the
failure counter, the OpenAPI contract, request ids in responses and logs, and clean exits (port clash, SIGTERM
while the model loads)."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from serving_helpers import ServerThread, app_for, free_socket, write_tiny_chat_model

from edgespec.config import Settings
from edgespec.speculative.sampling import SamplingParams, sample_token, target_probs

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("defects") / "tiny")


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[ServerThread]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    settings = Settings(model=str(tiny_dir), max_seq_len=256, served_model_name="tiny", max_tokens=8,
                        api_key=KEY, max_body_bytes=4096)
    with ServerThread(app_for(settings)) as srv:
        yield srv
    torch.set_num_threads(threads)


def _failures(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for m in re.finditer(r'^edgespec:request_failure_total\{reason="([^"]+)"\} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def test_lone_surrogate_is_a_400_and_the_connection_lives(server: ServerThread) -> None:
    raw_chat = b'{"messages": [{"role": "user", "content": "grip \\ud800 now"}], "max_tokens": 2}'
    raw_prompt = b'{"prompt": "\\udfff", "max_tokens": 2}'
    raw_model = b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}'
    headers = {**AUTH, "content-type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as c:
        r = c.post("/v1/chat/completions", content=raw_chat)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_unicode"
        assert r.json()["error"]["param"] == "messages[0].content"
        r = c.post("/v1/completions", content=raw_prompt)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        # An error message that echoes the bad text still leaves as valid JSON (escaped).
        r = c.post("/v1/chat/completions", content=raw_model)
        assert r.status_code == 404 and "model_not_found" in r.text
        # Same keep-alive connection, still serving.
        assert c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}).status_code == 200


def test_vanishing_top_p_samples_the_top_token(server: ServerThread) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=30,
                   json={"messages": CHAT, "max_tokens": 4, "temperature": 1.0, "top_p": 1e-46, "seed": 1})
    assert r.status_code == 200, r.text
    logits = torch.tensor([0.5, 3.0, 1.0, -2.0])
    params = SamplingParams(temperature=1.0, top_p=1e-46)
    probs = target_probs(logits, params)
    assert torch.isfinite(probs).all() and probs.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert int(sample_token(logits, params, torch.Generator().manual_seed(0))) == 1


def test_every_non_2xx_is_counted(server: ServerThread) -> None:
    before = _failures(server.url)
    url = server.url + "/v1/chat/completions"
    statuses = [
        httpx.post(url, json={"messages": CHAT}).status_code,                                   # 401 no key
        httpx.post(url, headers=AUTH, content=b"x" * 5000).status_code,                         # 413
        httpx.post(url, headers=AUTH, json={"messages": []}).status_code,                       # 422
        httpx.post(url, headers=AUTH, json={"messages": CHAT, "model": "nope"}).status_code,    # 404
        httpx.post(url, headers=AUTH, json={"messages": CHAT, "n": 3}).status_code,             # 400
        httpx.get(server.url + "/v1/nothing", headers=AUTH).status_code,                        # 404 route
    ]
    assert statuses == [401, 413, 422, 404, 400, 404]
    after = _failures(server.url)
    gained = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert sum(gained.values()) == len(statuses)
    for reason in ("invalid_api_key", "body_too_large", "validation_error", "model_not_found", "unsupported_field",
                   "unknown_route"):
        assert gained.get(reason) == 1, (reason, gained)


def test_openapi_declares_the_real_statuses(server: ServerThread) -> None:
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "ErrorResponse" in spec["components"]["schemas"]
    chat = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat) >= {"200", "400", "401", "404", "413", "422", "429", "500", "503", "504"}
    for status in ("400", "422", "429", "503"):
        ref = chat[status]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ErrorResponse")
    assert "text/event-stream" in chat["200"]["content"]
    for path, ops in spec["paths"].items():
        for op in ops.values():
            for status, resp in op["responses"].items():
                if status.startswith(("4", "5")) and "application/json" in resp.get("content", {}):
                    schema = resp["content"]["application/json"]["schema"]
                    assert schema.get("$ref", "").endswith("/ErrorResponse"), (path, status)


def test_request_id_is_echoed_or_made(server: ServerThread) -> None:
    url = server.url + "/v1/chat/completions"
    r = httpx.post(url, headers={**AUTH, "x-request-id": "robot-7.turn-3"}, json={"messages": CHAT, "max_tokens": 2})
    assert r.headers["x-request-id"] == "robot-7.turn-3"
    r = httpx.post(url, headers={**AUTH, "x-request-id": "bad id\twith spaces"}, json={"messages": []})
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    assert re.fullmatch(r"[0-9a-f]{32}", httpx.get(server.url + "/health").headers["x-request-id"])


# ---- the process ---------------------------------------------------------------------------------------------


def _serve_cmd(model: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "edgespec.serving", "--model", str(model), "--port", str(port), *extra]


def test_port_in_use_exits_1_with_one_line(tiny_dir: Path) -> None:
    sock = free_socket()
    sock.listen(1)
    port = sock.getsockname()[1]
    try:
        proc = subprocess.run(_serve_cmd(tiny_dir, port), capture_output=True, text=True, timeout=120)
    finally:
        sock.close()
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "cannot listen" in lines[0] and str(port) in lines[0], proc.stderr


def test_sigterm_while_loading_exits_cleanly_and_logs_carry_time_and_id(tiny_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    # A served request first (to see its log line), then SIGTERM to a fresh process while it loads.
    with log.open("wb") as out:
        proc = subprocess.Popen(_serve_cmd(tiny_dir, port, "--log-level", "info"), stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            r = httpx.post(url + "/v1/chat/completions", headers={"x-request-id": "turn-42"},
                           json={"messages": CHAT, "max_tokens": 2}, timeout=60)
            assert r.status_code == 200
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(120) == 0
    text = log.read_text()
    done = [ln for ln in text.splitlines() if "request done" in ln]
    stamp = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} INFO edgespec\.serving \[turn-42\] "
    assert done and re.match(stamp, done[0]), text

    loading = subprocess.Popen(_serve_cmd(tiny_dir, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            break       # answering: uvicorn is up, the model loads or has just loaded
        except httpx.TransportError:
            time.sleep(0.02)
    loading.send_signal(signal.SIGTERM)
    output = loading.communicate(timeout=120)[0].decode()     # waits, reads and closes the pipe
    rc = loading.returncode
    assert rc in (0, 143), output
    assert "terminate called" not in output and "Traceback" not in output, output


def test_openapi_error_bodies_are_valid_json_schema_instances(server: ServerThread) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={"messages": CHAT, "top_p": 0})
    body = r.json()
    assert r.status_code == 422 and set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    json.dumps(body)
