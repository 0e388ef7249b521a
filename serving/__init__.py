"""The OpenAI-compatible agent server (installed as ``edgespec.serving``).

``create_app(engine_or_factory, plan)`` builds the FastAPI app; ``run_server(plan)`` serves it (what
``edgespec serve`` and the ``edgespec-agent`` systemd unit run). ``python -m edgespec.serving --config FILE``
is the same as ``edgespec serve``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "is_loopback", "run_server"]


def __getattr__(name: str) -> Any:
    # Lazy: ``python -m edgespec.serving`` and ``edgespec serve`` install the start-up signal handlers
    # (serving.startup) before the server's heavy imports (torch, FastAPI) run.
    if name in __all__:
        from . import app
        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
