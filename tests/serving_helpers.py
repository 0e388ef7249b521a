"""Helpers for server tests and tools: a tiny random chat model and a server running in a background thread.

``write_tiny_chat_model(folder)`` writes a random two-layer Llama with a byte-level tokenizer (every UTF-8 byte
is a token, plus ChatML specials and ``<think>``/``</think>``) and a Qwen-style chat template that honours
``enable_thinking``. It loads in well under a second and generates hundreds of tokens per second on a CPU, so
tests can exercise queueing, streaming, JSON mode and speculation without a real checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI


def write_tiny_chat_model(folder: str | Path, seed: int = 0, vocab_size: int = 272, hidden: int = 64,
                          layers: int = 2) -> Path:
    """Write a random tiny Llama + byte-level tokenizer + chat template into ``folder`` and return it."""
    from edgespec.bench.shapes import _byte_tokenizer, config_dict, write_chat_tokenizer, write_random_checkpoint

    folder = Path(folder)
    tok = _byte_tokenizer()
    if tok.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {tok.get_vocab_size()}")
    im_end = tok.token_to_id("<|im_end|>")
    cfg = config_dict(model_type="llama", vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * hidden,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=im_end)
    write_random_checkpoint(folder, cfg, seed=seed)
    return write_chat_tokenizer(folder)


def free_socket(host: str = "127.0.0.1") -> socket.socket:
    """A bound (not yet listening) TCP socket on a free port; uvicorn takes it over."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock


class ServerThread:
    """Run ``app`` under uvicorn on 127.0.0.1 in a daemon thread (a context manager).

    ``url`` is the base URL; entering waits until ``/health`` answers (``wait_ready``: until it says ready).
    """

    def __init__(self, app: FastAPI, wait_ready: bool = True, timeout: float = 120.0, **config: Any) -> None:
        self.app = app
        self._sock = free_socket()
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config.setdefault("log_level", "warning")
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan="on", timeout_graceful_shutdown=30, **config))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                         name="uvicorn-test", daemon=True)
        self._wait_ready = wait_ready
        self._timeout = timeout

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                if not self._wait_ready or r.status_code == 200:
                    return self
                if r.json().get("status") == "failed":
                    raise RuntimeError(f"engine failed to load: {r.text}")
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server at {self.url} not ready after {self._timeout}s")

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(60)

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerProcess:
    """``python -m edgespec.serving`` (or another ``entry``, e.g. ``("-m", "edgespec.cli", "serve")``) in a child
    process on a free loopback port (a context manager).

    ``settings`` are passed as ``--knob value`` flags. Entering waits until ``/health`` says ready; leaving sends
    SIGTERM (the drain path) and waits. ``returncode`` is the exit status afterwards.
    """

    def __init__(self, model: str, *, env: dict[str, str] | None = None, log_path: str | Path | None = None,
                 timeout: float = 180.0, entry: tuple[str, ...] = ("-m", "edgespec.serving"),
                 **settings: Any) -> None:
        sock = free_socket()
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, *entry, "--model", model, "--port", str(self.port)]
        for key, value in settings.items():
            self.cmd += ["--" + key.replace("_", "-"), str(value)]
        self.env = dict(os.environ, **(env or {}))
        self.log_path = Path(log_path) if log_path else None
        self.timeout = timeout
        self.proc: Any = None
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def __enter__(self) -> ServerProcess:
        # The child writes the log through its own descriptor: ours is closed once it has started.
        with self.log_path.open("wb") if self.log_path else open(os.devnull, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was ready")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.proc.kill()
        self.proc.wait(10)
        raise TimeoutError(f"server not ready after {self.timeout}s")

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.returncode = self.proc.returncode


def app_for(settings: Any, engine: Any = None) -> FastAPI:
    """The server app of ``settings`` the way ``edgespec serve`` builds it (their runtime plan), serving ``engine``
    (default: the engine that plan loads)."""
    from edgespec.engine import Engine
    from edgespec.plan import build_plan
    from edgespec.serving import create_app

    plan = build_plan(settings)
    return create_app(Engine.load(plan) if engine is None else engine, plan)
