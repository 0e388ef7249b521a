"""sd_notify over ``$NOTIFY_SOCKET`` with the standard library only (no libsystemd binding needed).

Under a ``Type=notify`` unit systemd passes the socket path in ``NOTIFY_SOCKET`` and, with ``WatchdogSec=``,
the watchdog period in ``WATCHDOG_USEC`` (for the process ``WATCHDOG_PID``). Outside systemd every call is a
no-op.
Messages used: ``READY=1`` (model loaded, serving), ``STATUS=...`` (a line for ``systemctl status``),
``WATCHDOG=1`` (alive; sent at half the period) and ``STOPPING=1`` (draining after SIGTERM).
"""

from __future__ import annotations

import logging
import os
import socket

from edgespec import environment

log = logging.getLogger("edgespec.serving")


def _address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()  # abstract namespace socket
    if value.startswith("/"):
        return value
    return None  # vsock:... and other forms are not used on a robot


def notify(*lines: str) -> bool:
    """Send ``lines`` (``"READY=1"``, ``"STATUS=loading"``...) to systemd; False when not under systemd."""
    address = _address(environment.read("NOTIFY_SOCKET") or "")
    if address is None or not lines:
        return False
    message = "\n".join(lines).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message)
    except OSError as exc:
        log.warning("sd_notify %r failed: %s", lines, exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``WATCHDOG_USEC``), or None when no watchdog is asked."""
    usec = environment.read("WATCHDOG_USEC")
    pid = environment.read("WATCHDOG_PID")
    if not usec:
        return None
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None  # meant for another process (e.g. a wrapper)
    try:
        period = int(usec) / 1e6
    except ValueError:
        return None
    return period / 2 if period > 0 else None
