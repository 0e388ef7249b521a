"""The server as the systemd unit runs it: a separate process, sd_notify, SIGTERM drain; the unit and sample config."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serving_helpers import free_socket, write_tiny_chat_model

from edgespec.config import read_yaml
from edgespec.serving import systemd

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "configs" / "edgespec-agent.service"
AGENT_YAML = ROOT / "configs" / "agent.yaml"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("proc") / "tiny")


class NotifyListener:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET; collects every message."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in m for m in self.messages):
                return
            time.sleep(0.02)
        raise AssertionError(f"no {text!r} from the server; got {self.messages}")

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


@pytest.fixture()
def served(tmp_path: Path, tiny_dir: Path) -> Iterator[tuple[subprocess.Popen, str, NotifyListener, Path]]:
    listener = NotifyListener(tmp_path / "notify.sock")
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "notify.sock"), WATCHDOG_USEC="300000",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WATCHDOG_PID", None)
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "edgespec.serving", "--model", str(tiny_dir), "--port", str(port),
           "--drafter", "ngram", "--max-seq-len", "512", "--served-model-name", "tiny"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc, f"http://127.0.0.1:{port}", listener, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        listener.close()


def _stream(url: str, out: list[dict], first: threading.Event) -> None:
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
                first.set()


def test_sigterm_drains_in_flight_work_then_exits_0(served: tuple) -> None:
    proc, url, listener, log = served
    listener.wait_for("READY=1", timeout=90)
    assert httpx.get(url + "/health").json()["status"] == "ready"
    listener.wait_for("WATCHDOG=1", timeout=5)
    results: list[list[dict]] = [[], []]
    started = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_stream, args=(url, results[i], started[i])) for i in range(2)]
    threads[0].start()
    assert started[0].wait(30)
    threads[1].start()  # queued behind the first
    deadline = time.monotonic() + 10
    while not started[1].is_set() and httpx.get(url + "/health").json()["waiting"] == 0:
        assert time.monotonic() < deadline, "second request never reached the server"
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert proc.wait(60) == 0, log.read_text()[-3000:]
    for chunks in results:
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 400, "request cut short by SIGTERM"
        assert [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][0]["choices"][0][
            "finish_reason"] == "length"
    listener.wait_for("STOPPING=1", timeout=5)
    assert listener.messages.index(next(m for m in listener.messages if "READY=1" in m)) < \
        listener.messages.index(next(m for m in listener.messages if "STOPPING=1" in m))
    assert "draining" in log.read_text()


def test_bad_config_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "agent.yaml"
    bad.write_text("modle: demo\n")
    r = subprocess.run([sys.executable, "-m", "edgespec.serving", "--config", str(bad)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "modle" in r.stderr
    r = subprocess.run([sys.executable, "-m", "edgespec.serving", "--host", "0.0.0.0", "--model", "/nowhere"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "api_key" in r.stderr


# ---- sd_notify ------------------------------------------------------------------------------------------------


def test_notify_paths_and_watchdog_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False  # not under systemd: a no-op
    abstract = f"@edgespec-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(b"\0" + abstract[1:].encode())
        monkeypatch.setenv("NOTIFY_SOCKET", abstract)
        assert systemd.notify("STATUS=hello", "READY=1")
        assert s.recv(100) == b"STATUS=hello\nREADY=1"
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert systemd.notify("READY=1") is False  # systemd went away: logged, never raised
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert systemd.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert systemd.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert systemd.watchdog_interval() is None


# ---- the unit file and the sample config ----------------------------------------------------------------------


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def _seconds(value: str) -> float:
    return float(value[:-3]) * 60 if value.endswith("min") else float(value.rstrip("s"))


def test_unit_file_declares_the_service_contract() -> None:
    unit = _unit()
    svc = unit["Service"]
    assert svc["Type"] == "notify"
    assert svc["ExecStart"] == "edgespec serve --config /etc/edgespec/agent.yaml"
    assert svc["Restart"] == "on-failure" and _seconds(svc["WatchdogSec"]) >= 10
    assert svc["StandardOutput"] == "journal" and svc["StandardError"] == "journal"
    assert svc["KillSignal"] == "SIGTERM"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    # The drain (every request is bounded by request_timeout_s, uvicorn gives it 15 s more) fits the stop timeout.
    settings = read_yaml(AGENT_YAML)
    assert settings["request_timeout_s"] + 15 < _seconds(svc["TimeoutStopSec"])
    assert settings["host"] in ("127.0.0.1", "localhost", "::1")


def test_sample_config_loads() -> None:
    values = read_yaml(AGENT_YAML)  # rejects unknown keys by name
    assert values["served_model_name"] and values["max_queue"] >= 1


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart's program exists: point it at any real executable for the check.
    exe = shutil.which("edgespec") or sys.executable
    text = UNIT.read_text().replace("ExecStart=edgespec ", f"ExecStart={exe} ")
    copy = tmp_path / "edgespec-agent.service"
    copy.write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (r.stdout + r.stderr).splitlines() if "edgespec-agent" in line]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr
