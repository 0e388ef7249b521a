"""The benchmark prompt set (a copy of shared/bench/prompts.yaml ships in the package as the default)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from edgespec.errors import ConfigError


@dataclass(frozen=True)
class BenchPrompt:
    """One chat prompt of the set."""

    id: str
    user: str
    thinking: bool = False


def load_prompts(path: str | Path | None = None) -> list[BenchPrompt]:
    """Read a prompt set (default: the packaged copy); every entry needs ``id`` and ``user``."""
    if path is None:
        text = resources.files("edgespec").joinpath("data/prompts.yaml").read_text()
        where = "edgespec/data/prompts.yaml"
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"prompt file not found: {p}")
        text, where = p.read_text(), str(p)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"prompt file {where} is not valid YAML: {e}") from None
    if not isinstance(data, list) or not data:
        raise ConfigError(f"prompt file {where} must be a non-empty list of {{id, user, thinking}}")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or "id" not in item or "user" not in item:
            raise ConfigError(f"prompt file {where}: entry {i} needs 'id' and 'user'")
        out.append(BenchPrompt(str(item["id"]), str(item["user"]), bool(item.get("thinking", False))))
    return out
