"""tools/adaptation_eval.py refuses a missing log and one with no held-out request, before loading anything."""

from __future__ import annotations

import json

import pytest
from _tools import load_tool

from edgespec.errors import ConfigError

adaptation_eval = load_tool("adaptation_eval")


def test_bad_logs_are_named(tmp_path, capsys) -> None:
    with pytest.raises(ConfigError, match="request log not found"):
        adaptation_eval.main([str(tmp_path / "absent.jsonl"), "d"])
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"prompt_ids": [1, 2, 3], "output_ids": [4, 5]}) + "\n")
    assert adaptation_eval.main([str(log), "d", "--holdout-every", "0"]) == 2
    assert "no held-out request" in capsys.readouterr().err
