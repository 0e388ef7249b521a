"""Fair admission: which client may open one more connection or queue one more request, and log lines that a
flood of bad input cannot multiply.

A *client* at the connection layer is its peer address (the host, without the port). :class:`ConnectionTable`
holds every open connection by client in opening order. When the server is full (``max_connections``), a newcomer
from a client that holds fewer connections than the client holding the most takes the place of that client's oldest
connection that is not inside a request (idle, or still sending its headers: a stalled slowloris connection is the
first to go); otherwise the newcomer is refused. So one client can fill the server only while nobody else needs it,
and ``/health`` from another client is answered at once. ``max_client_connections`` caps one client outright.

:class:`ClientRequests` counts one client's requests that are queued or running (a client there is its tenant and
host, :func:`request_client`), so one client cannot take every place in the engine's queue.

:class:`RateLimitedLog` writes at most one line per interval for one kind of event and says how many it held back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol


class Connection(Protocol):
    """What the table needs of a connection (:class:`serving.transport.GuardedProtocol`)."""

    client_host: str

    def evictable(self) -> bool: ...


class ConnectionTable:
    """Open connections by client host, oldest first (one table per server, used from its event loop only)."""

    def __init__(self) -> None:
        self._by_host: dict[str, list[Connection]] = {}
        self.total = 0

    def add(self, conn: Connection) -> None:
        self._by_host.setdefault(conn.client_host, []).append(conn)
        self.total += 1

    def remove(self, conn: Connection) -> None:
        held = self._by_host.get(conn.client_host)
        if held is None or conn not in held:
            return
        held.remove(conn)
        self.total -= 1
        if not held:
            del self._by_host[conn.client_host]

    def count(self, host: str) -> int:
        return len(self._by_host.get(host, ()))

    def victim_for(self, newcomer: Connection) -> Connection | None:
        """The connection a newcomer to a full server may replace (see the module doc), or None: refuse it."""
        mine = self.count(newcomer.client_host) - 1          # the newcomer is already in the table
        host, held = max(self._by_host.items(), key=lambda item: len(item[1]), default=(None, []))
        if host is None or host == newcomer.client_host or len(held) <= mine + 1:
            return None
        return next((c for c in held if c is not newcomer and c.evictable()), None)


def request_client(tenant: str, host: str | None) -> str:
    """Who a request belongs to for the per-client request limit: its tenant (API key) and peer host."""
    return f"{tenant}\x00{host or '-'}"


class ClientRequests:
    """Requests queued or running per client, capped at ``limit`` each (0: no cap). Thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, client: str) -> bool:
        """Count one more request of ``client``; False (nothing counted) when it already holds ``limit``."""
        with self._lock:
            n = self._held.get(client, 0)
            if self.limit and n >= self.limit:
                return False
            self._held[client] = n + 1
            return True

    def give_back(self, client: str) -> None:
        with self._lock:
            n = self._held.get(client, 0) - 1
            if n > 0:
                self._held[client] = n
            else:
                self._held.pop(client, None)

    def held(self, client: str) -> int:
        with self._lock:
            return self._held.get(client, 0)


class RateLimitedLog:
    """At most one log line per ``interval_s`` for one kind of event; the next line says how many were held back."""

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0, level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval_s, self.level, self._clock = logger, interval_s, level, clock
        self._last: float | None = None
        self._held = 0

    def log(self, message: str, *args: object) -> bool:
        """Log ``message % args`` unless a line went out less than ``interval_s`` ago; True when it was logged."""
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            self._held += 1
            return False
        if self._held:
            message += " (%d more like it in the last %.0fs not logged)"
            args = (*args, self._held, now - self._last if self._last is not None else 0.0)
        self.logger.log(self.level, message, *args)
        self._last, self._held = now, 0
        return True


class QuietUvicorn(logging.Filter):
    """Filters uvicorn's per-connection warnings, which a stream of garbage would repeat once per connection:
    ``drop`` are not logged at all (the connection layer writes a rate-limited line of its own, naming the peer),
    ``limit`` at most once per ``interval_s`` each."""

    def __init__(self, drop: tuple[str, ...], limit: tuple[str, ...], interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.drop, self.limit = frozenset(drop), frozenset(limit)
        self.interval_s, self._clock = interval_s, clock
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.drop:
            return False
        if message in self.limit:
            now, last = self._clock(), self._last.get(message)
            if last is not None and now - last < self.interval_s:
                return False
            self._last[message] = now
        return True
