"""Special tokens come from the checkpoint, never from the engine: the token that opens a chat turn and the one
that closes an assistant turn are read off the chat template (ChatML, Llama 3, Gemma spellings), the stop ids also
come from generation_config / config / tokenizer_config and the GGUF metadata, and a checkpoint that says nowhere
where generation ends is refused with an error naming the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from edgespec.errors import CheckpointError
from edgespec.loading.resumable_encoder import ResumableEncoder
from edgespec.loading.tokenizer import ChatTokenizer

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
GEMMA_SPECIALS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def write_tokenizer(folder: Path, specials: list[str], template: str | None, *, bos: str | None = None,
                    eos: str | None = None, eos_ids: list[str] = ()) -> Path:
    """A byte-level tokenizer with ``specials``; ``eos`` in tokenizer_config.json, ``eos_ids`` (token strings) in
    generation_config.json: each left out when not given."""
    folder.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": bos, "eos_token": eos, "chat_template": template,
           "added_tokens_decoder": {str(tok.token_to_id(s)): {"content": s, "special": True} for s in specials}}
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    if eos_ids:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.token_to_id(t)
                                                                                    for t in eos_ids]}))
    return folder


@pytest.mark.parametrize("specials,template,opener,closer,bos", [
    (LLAMA3_SPECIALS, LLAMA3_TEMPLATE, "<|start_header_id|>", "<|eot_id|>", "<|begin_of_text|>"),
    (GEMMA_SPECIALS, GEMMA_TEMPLATE, "<start_of_turn>", "<end_of_turn>", "<bos>"),
    (CHATML_SPECIALS, CHATML_TEMPLATE, "<|im_start|>", "<|im_end|>", None),
])
def test_turn_tokens_come_from_the_template(tmp_path: Path, specials, template, opener, closer, bos) -> None:
    # generation_config names only the base model's end of text: the end of a chat turn comes from the template
    folder = write_tokenizer(tmp_path / "ckpt", specials, template, bos=bos, eos_ids=[specials[1 if bos else 0]])
    tok = ChatTokenizer.from_folder(folder)
    assert (tok.turn_markers.opener, tok.turn_markers.closer) == (opener, closer)
    assert tok.turn_token_id == tok.token_id(opener)
    assert tok.stop_token_ids == [tok.token_id(specials[1 if bos else 0]), tok.token_id(closer)]


def test_a_llama3_conversation_resumes_at_its_own_turn_token(tmp_path: Path) -> None:
    folder = write_tokenizer(tmp_path / "ckpt", LLAMA3_SPECIALS, LLAMA3_TEMPLATE, bos="<|begin_of_text|>",
                             eos_ids=["<|eot_id|>"])
    tok = ChatTokenizer.from_folder(folder)
    enc = ResumableEncoder(tok.tokenizer, tok.turn_markers.opener)
    assert enc.enabled, enc.reason
    turns = [{"role": "user", "content": "Go to the kitchen."}, {"role": "assistant", "content": "On my way."},
             {"role": "user", "content": "Now pick up the cup."}]
    first, second = (tok.apply_chat_template(turns[:n]) for n in (1, 3))
    enc.encode(first)
    assert enc.encode(second) == tok.encode(second)       # the oracle: the whole rendering encoded at once
    # resumed at the last turn token the two renderings share (the assistant header), not from the start
    start = second.rfind("<|start_header_id|>", 0, len(first))
    assert start > 0 and enc.last_encoded_chars == len(second) - start
    assert not ResumableEncoder(tok.tokenizer, "<|im_start|>").enabled    # ChatML's token is not this model's


def test_a_template_without_turn_tokens_leaves_them_unknown(tmp_path: Path) -> None:
    folder = write_tokenizer(tmp_path / "ckpt", CHATML_SPECIALS, PLAIN_TEMPLATE, eos="<|endoftext|>")
    tok = ChatTokenizer.from_folder(folder)
    assert tok.turn_markers.opener is None and tok.turn_markers.closer is None and tok.turn_token_id is None
    assert tok.stop_token_ids == [tok.token_id("<|endoftext|>")]
    enc = ResumableEncoder(tok.tokenizer, tok.turn_markers.opener)
    assert not enc.enabled and "no token that opens every turn" in enc.reason


def test_no_end_token_anywhere_is_refused_naming_the_files(tmp_path: Path) -> None:
    folder = write_tokenizer(tmp_path / "ckpt", CHATML_SPECIALS, PLAIN_TEMPLATE)
    with pytest.raises(CheckpointError) as err:
        ChatTokenizer.from_folder(folder)
    message = str(err.value)
    assert str(folder) in message
    for name in ("generation_config.json", "config.json", "tokenizer_config.json", "chat template"):
        assert name in message


def test_a_gguf_without_end_tokens_is_refused_naming_the_file(tmp_path: Path, monkeypatch) -> None:
    from gguf_files import write_tiny_gguf

    from edgespec.loading.gguf_meta import gguf_metadata_folder

    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "no-eos.gguf", eos=False, chat_template=PLAIN_TEMPLATE)
    with pytest.raises(CheckpointError) as err:
        ChatTokenizer.from_folder(gguf_metadata_folder(path))
    assert f"converted from {path}" in str(err.value) and "tokenizer.ggml.eos_token_id" in str(err.value)
    # The same file with its chat template: the template's turn end is the stop token.
    ok = ChatTokenizer.from_folder(gguf_metadata_folder(write_tiny_gguf(tmp_path / "chat.gguf", eos=False)))
    assert ok.stop_token_ids == [ok.token_id("<|im_end|>")]


def test_the_engine_marks_turns_with_the_checkpoints_token(tmp_path: Path) -> None:
    """A Llama 3 style checkpoint: prefix reuse and resumed tokenising key on <|start_header_id|>, and a chat
    completion renders and runs (no ChatML token anywhere)."""
    from edgespec.bench.shapes import config_dict, write_random_checkpoint
    from edgespec.config import Settings
    from edgespec.engine import Engine, Request
    from edgespec.plan import build_plan

    folder = tmp_path / "llama3-tiny"
    write_random_checkpoint(folder, config_dict(model_type="llama", vocab_size=272, hidden_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                intermediate_size=128, tie_word_embeddings=True, bos_token_id=None,
                                                eos_token_id=None))
    write_tokenizer(folder, LLAMA3_SPECIALS, LLAMA3_TEMPLATE, bos="<|begin_of_text|>", eos="<|end_of_text|>")
    engine = Engine.load(build_plan(Settings(model=str(folder), device="cpu", max_seq_len=256, drafter="none",
                                             prefix_reuse=True, max_tokens=4)))
    tok = engine.tokenizer
    assert engine.prefix.turn_ids == {tok.token_id("<|start_header_id|>")}
    assert engine.encoder.enabled and engine.encoder.marker == "<|start_header_id|>"
    assert set(tok.stop_token_ids) == {tok.token_id("<|end_of_text|>"), tok.token_id("<|eot_id|>")}
    done = engine.complete(Request(messages=[{"role": "user", "content": "Wave."}], max_tokens=4))
    assert 1 <= len(done.token_ids) <= 4
