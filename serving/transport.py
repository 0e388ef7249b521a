"""The HTTP/1.1 connection layer under the app: uvicorn's h11 protocol with the guards a public socket needs.

uvicorn alone keeps a connection that sends half a request line forever, serves any number of connections, answers
a malformed request with a ``text/plain`` 400 and one log line per connection, and leaves Nagle's algorithm on.
:func:`guarded_protocol` returns an h11 protocol class that

* sets ``TCP_NODELAY`` on every accepted socket (a response is written in pieces; with Nagle the last piece waits
  for the client's delayed ACK, about 40 ms on every keep-alive request);
* closes a connection whose request headers are not complete ``read_timeout_s`` after its first byte (or after it
  opened), answering ``408`` in the OpenAI error shape (a body read is bounded by
  :class:`~serving.middleware.ReadTimeoutMiddleware`, which runs in the app);
* admits connections fairly (:mod:`serving.admission`): a client over ``max_client_connections``, or one that
  already holds the most when ``max_connections`` are open, is answered ``503`` (code ``too_many_connections``)
  and closed before it holds anything; a newcomer from another client takes the place of the biggest client's
  oldest idle or stalled connection, so ``/health`` and other clients are answered at once;
* answers a request h11 cannot parse (bad ``Content-Length``, broken request line, garbage bytes) with a JSON
  ``400`` (code ``invalid_http``) and one rate-limited log line, never a traceback;
* closes without a reset: a connection closed while its client is still sending (a refusal, or a ``413`` for a
  chunked body over the limit) shuts our side first and reads and drops the rest for up to ``linger_s``;
* reports every refusal (``on_refusal(reason)``) and the number of open connections (``on_open(n)``), which the
  app turns into ``/metrics``.

Idle and half-sent connections therefore never hold a shutdown: uvicorn closes idle ones at once, and a half-sent
one ends within the read timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .admission import ConnectionTable, QuietUvicorn, RateLimitedLog
from .errors import error_body

log = logging.getLogger("edgespec.serving")

# uvicorn's own warnings per bad connection: the invalid-request one is replaced by ours (which names the peer),
# the upgrade ones are kept but rate-limited.
_UVICORN_QUIET = QuietUvicorn(
    drop=("Invalid HTTP request received.",),
    limit=("Unsupported upgrade request.", "No supported WebSocket library detected. Please use \"pip install "
           "'uvicorn[standard]'\", or install 'websockets' or 'wsproto' manually."))


def quiet_uvicorn() -> None:
    """Install the filter of uvicorn's per-connection warnings (idempotent)."""
    logger = logging.getLogger("uvicorn.error")
    if _UVICORN_QUIET not in logger.filters:
        logger.addFilter(_UVICORN_QUIET)


def raw_error(status: int, message: str, code: str) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response with an OpenAI error body, for the connection layer
    (where no ASGI app runs)."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


