"""Signals during start-up: before uvicorn takes SIGTERM/SIGINT over, a stop request ends the process at once with
exit 0 and one line on stderr.

Start-up (importing torch and FastAPI, reading the config, binding the port) takes a second or two, and a
supervisor may stop the unit in that window; Python's default would die of the signal (exit 143, no line), which
systemd records as a failure. Nothing is running yet, so there is nothing to drain. This module imports nothing
heavy: call :func:`install` first thing, before importing the server.
"""

from __future__ import annotations

import os
import signal
from types import FrameType


def _stop(signum: int, _frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    # os.write: no buffered stream or logging lock that the interrupted code might hold.
    os.write(2, f"edgespec: {name} during start-up, before serving; exiting 0\n".encode())
    os._exit(0)


def install() -> None:
    """Exit 0 with a line on SIGTERM/SIGINT until the server installs its own handlers (uvicorn's drain)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
