"""ChatTokenizer, IncrementalDetokenizer and StopStringMatcher (edgespec.loading.tokenizer)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE, WordLevel

from edgespec.errors import CheckpointError, RequestError
from edgespec.loading.tokenizer import ChatTokenizer, IncrementalDetokenizer, StopStringMatcher

# A trimmed Qwen3-style template: thinking switch, tools rendered with tojson, raise_exception on bad roles.
QWEN_STYLE_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n# Tools\\n' }}
{%- for tool in tools %}
{{- tool | tojson }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant'] %}
{{- raise_exception('Unexpected role: ' + message.role) }}
{%- endif %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: every UTF-8 byte is its own token, so multi-byte characters always span
    several tokens -- the hardest case for incremental detokenisation."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens(["<think>", "</think>"])
    return tok


def _write_folder(folder: Path, *, template: object = QWEN_STYLE_TEMPLATE, extra: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok = _byte_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    cfg: dict = {
        "eos_token": "<|im_end|>",
        # pad as a serialised AddedToken dict, the other spelling exporters use
        "pad_token": {"content": "<|endoftext|>", "special": True, "normalized": False},
        "bos_token": None,
        "added_tokens_decoder": {str(tok.token_to_id(s)): {"content": s, "special": True} for s in SPECIALS},
    }
    if template is not None:
        cfg["chat_template"] = template
    cfg.update(extra or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot]}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": im_end}))
    return folder


@pytest.fixture()
def tiny(tmp_path: Path) -> ChatTokenizer:
    return ChatTokenizer.from_folder(_write_folder(tmp_path / "ckpt"))


# ---- chat template -----------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_chat_template_thinking_switch(tiny: ChatTokenizer) -> None:
    base = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny.apply_chat_template(MESSAGES) == base
    assert tiny.apply_chat_template(MESSAGES, enable_thinking=True) == base
    assert tiny.apply_chat_template(MESSAGES, enable_thinking=False) == base + "<think>\n\n</think>\n\n"
    assert tiny.apply_chat_template(MESSAGES, add_generation_prompt=False) == base.removesuffix(
        "<|im_start|>assistant\n")


def test_encode_chat_matches_specials_whole(tiny: ChatTokenizer) -> None:
    ids = tiny.encode_chat(MESSAGES, enable_thinking=False)
    im_start, im_end = tiny.token_id("<|im_start|>"), tiny.token_id("<|im_end|>")
    assert ids[0] == im_start and ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert tiny.think_token_ids is not None
    think, end_think = tiny.think_token_ids
    assert ids[-6:-4] == [think, tiny.encode("\n")[0]] and end_think in ids
    # special tokens vanish on decode by default; <think> is an added but not special token and stays
    assert tiny.decode(ids) == "system\nBe brief.\nuser\nHi\nassistant\n<think>\n\n</think>\n\n"
    rendered = tiny.apply_chat_template(MESSAGES, enable_thinking=False)
    assert tiny.decode(ids, skip_special_tokens=False) == rendered


def test_template_helpers_behave_like_transformers(tiny: ChatTokenizer) -> None:
    tools = [{"name": "grip", "description": "ferme la pince <fort>", "b": 1, "a": 2}]
    text = tiny.apply_chat_template(MESSAGES, tools=tools)
    # HF's tojson: no HTML escaping, non-ASCII kept, key order kept
    assert '{"name": "grip", "description": "ferme la pince <fort>", "b": 1, "a": 2}' in text
    with pytest.raises(RequestError, match="Unexpected role: robot"):
        tiny.apply_chat_template([{"role": "robot", "content": "x"}])


def test_trim_blocks_strftime_and_sandbox(tmp_path: Path) -> None:
    template = (
        "{% if true %}\n  {% if add_generation_prompt %}\nA{{ strftime_now('%Y')|length }}\n"
        "{% endif %}\n{% endif %}\n"
    )
    tok = ChatTokenizer.from_folder(_write_folder(tmp_path / "a", template=template))
    assert tok.apply_chat_template(MESSAGES) == "A4\n"  # trim_blocks + lstrip_blocks drop the block lines
    mutating = "{{ messages.append({'role': 'user'}) }}"
    tok = ChatTokenizer.from_folder(_write_folder(tmp_path / "b", template=mutating))
    with pytest.raises(RequestError):  # ImmutableSandboxedEnvironment refuses to mutate the caller's list
        tok.apply_chat_template(MESSAGES)


def test_generation_tag_and_loop_controls(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}{% break %}{% endfor %}"
        "{{ tools is none }}"
    )
    tok = ChatTokenizer.from_folder(_write_folder(tmp_path / "ckpt", template=template))
    assert tok.apply_chat_template(MESSAGES) == "[Hi]True"


def test_template_list_picks_default_and_jinja_file_wins(tmp_path: Path) -> None:
    listed = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    folder = _write_folder(tmp_path / "ckpt", template=listed)
    assert ChatTokenizer.from_folder(folder).apply_chat_template(MESSAGES) == "DEFAULT"
    (folder / "chat_template.jinja").write_text("FROM-FILE")
    assert ChatTokenizer.from_folder(folder).apply_chat_template(MESSAGES) == "FROM-FILE"


def test_ids_and_properties(tiny: ChatTokenizer) -> None:
    im_end, eot = tiny.token_id("<|im_end|>"), tiny.token_id("<|endoftext|>")
    assert tiny.stop_token_ids == [im_end, eot]  # generation_config order, config/eos duplicates dropped
    assert tiny.special_token_ids == {tiny.token_id(s) for s in SPECIALS}
    assert tiny.think_token_ids == (tiny.token_id("<think>"), tiny.token_id("</think>"))
    assert tiny.vocab_size == 256 + 5
    assert tiny.token_id("no-such-token") is None
    assert tiny.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert tiny.encode("é") == [tiny.token_id(c) for c in "Ã©"]  # two byte tokens


# ---- bad inputs --------------------------------------------------------------------------------------------


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path / "ckpt")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        ChatTokenizer.from_folder(folder)
    with pytest.raises(CheckpointError, match="not found"):
        ChatTokenizer.from_folder(tmp_path / "nowhere")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_corrupt_json_names_the_file(tmp_path: Path, name: str) -> None:
    folder = _write_folder(tmp_path / "ckpt")
    (folder / name).write_text('{"truncated": ')
    with pytest.raises(CheckpointError, match=rf"{name}: not valid JSON"):
        ChatTokenizer.from_folder(folder)


def test_tokenizer_json_that_is_not_a_tokenizer(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path / "ckpt")
    (folder / "tokenizer.json").write_text('{"model": {"type": "Nope"}}')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        ChatTokenizer.from_folder(folder)


def test_no_chat_template(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path / "ckpt", template=None)
    tok = ChatTokenizer.from_folder(folder)  # loading works: plain completion does not need a template
    assert tok.chat_template is None
    with pytest.raises(CheckpointError, match="no chat_template") as err:
        tok.apply_chat_template(MESSAGES)
    assert str(folder) in str(err.value)


def test_bad_template_syntax(tmp_path: Path) -> None:
    tok = ChatTokenizer.from_folder(_write_folder(tmp_path / "ckpt", template="{% for %}"))
    with pytest.raises(CheckpointError, match="not valid Jinja"):
        tok.apply_chat_template(MESSAGES)


# ---- incremental detokenizer -------------------------------------------------------------------------------

MIXED = "Robot 🤖 picks 红色方块 → tray ✓. Ünïcödé done."


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list[str]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5) if rng else 1
        chunks.append(detok.add(ids[i:i + n] if rng else ids[i]))
        i += n
    chunks.append(detok.finish())
    return chunks


def test_detokenizer_never_splits_characters(tiny: ChatTokenizer) -> None:
    ids = tiny.encode(MIXED)
    assert len(ids) == len(MIXED.encode("utf-8"))  # one token per byte
    for rng in (None, random.Random(0), random.Random(1)):
        chunks = _stream(IncrementalDetokenizer(tiny), ids, rng)
        assert all("\ufffd" not in c for c in chunks)
        assert "".join(chunks) == tiny.decode(ids) == MIXED


def test_detokenizer_skips_special_tokens(tiny: ChatTokenizer) -> None:
    ids = tiny.encode("<|im_start|>ok<|im_end|>")
    assert "".join(_stream(IncrementalDetokenizer(tiny), ids)) == "ok"
    keep = IncrementalDetokenizer(tiny, skip_special_tokens=False)
    assert "".join(_stream(keep, ids)) == "<|im_start|>ok<|im_end|>"


def test_detokenizer_prompt_context_is_not_emitted(tiny: ChatTokenizer) -> None:
    prompt = tiny.encode_chat(MESSAGES)
    detok = tiny.detokenizer(prompt_ids=prompt)
    assert "".join(_stream(detok, tiny.encode("Hello"))) == "Hello"


def test_detokenizer_incomplete_and_invalid_bytes(tiny: ChatTokenizer) -> None:
    robot = tiny.encode("🤖")
    detok = IncrementalDetokenizer(tiny)
    assert detok.add(tiny.encode("ab") + robot[:2]) == "ab"  # a batch shows all but the unfinished emoji
    assert detok.add(robot[2:]) == "🤖"
    detok = IncrementalDetokenizer(tiny)
    assert detok.add(robot[:2]) == ""  # half an emoji: held back
    assert detok.finish() == "\ufffd"  # end of generation: shown as a replacement character
    # Lone continuation bytes never complete: they are shown after MAX_HELD_TOKENS instead of held forever.
    detok = IncrementalDetokenizer(tiny)
    out = [detok.add(robot[1]) for _ in range(IncrementalDetokenizer.MAX_HELD_TOKENS)]
    assert out[-1].startswith("\ufffd") and all(o == "" for o in out[:-1])
    assert detok.add(tiny.encode("a")) == "a"


def test_detokenizer_with_sentencepiece_style_decoder() -> None:
    # Metaspace strips the leading space of the first token only: the context window must keep later tokens'
    # spaces ("Hello world", not "Helloworld") while the first token still renders without one.
    tok = Tokenizer(WordLevel({"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "!": 3, "\u2581Sure": 4},
                              unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    ids = [1, 2, 3, 2, 2]
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == ["Hello", " world", "!", " world", " world"]
    assert detok.text == tok.decode(ids)
    # seeded with the prompt's tail, the first token renders as it would mid-text
    assert IncrementalDetokenizer(tok, prompt_ids=[1, 2]).add(4) == " Sure"


def test_detokenizer_accepts_numpy_ids(tiny: ChatTokenizer) -> None:
    import numpy as np

    detok = IncrementalDetokenizer(tiny)
    ids = np.array(tiny.encode("ok 🤖"))
    assert detok.add(ids[0]) + detok.add(ids[1:]) == "ok 🤖"


def test_detokenizer_decodes_a_bounded_window(tiny: ChatTokenizer) -> None:
    seen: list[int] = []

    class Spy:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            seen.append(len(ids))
            return tiny.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tiny.encode(MIXED * 40)
    detok = IncrementalDetokenizer(Spy())
    for i in ids:
        detok.add(i)
    detok.finish()
    bound = IncrementalDetokenizer.CONTEXT_TOKENS + IncrementalDetokenizer.MAX_HELD_TOKENS
    assert max(seen) <= bound  # O(new tokens) per call, not O(output length)
    assert detok.text == MIXED * 40 and detok.num_tokens == len(ids)


# ---- stop strings ------------------------------------------------------------------------------------------


def test_stop_string_spanning_tokens(tiny: ChatTokenizer) -> None:
    ids = tiny.encode('{"a": 1}</json> trailing text')
    detok = IncrementalDetokenizer(tiny, stop=["</json>"])
    chunks = [detok.add(i) for i in ids]
    assert "".join(chunks) == '{"a": 1}' == detok.text
    assert detok.stop_hit == "</json>"
    assert chunks[ids.index(tiny.token_id(">"))] == ""  # the token completing the stop shows nothing
    assert detok.add(tiny.encode("more")) == "" and detok.finish() == ""  # nothing after the stop


def test_stop_string_prefix_held_then_released(tiny: ChatTokenizer) -> None:
    detok = IncrementalDetokenizer(tiny, stop=["STOP"])
    assert detok.add(tiny.encode("go ST")) == "go "  # "ST" could start "STOP"
    assert detok.add(tiny.encode("A")) == "STA"  # ... it did not
    assert detok.add(tiny.encode("ST")) == ""
    assert detok.finish() == "ST"  # generation ended: held text was output after all
    assert detok.stop_hit is None and detok.text == "go STAST"


def test_stop_string_after_multibyte_and_in_one_batch(tiny: ChatTokenizer) -> None:
    detok = IncrementalDetokenizer(tiny, stop=["。", "\n\n"])
    assert detok.add(tiny.encode("完成了。后面")) == "完成了"
    assert detok.stop_hit == "。"
    assert detok.finish() == ""


def test_detokenizer_with_stops_fuzz(tiny: ChatTokenizer) -> None:
    """Random text and random batch sizes: the streamed result equals the whole text cut at the first stop."""
    rng = random.Random(1234)
    pieces = ["a", "b", " ", "é", "红", "🤖", "\n", "<", "/", "end", ">"]
    stops = ["</end>", "红🤖", "\n\n"]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        found = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
        expected = text[: min(found)[1]] if found else text
        detok = IncrementalDetokenizer(tiny, stop=stops)
        ids, out, i = tiny.encode(text), [], 0
        while i < len(ids):
            n = rng.randint(1, 12)
            out.append(detok.add(ids[i:i + n]))
            i += n
        out.append(detok.finish())
        assert "".join(out) == expected == detok.text, text
        assert all("\ufffd" not in o for o in out)
        assert (detok.stop_hit is not None) == bool(found)


def test_stop_matcher_first_completed_stop_wins() -> None:
    m = StopStringMatcher(["bc", "abcd", "", "bc"])
    assert m.stops == ("bc", "abcd")
    assert m.feed("xa") == "x" and m.held == "a"  # "a" may start "abcd"
    assert m.feed("bcd tail") == "a" and m.hit == "bc"  # "bc" is complete before "abcd" is
    assert m.feed("more") == "" and m.flush() == ""
    m = StopStringMatcher(["cd", "abcd"])
    assert m.feed("zabcd") == "z" and m.hit == "abcd"  # same end: the one starting earlier
    m = StopStringMatcher([])
    assert m.feed("anything") == "anything" and m.flush() == ""


def test_stop_matcher_is_independent_of_chunking() -> None:
    text = "the plan: {step} ... end of plan ~~ END ~~ after"
    stops = ["END", "plan ~", "{step} ...", "~~ E"]
    whole = StopStringMatcher(stops)
    expected = whole.feed(text) + whole.flush()
    rng = random.Random(7)
    for _ in range(50):
        m, out, i = StopStringMatcher(stops), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            out.append(m.feed(text[i:i + n]))
            i += n
        out.append(m.flush())
        assert "".join(out) == expected and m.hit == whole.hit


# ---- demo (converted SmolLM2) tokenizer --------------------------------------------------------------------


def test_demo_tokenizer_streams_emoji_and_cjk(demo_model_dir: Path) -> None:
    tok = ChatTokenizer.from_folder(demo_model_dir)
    text = "Robot 🤖🦾 moved the 红色方块 (red cube) → tray ✓"
    ids = tok.encode(text)
    # the vocabulary has no whole emoji: at least one token decodes to a partial character on its own
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    chunks = _stream(tok.detokenizer(), ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == tok.decode(ids) == text