def set_no_delay(transport: asyncio.BaseTransport) -> None:
    """``TCP_NODELAY`` on a TCP transport's socket (other sockets, e.g. UNIX, have no Nagle to turn off)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:   # the peer is already gone
            pass


class _Transport:
    """The transport uvicorn's protocol and request cycle see: ``close`` goes through the protocol, which closes
    without a reset while the client is still sending (see :meth:`GuardedProtocol._close`)."""

    def __init__(self, inner: asyncio.Transport, close: Callable[[], None]) -> None:
        self._inner = inner
        self._close = close

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def close(self) -> None:
        self._close()


class GuardedProtocol(H11Protocol):
    """h11 with the guards of the module doc; configured by :func:`guarded_protocol` (one subclass per server, which
    holds that server's connection table)."""

    read_timeout_s: float = 10.0
    max_connections: int = 64
    max_client_connections: int = 0
    linger_s: float = 2.0
    table: ConnectionTable = ConnectionTable()
    garbage_log: RateLimitedLog = RateLimitedLog(log)
    refusal_log: RateLimitedLog = RateLimitedLog(log)
    on_refusal: Callable[[str], None] | None = None
    on_open: Callable[[int], None] | None = None
    client_host = "-"
    _timer: asyncio.TimerHandle | None = None
    _raw: asyncio.Transport
    _refused = False       # answered by this layer: what the client still sends is dropped
    _lingering = False     # our side shut, waiting for the client's end or linger_s
    _lost = False
    _partial = False       # bytes of a request not yet answered (an idle keep-alive connection has none)

    # -- connection lifecycle --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw = transport
        set_no_delay(transport)
        super().connection_made(_Transport(transport, self._close))  # type: ignore[arg-type]
        self.client_host = self.client[0] if self.client else "-"
        self.table.add(self)
        self._report_open()
        if self._admit():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._disarm()
        self.table.remove(self)
        self._report_open()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        if self._lingering:
            self._raw.close()
        return super().eof_received()

    def _report_open(self) -> None:
        if self.on_open is not None:
            self.on_open(self.table.total)

    def _count(self, reason: str) -> None:
        if self.on_refusal is not None:
            self.on_refusal(reason)

    # -- admission -------------------------------------------------------------------------------------------
    def _admit(self) -> bool:
        """False (and refused) when this client holds too many connections or the server is full for it."""
        cap, held = self.max_client_connections, self.table.count(self.client_host)
        if cap and held > cap:
            self.refusal_log.log("connection from %s refused: it holds %d connections (max_client_connections %d)",
                                 self.client_host, held - 1, cap)
            self._refuse(503, f"this client already has {cap} open connections; retry later",
                         "too_many_connections", "client_connections")
            return False
        if self.table.total <= self.max_connections:
            return True
        victim = self.table.victim_for(self)
        if victim is None:
            self.refusal_log.log("connection from %s refused: %d connections open (max_connections %d)",
                                 self.client_host, self.table.total - 1, self.max_connections)
            self._refuse(503, f"the server already has {self.max_connections} open connections; retry later",
                         "too_many_connections", "too_many_connections")
            return False
        victim.evict()
        return True

    def evictable(self) -> bool:
        """Idle, or still sending its request headers: nothing of ours is under way on it."""
        return not self._refused and not self._lost and self._between_requests()

    def evict(self) -> None:
        """Make room for another client: an idle connection is closed, a half-sent request answered 503."""
        self.table.remove(self)
        self._count("evicted")
        if not self._partial:
            self._disarm()
            self._refused = True
            self._raw.close()
            return
        self._refuse(503, "the server is full; this connection was closed to make room for another client",
                     "too_many_connections", None)

    # -- the header deadline ---------------------------------------------------------------------------------
    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = self.loop.call_later(self.read_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        if self._between_requests() and not self._raw.is_closing():
            self.refusal_log.log("closing a connection from %s whose request headers took over %.0fs",
                                 self.client_host, self.read_timeout_s)
            self._refuse(408, f"request headers not received within {self.read_timeout_s:g}s", "request_timeout",
                         "request_timeout")

    # -- closing ---------------------------------------------------------------------------------------------
    def _refuse(self, status: int, message: str, code: str, reason: str | None) -> None:
        """Answer and close without a reset; ``reason`` is counted (None: counted by the caller)."""
        if reason is not None:
            self._count(reason)
        self.table.remove(self)
        self._refused = True
        self._raw.write(raw_error(status, message, code))
        self._linger()

    def _close(self) -> None:
        """uvicorn closes the connection: while the client is still sending its body (a 413 for a chunked body,
        an error raised while the body streams in) shut our side and drain the rest first."""
        if self._lingering:
            return
        if not self._lost and self.conn.their_state is h11.SEND_BODY:
            self._refused = True
            self._linger()
        else:
            self._raw.close()

    def _linger(self) -> None:
        """Closing a socket with unread input resets it, and the client would lose the answer: send our FIN, read
        and drop what still comes for up to ``linger_s``, then close."""
        self._disarm()
        if self._lingering:
            return
        self._lingering = True
        if self._raw.is_closing():
            return
        if not self._raw.can_write_eof():
            self._raw.close()
            return
        self._raw.write_eof()
        self._raw.resume_reading()
        self.loop.call_later(self.linger_s, self._raw.close)

    # -- data ------------------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._between_requests():
            self._partial = True
            self._arm()            # a new request starts: its headers have read_timeout_s
        try:
            super().data_received(data)
        except Exception as exc:   # uvicorn or h11 choking on bytes it let through: a 400, not a traceback
            self._invalid(f"{type(exc).__name__}: {exc}")
            return
        if not self._between_requests():
            self._disarm()         # headers complete: the body's time is the app's ReadTimeoutMiddleware's

    def on_response_complete(self) -> None:
        self._partial = False
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        self._invalid("h11 could not parse the request")

    def _invalid(self, detail: str) -> None:
        if self._refused:
            return
        self.garbage_log.log("invalid HTTP from %s: %s", self.client_host, detail[:200])
        self._refuse(400, "invalid HTTP request (check the request line, headers and Content-Length)",
                     "invalid_http", "invalid_http")


def guarded_protocol(read_timeout_s: float, max_connections: int, *, max_client_connections: int = 0,
                     on_refusal: Callable[[str], None] | None = None,
                     on_open: Callable[[int], None] | None = None) -> type[GuardedProtocol]:
    """A :class:`GuardedProtocol` subclass with these limits and its own connection table (uvicorn's ``http=``
    takes a class)."""
    quiet_uvicorn()
    return type("EdgespecHTTP", (GuardedProtocol,), {
        "read_timeout_s": read_timeout_s, "max_connections": max_connections,
        "max_client_connections": max_client_connections, "table": ConnectionTable(),
        "garbage_log": RateLimitedLog(log), "refusal_log": RateLimitedLog(log, level=logging.INFO),
        "on_refusal": staticmethod(on_refusal) if on_refusal else None,
        "on_open": staticmethod(on_open) if on_open else None})
