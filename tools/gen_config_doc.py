"""Regenerate docs/configuration.md from the Settings dataclass (run after adding or changing a knob)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from edgespec.config import ENV_NOT_SETTINGS, Settings
from edgespec.environment import documented_elsewhere

HEADER = """# Configuration

Every knob of edgespec, with its default. Sources, lowest to highest priority: a YAML file (`--config FILE` or
`EDGESPEC_CONFIG`), `EDGESPEC_<NAME>` environment variables, then `--<name>` command-line flags (underscores become
dashes). Unknown keys in any source are rejected by name; values are type- and range-checked.
A value of `None`/`auto` takes the arch default (`arch/base.py`, `arch/rtx`, `arch/thor`).

This table is generated from `edgespec/config.py` by `python tools/gen_config_doc.py`.

| setting | default | meaning |
|---|---|---|
"""


ENV_HEADER = """
## Environment variables that are not settings

Every other `EDGESPEC_*` variable is a setting above (`EDGESPEC_<NAME>`); an unknown one is rejected by name.

| variable | meaning |
|---|---|
"""

SYSTEM_HEADER = """
## Variables of the system around edgespec that it reads

Read in one place (`edgespec/environment.py`); Triton's and torchrun's own variables are left to those libraries.

| variable | meaning |
|---|---|
"""


def render() -> str:
    rows = [f"| `{f.name}` | `{f.default}` | {f.metadata['help']} |" for f in fields(Settings)]
    env = [f"| `{name}` | {meaning} |" for name, meaning in ENV_NOT_SETTINGS.items()]
    system = [f"| `{name}` | {meaning} |" for name, meaning in documented_elsewhere().items()]
    return (HEADER + "\n".join(rows) + "\n" + ENV_HEADER + "\n".join(env) + "\n" + SYSTEM_HEADER
            + "\n".join(system) + "\n")


if __name__ == "__main__":
    Path(__file__).resolve().parents[1].joinpath("docs/configuration.md").write_text(render())
