"""Log lines of the server: one line each, with time, level, logger, request id and message.

``configure(level)`` installs the format on the root logger (uvicorn's own loggers propagate to it), unless the
embedding application configured logging itself. The request id comes from
:data:`edgespec.serving.middleware.request_id` (set per HTTP request, and by the engine worker for the job it runs).
"""

from __future__ import annotations

import logging

from .middleware import request_id

FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s [%(request_id)s] %(message)s"
DATEFMT = "%Y-%m-%dT%H:%M:%S"
LEVELS = ("debug", "info", "warning", "error")


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (``-`` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get()
        return True


def configure(level: str = "info") -> None:
    """Root handler with :data:`FORMAT` (if none is installed) and ``level`` on edgespec's and uvicorn's loggers."""
    if level.lower() not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT, DATEFMT))
        handler.addFilter(RequestIdFilter())
        root.addHandler(handler)
        root.setLevel(logging.WARNING)
    for name in ("edgespec", "uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(level.upper())
