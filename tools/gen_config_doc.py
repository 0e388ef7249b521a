"""Regenerate docs/configuration.md from the Settings dataclass (run after adding or changing a knob): the user
settings, the developer settings, then the EDGESPEC_* variables that are not settings."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from edgespec.config import DEV_SETTINGS, ENV_NOT_SETTINGS, Settings
from edgespec.environment import documented_elsewhere

HEADER = """# Configuration

Every knob of edgespec, with its default. Sources, lowest to highest priority: a YAML file (`--config FILE` or
`EDGESPEC_CONFIG`), `EDGESPEC_<NAME>` environment variables, then `--<name>` command-line flags (underscores become
dashes). Unknown keys in any source are rejected by name; values are type- and range-checked.
A value of `None`/`auto` takes the arch default (`arch/base.py`, `arch/rtx`, `arch/thor`). Settings are read at
the edge only (the CLI, the server's start, `edgespec profile`): they resolve once into the runtime plan
(`edgespec/plan.py`) that the engine, kernels and server run with; `edgespec dev plan` prints it.

Two surfaces. *User settings* are what a robot integrator sets (model, drafter, memory, server, telemetry) and
are what `--help` shows. *Developer settings* (kernel switches and tuning) are set the same three ways but left
out of `--help`: `edgespec dev settings` lists them, and `edgespec profile` writes the tuned ones into its YAML.

These tables are generated from `edgespec/config.py` by `python tools/gen_config_doc.py`.

## User settings

| setting | default | meaning |
|---|---|---|
"""

DEV_HEADER = """
## Developer settings

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
    rows = {True: [], False: []}
    for f in fields(Settings):
        rows[f.name in DEV_SETTINGS].append(f"| `{f.name}` | `{f.default}` | {f.metadata['help']} |")
    env = [f"| `{name}` | {meaning} |" for name, meaning in ENV_NOT_SETTINGS.items()]
    system = [f"| `{name}` | {meaning} |" for name, meaning in documented_elsewhere().items()]
    return (HEADER + "\n".join(rows[False]) + "\n" + DEV_HEADER + "\n".join(rows[True]) + "\n" + ENV_HEADER
            + "\n".join(env) + "\n" + SYSTEM_HEADER + "\n".join(system) + "\n")


if __name__ == "__main__":
    Path(__file__).resolve().parents[1].joinpath("docs/configuration.md").write_text(render())
