"""The HTTP/1.1 connection layer under the app: uvicorn's h11 protocol with the guards a public socket needs.

uvicorn alone keeps a connection that sends half a request line forever, serves any number of connections, and
answers a malformed request with a ``text/plain`` 400. :func:`guarded_protocol` returns an h11 protocol class that

* closes a connection whose request headers are not complete ``read_timeout_s`` after its first byte (or after it
  opened), answering ``408`` in the OpenAI error shape (a body read is bounded by
  :class:`~serving.middleware.ReadTimeoutMiddleware`, which runs in the app);
* answers ``503`` (code ``too_many_connections``) and closes a connection opened while ``max_connections`` are
  already open, before it can hold any memory or a request slot;
* answers a request h11 cannot parse (bad ``Content-Length``, broken request line) with a JSON ``400``
  (code ``invalid_http``).

Idle and half-sent connections therefore never hold a shutdown: uvicorn closes idle ones at once, and a half-sent
one ends within the read timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus

from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

log = logging.getLogger("edgespec.serving")


def raw_error(status: int, message: str, code: str) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response with an OpenAI error body, for the connection layer
    (where no ASGI app runs)."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class GuardedProtocol(H11Protocol):
    """h11 with a header read timeout, a connection cap and JSON errors (see the module doc); configured by
    :func:`guarded_protocol`."""

    read_timeout_s: float = 10.0
    max_connections: int = 64
    linger_s: float = 2.0
    _timer: asyncio.TimerHandle | None = None
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("connection refused: %d connections open (max_connections %d)", len(self.connections) - 1,
                        self.max_connections)
            self._refuse(503, f"the server already has {self.max_connections} open connections; retry later",
                         "too_many_connections")
            return
        self._arm()

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
        if self._between_requests() and not self.transport.is_closing():
            log.info("closing a connection whose request headers took over %.0fs", self.read_timeout_s)
            self._refuse(408, f"request headers not received within {self.read_timeout_s:g}s", "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer and close. Our side is shut first and what the client still sends is read and dropped for up to
        ``linger_s``: closing a socket with unread input resets it, and the client would lose the answer."""
        self._disarm()
        self._refused = True
        self.transport.write(raw_error(status, message, code))
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(self.linger_s, self.transport.close)
        else:
            self.transport.close()

    def eof_received(self) -> bool | None:
        if self._refused:
            self.transport.close()
        return super().eof_received()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._between_requests():
            self._arm()            # a new request starts: its headers have read_timeout_s
        super().data_received(data)
        if not self._between_requests():
            self._disarm()         # headers complete: the body's time is the app's ReadTimeoutMiddleware's

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, f"invalid HTTP request ({msg.rstrip('.')}: check the request line, headers and "
                     "Content-Length)", "invalid_http")


def guarded_protocol(read_timeout_s: float, max_connections: int) -> type[GuardedProtocol]:
    """A :class:`GuardedProtocol` subclass with these limits (uvicorn's ``http=`` takes a class)."""
    return type("EdgespecHTTP", (GuardedProtocol,), {"read_timeout_s": read_timeout_s,
                                                       "max_connections": max_connections})
