"""``python -m edgespec.profile ...`` is ``edgespec profile ...``."""

from __future__ import annotations

import sys

from edgespec.profile.cli import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:     # Ctrl-C while loading: nothing measured yet
        sys.exit(130)
