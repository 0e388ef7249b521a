"""Blend two drafters of one shape: ``(1 - alpha) * A + alpha * B`` for every weight (edgespec.distill.blend).

    python tools/blend_drafters.py edgespec/data/drafters/smollm2-135m-dflash GENERAL_DRAFTER 0.5 BLENDED

How the shipped demo drafter was made from the drafter trained for generality (docs/drafters.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.distill.blend import blend  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="first drafter folder (alpha 0)")
    p.add_argument("b", help="second drafter folder (alpha 1)")
    p.add_argument("alpha", type=float)
    p.add_argument("out", help="drafter folder to write")
    args = p.parse_args()
    print(blend(args.a, args.b, args.alpha, args.out))


if __name__ == "__main__":
    main()
