"""Issue 49, the connection layer under hostile traffic, each against the real server process on real sockets:
stalled half-headers from one client, TCP_NODELAY, garbage bytes, chunked bodies over the limit, refusals in
/metrics, and the drain (``/health`` 503 draining, a deadline that ends streams, then exit 0)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from serving_helpers import ServerProcess, ServerThread, app_for, write_tiny_chat_model

from edgespec.config import Settings

CHAT = {"messages": [{"role": "user", "content": "hello robot"}], "max_tokens": 2}
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
HALF_HEADER = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("hostile") / "tiny")


def serve(tiny_dir: Path, log: Path, **settings: Any) -> ServerProcess:
    settings.setdefault("drafter", "ngram")
    settings.setdefault("max_seq_len", 256)
    return ServerProcess(str(tiny_dir), env=ENV, log_path=log, **settings)


def http_protocol(state: Any) -> Any:
    from edgespec.serving.app import http_protocol as make
    return make(state)


def connect_from(host: str, port: int) -> socket.socket:
    """A connection to the server from source address ``host`` (any 127.0.0.0/8 address is this machine)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def read_all(sock: socket.socket, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    out = b""
    while piece := sock.recv(65536):
        out += piece
    return out


def refusals(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^edgespec:connection_refusals_total\{reason="([^"]+)"\} (\S+)$', text, re.M)}


# ---- 1. stalled half-headers from one client ----------------------------------------------------------------------


def test_stalled_half_headers_from_one_client_do_not_lock_out_another(tiny_dir: Path, tmp_path: Path) -> None:
    with serve(tiny_dir, tmp_path / "server.log", read_timeout_s=60) as server:
        stalled = []
        for _ in range(70):
            sock = connect_from("127.0.0.2", server.port)
            sock.sendall(HALF_HEADER)
            stalled.append(sock)
        time.sleep(0.3)
        t0 = time.monotonic()
        health = httpx.get(server.url + "/health", timeout=30)       # from 127.0.0.1: another client
        answer = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=30)
        took = time.monotonic() - t0
        assert health.status_code == 200 and health.json()["status"] == "ready", health.text
        assert answer.status_code == 200, answer.text
        assert took < 10.0, took          # the bench's figure is the 3 s target; the machine is shared
        counted = refusals(server.url)
        # 64 connections fit; the other 6 of the same client were refused, and the newcomers evicted its oldest.
        assert counted.get("too_many_connections", 0) >= 6 and counted.get("evicted", 0) >= 1, counted
        replies = []
        for sock in stalled[-6:]:
            replies.append(read_all(sock, 5.0))
            sock.close()
        assert all(r.startswith(b"HTTP/1.1 503") and b"too_many_connections" in r for r in replies), replies[:1]
        for sock in stalled[:-6]:
            sock.close()


def test_one_client_is_capped_and_others_are_not(tiny_dir: Path) -> None:
    settings = Settings(model=str(tiny_dir), max_seq_len=256, max_client_connections=3)
    app = app_for(settings)
    with ServerThread(app, http=http_protocol(app.state.edgespec)) as s:
        held = [connect_from("127.0.0.1", s.port) for _ in range(3)]
        time.sleep(0.1)
        over = connect_from("127.0.0.1", s.port)
        over.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = read_all(over, 5.0)
        assert reply.startswith(b"HTTP/1.1 503") and b"too_many_connections" in reply
        other = connect_from("127.0.0.3", s.port)
        other.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_all(other, 5.0).startswith(b"HTTP/1.1 200")
        for sock in (*held, over, other):
            sock.close()
        assert refusals(s.url).get("client_connections") == 1


# ---- 3. TCP_NODELAY ------------------------------------------------------------------------------------------------


def request_bytes(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(data)) + data


