"""``edgespec profile``: tune the speculative-decoding knobs on the device and write the winning YAML.

Modules: :mod:`~edgespec.profile.space` (knobs, candidate values, groups), :mod:`~edgespec.profile.measure`
(one candidate on one prompt), :mod:`~edgespec.profile.search` (coordinate descent within a budget),
:mod:`~edgespec.profile.results` (the resumable JSONL), :mod:`~edgespec.profile.report` (YAML, JSON, Markdown,
PNG), :mod:`~edgespec.profile.cli` (the command); the stderr bar is :mod:`edgespec.progress`.
See ``docs/profile.md``.
"""

from __future__ import annotations

from edgespec.profile.cli import add_profile_arguments, main, parse_budget, run_profile

__all__ = ["add_profile_arguments", "main", "parse_budget", "run_profile"]
