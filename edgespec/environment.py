"""The process environment, read in one place: every variable the product reads outside the settings layers, by
name, with what it does (``docs/configuration.md`` lists them).

Settings' own ``EDGESPEC_<NAME>`` layer and ``EDGESPEC_CONFIG`` are read by ``edgespec.config``; Triton's and
torchrun's variables are read by those libraries (``triton.knobs``, ``torch.distributed``), never here. A read of a
name this table does not hold is a programming error, so a new variable cannot slip in undocumented.
"""

from __future__ import annotations

import os

# Every variable read through :func:`read`, with its meaning. EDGESPEC_* ones are also in config.ENV_NOT_SETTINGS
# (the table of prefixed names that are not settings); the others are conventions of the system around us.
READS: dict[str, str] = {
    "EDGESPEC_CACHE_DIR": "where the demo model and converted GGUF folders are kept (edgespec.paths)",
    "XDG_CACHE_HOME": "the user's cache folder (XDG base directories): without EDGESPEC_CACHE_DIR, edgespec keeps "
                      "its files in $XDG_CACHE_HOME/edgespec, else ~/.cache/edgespec",
    "NOTIFY_SOCKET": "systemd's notify socket (a Type=notify unit): the server reports READY and its status there",
    "WATCHDOG_USEC": "systemd's watchdog period (WatchdogSec=): the server pings at half of it",
    "WATCHDOG_PID": "the process systemd's watchdog watches: no pings from any other",
}


def read(name: str) -> str | None:
    """The value of environment variable ``name`` (None when unset); ``name`` must be one of :data:`READS`."""
    if name not in READS:
        raise KeyError(f"environment variable {name} is not in edgespec.environment.READS: add it there, with "
                       "what it does, before reading it")
    return os.environ.get(name)


def documented_elsewhere() -> dict[str, str]:
    """The variables of :data:`READS` without the ``EDGESPEC_`` prefix (those with it are listed with the settings'
    other prefixed names): the docs' table of the system's variables edgespec reads."""
    return {name: meaning for name, meaning in READS.items() if not name.startswith("EDGESPEC_")}
