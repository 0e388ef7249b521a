"""``python -m edgespec.serving [--config FILE] [--knob VALUE ...]``: run the agent server.

Same settings layers as ``edgespec serve`` (YAML < ``EDGESPEC_*`` environment < flags).
"""

from __future__ import annotations

import argparse
import sys

from . import startup

startup.install()   # before anything heavy is imported

from edgespec.config import DEV_HINT, SettingsHelpFormatter, add_settings_arguments, load_settings  # noqa: E402
from edgespec.errors import EdgespecError  # noqa: E402

from .app import run_server  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgespec.serving", description=__doc__,
                                     formatter_class=SettingsHelpFormatter, epilog=DEV_HINT,
                                     usage="python -m edgespec.serving [--config FILE] [--SETTING VALUE ...]")
    add_settings_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    try:
        from edgespec.plan import build_plan
        return run_server(build_plan(load_settings(cli=args)), log_level=args.log_level)
    except EdgespecError as exc:
        print(f"edgespec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
