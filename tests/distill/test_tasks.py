"""The structured requests of ``--prompts tasks:N``: seeded, distinct, labelled by domain, and apart from what
measures generality (the benchmark prompts and the session bench's robot stream)."""

from __future__ import annotations

import json
import re

from edgespec.bench.robot_stream import _ROBOTS, robot_stream
from edgespec.distill import tasks
from edgespec.distill.cli import _prompt_set
from edgespec.distill.self_instruct import TOPICS, parse_sources
from edgespec.distill.workload import bench_prompt_texts

# The JSON keys the robot stream asks for (each is checked to occur in its templates below).
STREAM_KEYS = ["leg", "altitude_m", "heading_deg", "camera", "segment", "corridor", "door_action", "eta_s", "op",
               "source_well", "target_well", "volume_ul", "tip", "stop", "plant_id", "action", "notes", "intent",
               "steps", "risk", "ask_operator", "shift", "racks", "faults", "water_l", "next_maintenance"]
STREAM_MACHINES = ["drone", "cart", "pipett", "greenhouse", "rover", "humanoid", "dish", "ward"]


def test_task_prompts_are_seeded_distinct_and_labelled() -> None:
    a, b = tasks.task_prompts(300, seed=3), tasks.task_prompts(300, seed=3)
    assert a == b and len({t for t, _ in a}) == 300
    assert tasks.task_prompts(300, seed=4) != a
    domains = {labels["template"] for _, labels in a}
    assert domains == set(tasks._DOMAINS)                      # 300 requests reach every domain
    texts = [t for t, _ in a]
    assert sum("JSON" in t or "json" in t for t in texts) > 0.85 * len(texts)
    assert any("functions" in t.lower() or "tools" in t.lower() for t in texts)
    assert all("{" not in t.replace("{\"name\"", "").replace("{...}", "") for t in texts), "unfilled slot"


def test_task_prompts_share_nothing_with_the_measuring_sets() -> None:
    stream_text = " ".join(t for templates, _ in _ROBOTS for t in templates)
    assert all(re.search(rf"\b{re.escape(k)}\b", stream_text) for k in STREAM_KEYS)
    assert not set(tasks._KEYS) & set(STREAM_KEYS)
    texts = [t for t, _ in tasks.task_prompts(2000, seed=0)]
    assert not set(texts) & bench_prompt_texts()
    assert not set(texts) & set(robot_stream(400, seed=0))
    lowered = " ".join(texts).lower()
    assert [m for m in STREAM_MACHINES if m in lowered] == []
    openers = " ".join(TOPICS["self-tool"][1]).lower()
    assert [m for m in STREAM_MACHINES if m in openers] == []


def test_tasks_is_a_prompt_source() -> None:
    assert parse_sources("tasks:5+self-tool:3") == [("tasks", "5"), ("self-tool", "3")]
    labelled = _prompt_set("tasks:6+robot:2")
    assert [lab["source"] for _, lab in labelled].count("tasks") == 6
    assert all("template" in lab for _, lab in labelled if lab["source"] == "tasks")
    json.dumps(labelled)                                        # labels stay plain strings
