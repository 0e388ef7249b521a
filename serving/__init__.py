"""The OpenAI-compatible agent server (installed as ``edgespec.serving``).

``create_app(engine_or_factory, settings)`` builds the FastAPI app; ``run_server(settings)`` serves it (what
``edgespec serve`` and the ``edgespec-agent`` systemd unit run). ``python -m edgespec.serving --config FILE``
is the same as ``edgespec serve``.
"""

from __future__ import annotations

from .app import create_app, is_loopback, run_server

__all__ = ["create_app", "is_loopback", "run_server"]
