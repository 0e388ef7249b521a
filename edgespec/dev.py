"""``edgespec dev``: the developer surface of the settings.

``edgespec dev settings`` lists the developer settings (kernel switches and tuning: the ones ``--help`` leaves
out), each with its flag, environment variable, default and meaning; ``--all`` lists the user settings too.
``edgespec dev plan`` prints the runtime plan (``edgespec.plan``) the settings layers resolve to on this machine:
what the engine would run with, every arch default applied. Developer settings are set like any other: a YAML
key, ``EDGESPEC_<NAME>``, or ``--<name>`` on any command that reads settings.
"""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import fields

from edgespec.config import (
    DEV_SETTINGS,
    ENV_PREFIX,
    SECTION_OF,
    SECTIONS,
    Settings,
    SettingsHelpFormatter,
    flag_of,
    load_settings,
    settings_parent,
)


def add_dev_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommands of ``edgespec dev`` on its parser ``p``."""
    modes = p.add_subparsers(dest="dev_mode", metavar="MODE", required=True)
    listing = modes.add_parser("settings", help="list the developer settings (--all: every setting)",
                               description="List the developer settings: flag, environment variable, default, "
                               "meaning.")
    listing.add_argument("--all", action="store_true", help="list the user settings too")
    listing.set_defaults(dev_run=_run_settings)
    plan = modes.add_parser("plan", help="print the runtime plan the settings resolve to on this machine",
                            parents=[settings_parent(SECTIONS)], formatter_class=SettingsHelpFormatter,
                            usage="edgespec dev plan [--config FILE] [--SETTING VALUE ...]",
                            description="Print the runtime plan (YAML) of the settings layers: YAML < "
                            "EDGESPEC_* < flags, developer settings included.")
    plan.set_defaults(dev_run=_run_plan)


def run_dev(args: argparse.Namespace) -> int:
    """Run the chosen ``edgespec dev`` subcommand."""
    return args.dev_run(args)


def settings_listing(everything: bool = False) -> list[str]:
    """The lines of ``edgespec dev settings``: per section, each setting's flag, variable, default and meaning."""
    lines: list[str] = []
    for section in SECTIONS:
        chosen = [f for f in fields(Settings) if SECTION_OF[f.name] == section
                  and (everything or f.name in DEV_SETTINGS)]
        if not chosen:
            continue
        lines += ["", f"{section} settings:"]
        for f in chosen:
            surface = "" if f.name in DEV_SETTINGS else " (user)"
            lines.append(f"  {f.name}{surface}: {flag_of(f.name)} / {ENV_PREFIX}{f.name.upper()}, "
                         f"default {f.default}")
            lines += textwrap.wrap(f.metadata["help"], 112, initial_indent="      ", subsequent_indent="      ")
    return lines[1:]


def _run_settings(args: argparse.Namespace) -> int:
    print("\n".join(settings_listing(args.all)))
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    from edgespec.plan import build_plan, format_plan

    print(format_plan(build_plan(load_settings(cli=args))), end="")
    return 0
