"""The runtime plan: built by one function from Settings, carrying every setting, printable, and the only
configuration below the edge (no module under it imports Settings)."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
import yaml

from edgespec.config import Settings
from edgespec.errors import ConfigError
from edgespec.plan import build_plan, describe, format_plan

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
HINTS = typing.get_type_hints(Settings)

# Settings whose other values cannot change a plan built on this machine, and why.
UNCHANGED_HERE = {
    "device": "auto and cpu name the same device on a machine without CUDA, and cuda is refused there",
    "draft_tree_costs": "names a row_costs.json measured for a device (tests/speculative read one)",
}
# A setting that needs another beside it to matter (or to be valid): the base both its values run on.
LOG = {"request_log": "robot.jsonl"}
NEEDS = {"suffix_persist": LOG, "request_log_max_mb": LOG, "request_log_keep": LOG}


def _others(f: dataclasses.Field) -> list[Any]:
    """Values of setting ``f`` other than its default that its checks accept."""
    optional, parts = _type(HINTS[f.name])
    tp, lo, hi = parts[0], f.metadata.get("min"), f.metadata.get("max")
    if typing.get_origin(tp) is Literal:
        return [c for c in typing.get_args(tp) if c != f.default]
    if tp is bool:
        return [True, False] if f.default is None else [not f.default]
    if tp in (int, float):
        start = f.default if f.default is not None else (lo if lo is not None else 1)
        picks = {start, start * 2, start + 1, lo if lo is not None else start, 4, 64}
        return [tp(v) for v in sorted(picks) if v != f.default and (lo is None or v >= lo)
                and (hi is None or v <= hi)]
    return {"draft_tree": ["4", "auto"], "model": ["robot.gguf", "demo"]}.get(f.name, ["other"])


def _type(tp: Any) -> tuple[bool, list[Any]]:
    args = typing.get_args(tp)
    if type(None) in args:
        return True, [a for a in args if a is not type(None)]
    return False, [tp]


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Settings) if f.name not in UNCHANGED_HERE])
def test_every_setting_reaches_the_plan(name):
    """The oracle of "the plan carries everything": another value of any setting gives another plan, so nothing
    below the edge needs the Settings it came from."""
    f = Settings.__dataclass_fields__[name]
    base = Settings(**NEEDS.get(name, {}))
    plain = describe(build_plan(base, CPU))
    changed = []
    for value in _others(f):
        try:
            plan = build_plan(base.with_overrides(**{name: value}), CPU)
        except ConfigError:
            continue                    # a value that needs other settings beside it (e.g. a drafter path)
        changed.append(describe(plan) != plain)
    assert changed and any(changed), f"no other value of {name} changes the plan"


def test_the_plan_prints_as_plain_yaml_with_secrets_masked():
    plan = build_plan(Settings(api_key="s3cret", drafter="ngram", draft_tree="auto", rollback="deferred"), CPU)
    text = format_plan(plan)
    data = yaml.safe_load(text)
    assert list(data) == [f.name for f in dataclasses.fields(plan)]
    assert data["device"] == "cpu" and data["arch"] == "base" and data["server"]["api_key"] == "(set)"
    assert data["kernels"] == dataclasses.asdict(plan.kernels)
    assert "s3cret" not in text and " object at 0x" not in text and "<" not in text


# The edges: where Settings are read and turned into a plan (or into the settings a tool tries).
EDGES = {"edgespec/cli.py", "edgespec/config.py", "edgespec/plan.py", "edgespec/dev.py", "serving/__main__.py"}
EDGE_FOLDERS = ("edgespec/profile/", "edgespec/bench/")


def test_below_the_edge_no_module_imports_settings():
    """The engine, drafters, hooks, kernels, models and server take the plan: none imports Settings or loads
    them (the edges above do, once)."""
    found = []
    for folder in ("edgespec", "arch", "serving"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in EDGES or rel.startswith(EDGE_FOLDERS):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "edgespec.config":
                    bad = {a.name for a in node.names} & {"Settings", "load_settings", "read_env", "read_yaml"}
                    found += [f"{rel}: {name}" for name in sorted(bad)]
    assert not found, f"Settings read below the edge: {found}"


def test_dev_plan_and_doctor_print_the_plan_of_the_settings_layers(capsys, monkeypatch, tmp_path):
    """`edgespec dev plan` prints the plan of YAML < environment < flags, developer settings included;
    `edgespec doctor --plan` the plan of the YAML and environment."""
    from edgespec.cli import main

    config = tmp_path / "robot.yaml"
    config.write_text("drafter: ngram\nmax_seq_len: 512\n")
    monkeypatch.setenv("EDGESPEC_PDL", "0")
    assert main(["dev", "plan", "--config", str(config), "--device", "cpu", "--gluon", "false"]) == 0
    plan = yaml.safe_load(capsys.readouterr().out)
    assert plan["drafter"]["name"] == "ngram" and plan["model"]["max_seq_len"] == 512
    assert plan["kernels"]["gluon"] is False and plan["kernels"]["pdl"] is False
    monkeypatch.setenv("EDGESPEC_CONFIG", str(config))
    monkeypatch.setenv("EDGESPEC_DEVICE", "cpu")
    assert main(["doctor", "--host-only", "--plan"]) == 0
    text = capsys.readouterr().out
    shown = yaml.safe_load(text[text.index("runtime plan"):].split("\n", 1)[1])
    assert shown["drafter"]["name"] == "ngram" and shown["kernels"]["pdl"] is False
