#!/usr/bin/env python3
"""Write random-weight drafters for a target checkpoint: the command line of :mod:`edgespec.bench.random_drafter`.

    python tools/make_drafter.py dflash --target DIR --out DIR [--layers 2] [--block-size 16] ...
    python tools/make_drafter.py mtp --target DIR          # adds mtp.* to a Qwen3.5 checkpoint in place
"""

from __future__ import annotations

import sys

from edgespec.bench.random_drafter import main

if __name__ == "__main__":
    sys.exit(main())
