"""JSON mode (edgespec.serving.grammar): the llguidance TokenConstraint on its own and inside the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from serving_helpers import write_tiny_chat_model

from edgespec.config import Settings
from edgespec.engine import Engine, Request
from edgespec.errors import RequestError
from edgespec.loading.tokenizer import ChatTokenizer
from edgespec.plan import build_plan
from edgespec.serving.grammar import GrammarCompiler

VOCAB = 272

# Every value is bounded (enums, small integers, maxItems), so even a random model finishes the object.
ROBOT_PLAN = {
    "type": "object",
    "properties": {
        "steps": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "action": {"enum": ["move", "grasp", "release", "wait"]},
                    "target": {"enum": ["cup", "table", "shelf", "home"]},
                    "speed": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["action", "target", "speed"],
                "additionalProperties": False,
            },
        },
        "done": {"type": "boolean"},
    },
    "required": ["steps", "done"],
    "additionalProperties": False,
}


def check_robot_plan(value: object) -> None:
    """Validate against ROBOT_PLAN (jsonschema when installed, else the same rules by hand)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(value, ROBOT_PLAN)
        return
    assert isinstance(value, dict) and set(value) == {"steps", "done"}
    assert isinstance(value["done"], bool)
    steps = value["steps"]
    assert isinstance(steps, list) and 1 <= len(steps) <= 3
    for step in steps:
        assert set(step) == {"action", "target", "speed"}
        assert step["action"] in ("move", "grasp", "release", "wait")
        assert step["target"] in ("cup", "table", "shelf", "home")
        assert isinstance(step["speed"], int) and not isinstance(step["speed"], bool) and 0 <= step["speed"] <= 9


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("grammar") / "tiny", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_folder(tiny_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: ChatTokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one thread is ~100x faster than two fighting other jobs
    yield Engine.load(build_plan(Settings(model=str(tiny_dir), max_seq_len=512, drafter="ngram")))
    torch.set_num_threads(threads)


PLAN_TEXT = '{"steps": [{"action": "move", "target": "cup", "speed": 3}], "done": false}'


def test_valid_text_is_accepted_whole_and_finishes(compiler: GrammarCompiler, tokenizer: ChatTokenizer) -> None:
    c = compiler.json_schema(ROBOT_PLAN)
    ids = tokenizer.encode(PLAN_TEXT)
    assert c.valid_prefix(ids) == len(ids)
    c.commit(ids[:10])
    assert not c.is_finished()
    c.commit(ids[10:])
    assert c.is_finished()
    # Once complete only end-of-sequence may follow.
    mask = c.row_masks([], VOCAB, torch.device("cpu"))
    assert set(torch.nonzero(mask[0]).flatten().tolist()) <= set(tokenizer.stop_token_ids)


def test_drafts_are_truncated_at_the_first_invalid_token(compiler: GrammarCompiler,
                                                         tokenizer: ChatTokenizer) -> None:
    c = compiler.json_schema(ROBOT_PLAN)
    good = tokenizer.encode('{"steps": [{"action": "')
    bad = tokenizer.encode("jump")
    assert c.valid_prefix(good + bad) == len(good)
    assert c.valid_prefix(tokenizer.encode("[1]")) == 0


def test_row_masks_follow_the_drafts_and_leave_the_matcher_where_it_was(
        compiler: GrammarCompiler, tokenizer: ChatTokenizer) -> None:
    c = compiler.json_schema(ROBOT_PLAN)
    ids = tokenizer.encode(PLAN_TEXT)
    c.commit(ids[:5])
    drafts = ids[5:9]
    masks = c.row_masks(drafts, VOCAB, torch.device("cpu"))
    assert masks.shape == (len(drafts) + 1, VOCAB) and masks.dtype == torch.bool
    for i, t in enumerate(drafts):
        assert masks[i, t], f"row {i} must allow draft {t}"
    assert masks.sum(dim=1).min() >= 1
    # The matcher was rolled back: the rest of the text still validates from the committed state.
    assert c.valid_prefix(ids[5:]) == len(ids) - 5
    # A wider logits row (model vocab above the tokenizer's) is padded with disallowed tokens.
    wide = c.row_masks([], VOCAB + 8, torch.device("cpu"))
    assert wide.shape == (1, VOCAB + 8) and not wide[0, VOCAB:].any()


def test_eos_is_allowed_only_where_the_value_may_end(compiler: GrammarCompiler, tokenizer: ChatTokenizer) -> None:
    stop = set(tokenizer.stop_token_ids)
    c = compiler.json_schema({"type": "integer"})
    c.commit(tokenizer.encode("12"))
    allowed = set(torch.nonzero(c.row_masks([], VOCAB, torch.device("cpu"))[0]).flatten().tolist())
    assert stop & allowed, "an integer may end here"
    assert {tokenizer.encode("3")[0]} <= allowed, "or go on"
    assert not c.is_finished()
    obj = compiler.json_object()
    first = set(torch.nonzero(obj.row_masks([], VOCAB, torch.device("cpu"))[0]).flatten().tolist())
    assert not (stop & first) and first == {tokenizer.encode("{")[0]}


@pytest.mark.parametrize("schema", [{"type": "bogus"}, {"type": "object", "properties": {"a": {"$ref": "#/x"}}}])
def test_bad_schema_is_a_request_error(compiler: GrammarCompiler, schema: dict) -> None:
    with pytest.raises(RequestError):
        compiler.json_schema(schema)


def test_engine_output_validates_and_speculation_stays_lossless(engine: Engine, tiny_dir: Path) -> None:
    grammar = GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size)
    msgs = [{"role": "user", "content": "plan: pick up the cup"}]
    spec = engine.complete(Request(messages=msgs, max_tokens=300, constraint=grammar.json_schema(ROBOT_PLAN)))
    plain = engine.complete(Request(messages=msgs, max_tokens=300, constraint=grammar.json_schema(ROBOT_PLAN),
                                    num_draft_tokens=0))
    assert spec.finish_reason == "stop", spec.text
    check_robot_plan(json.loads(spec.text))
    assert spec.text == plain.text, "greedy JSON-mode output must not depend on drafting"
    assert plain.telemetry.drafts == 0
    obj = engine.complete(Request(messages=msgs, max_tokens=300, constraint=grammar.json_object()))
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # a random model may write one long string; what it wrote must still be a JSON prefix
        assert obj.text.startswith("{")