def read_response(sock: socket.socket) -> bytes:
    """One Content-Length response off a keep-alive connection."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head, _, rest = buf.partition(b"\r\n\r\n")
    size = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(rest) < size:
        rest += sock.recv(65536)
    return head


def test_accepted_sockets_have_tcp_nodelay(tiny_dir: Path) -> None:
    settings = Settings(model=str(tiny_dir), max_seq_len=256)
    app = app_for(settings)
    protocol = http_protocol(app.state.edgespec)
    with ServerThread(app, http=protocol) as s, socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.sendall(request_bytes(CHAT))
        read_response(sock)
        conns = [c for held in protocol.table._by_host.values() for c in held]
        assert conns
        for conn in conns:
            raw = conn._raw.get_extra_info("socket")
            assert raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


def test_keep_alive_is_as_fast_as_a_fresh_connection(tiny_dir: Path, tmp_path: Path) -> None:
    body = {**CHAT, "max_tokens": 1}
    with serve(tiny_dir, tmp_path / "server.log") as server:
        keep, fresh = [], []
        with socket.create_connection(("127.0.0.1", server.port)) as kept:
            for _ in range(15):
                t0 = time.perf_counter()
                kept.sendall(request_bytes(body))
                read_response(kept)
                keep.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                with socket.create_connection(("127.0.0.1", server.port)) as new:
                    new.sendall(request_bytes(body))
                    read_response(new)
                fresh.append(time.perf_counter() - t0)
    # With Nagle on, every keep-alive answer waited ~40 ms for the client's delayed ACK (fresh ones did not).
    k, f = statistics.median(keep), statistics.median(fresh)
    assert k < max(2.0 * f, f + 0.02), (k, f)


# ---- 7, 8. garbage, refusals in /metrics ----------------------------------------------------------------------------


def test_garbage_gives_one_rate_limited_line_and_is_counted(tiny_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    rng = random.Random(7)
    with serve(tiny_dir, log, read_timeout_s=1.0) as server:
        for _ in range(40):
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(bytes(rng.randrange(256) for _ in range(300)) + b"\r\n\r\n")
                assert read_all(sock, 5.0).startswith(b"HTTP/1.1 400")
        with socket.create_connection(("127.0.0.1", server.port)) as slow:
            slow.sendall(HALF_HEADER)
            assert read_all(slow, 10.0).startswith(b"HTTP/1.1 408")
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
        counted = refusals(server.url)
    text = log.read_text()
    assert "Traceback" not in text
    lines = [ln for ln in text.splitlines() if "invalid HTTP" in ln or "Invalid HTTP" in ln]
    assert len(lines) == 1 and "127.0.0.1" in lines[0], lines[:3]
    assert counted.get("invalid_http") == 40 and counted.get("request_timeout") == 1, counted


# ---- 9. 413 without a reset, drain -----------------------------------------------------------------------------------


def test_chunked_body_over_the_limit_is_413_without_a_reset(tiny_dir: Path, tmp_path: Path) -> None:
    with serve(tiny_dir, tmp_path / "server.log") as server:
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=20)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            errors: list[BaseException] = []

            def pump(sock: socket.socket = sock, errors: list[BaseException] = errors) -> None:
                try:
                    for _ in range(60):          # 3.9 MB, the limit is 1 MiB
                        sock.sendall(b"10000\r\n" + b" " * 65536 + b"\r\n")
                except OSError as exc:
                    errors.append(exc)

            sender = threading.Thread(target=pump)
            sender.start()
            try:
                reply = read_all(sock, 20.0)
            except OSError as exc:
                errors.append(exc)
                reply = b""
            sender.join(30)
            sock.close()
            assert not errors, errors
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 413"), reply[:200]
            assert json.loads(body)["error"]["code"] == "body_too_large"


@pytest.fixture(scope="module")
def slow_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wider random model: a few hundred tokens per second, so a long answer is still running at the deadline."""
    return write_tiny_chat_model(tmp_path_factory.mktemp("slow") / "slow", hidden=256, layers=8)


def stream_into(url: str, body: dict[str, Any], out: list[dict], started: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
                started.set()


def test_drain_answers_health_then_ends_streams_at_its_deadline(slow_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    server = serve(slow_dir, log, max_seq_len=4096, drain_timeout_s=2.0)
    long = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 4000, "stream": True,
            "edgespec": {"num_draft_tokens": 0}}
    with server:
        chunks: list[dict] = []
        queued: list[dict] = []
        started, queued_started = threading.Event(), threading.Event()
        runner = threading.Thread(target=stream_into, args=(server.url, long, chunks, started))
        runner.start()
        assert started.wait(60)
        waiter = threading.Thread(target=stream_into, args=(server.url, {**long, "max_tokens": 100}, queued,
                                                              queued_started))
        waiter.start()
        assert queued_started.wait(30)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        health = httpx.get(server.url + "/health", timeout=10)     # still listening while it drains
        assert health.status_code == 503 and health.json()["status"] == "draining", health.text
        refused = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        runner.join(60)
        waiter.join(60)
        assert server.proc.wait(60) == 0, log.read_text()[-2000:]
        took = time.monotonic() - t0
    final = [c for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")]
    assert final and final[-1]["choices"][0]["finish_reason"] == "length", chunks[-3:]
    assert final[-1]["edgespec"]["timed_out"] is True
    assert chunks[-1] == {"done": True}
    assert any(c.get("error", {}).get("code") == "draining" for c in queued) and queued[-1] == {"done": True}
    assert took < 2.0 + 20.0, took
    assert "drain_timeout_s" in log.read_text()


def test_drain_without_work_exits_at_once(tiny_dir: Path, tmp_path: Path) -> None:
    server = serve(tiny_dir, tmp_path / "server.log", drain_timeout_s=60)
    with server:
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
        t0 = time.monotonic()
        os.kill(server.pid, signal.SIGTERM)
        assert server.proc.wait(30) == 0
    assert time.monotonic() - t0 < 10.0
