"""Where edgespec keeps files of its own (converted demo model, GGUF metadata folders, the compiled CPU step):
one place, below every layer that needs it."""

from __future__ import annotations

from pathlib import Path

from edgespec import environment


def cache_root() -> Path:
    """``$EDGESPEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/edgespec``, else ``~/.cache/edgespec``."""
    explicit = environment.read("EDGESPEC_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = environment.read("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "edgespec"
