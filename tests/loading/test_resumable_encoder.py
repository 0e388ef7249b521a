"""ResumableEncoder: re-encoding only the changed tail of a conversation gives exactly the full encoding."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from edgespec.bench.shapes import _byte_tokenizer
from edgespec.loading.resumable_encoder import ResumableEncoder, common_chars, resumable_reason


def _bpe_tokenizer() -> Tokenizer:
    """A small byte-level BPE with merges (words become multi-byte tokens) and digit splitting, as SmolLM2's."""
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    from tokenizers.trainers import BpeTrainer
    corpus = ["the robot arm picks the red block and places it on the shelf near the sink"] * 20
    tok.train_from_iterator(corpus, BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                               special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    return tok


def _render(turns: list[tuple[str, str]], generation: bool = True) -> str:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + ("<|im_start|>assistant\n" if generation else "")


CONVERSATION = [("system", "You steer a robot arm. Log: 12 picks, 3 places.\n" * 8),
                ("user", "pick the red block"), ("assistant", "picked  the red block; 42 mm grip"),
                ("user", "place it on the shelf\n\n"), ("assistant", "placed it <on> the shelf"),
                ("user", "now the sink: résumé 🤖 done?"), ("assistant", "")]


@pytest.mark.parametrize("make", [_byte_tokenizer, _bpe_tokenizer])
def test_growing_conversation_equals_full_encoding(make) -> None:
    tok = make()
    enc = ResumableEncoder(tok, "<|im_start|>")
    assert enc.enabled, enc.reason
    full_chars = []
    for n in range(1, len(CONVERSATION) + 1):
        text = _render(CONVERSATION[:n])
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False).ids
        full_chars.append(len(text))
    # Each follow-up turn encoded only its tail, not the whole conversation.
    assert enc.last_encoded_chars < full_chars[-1] - len(CONVERSATION[0][1])


@pytest.mark.parametrize("make", [_byte_tokenizer, _bpe_tokenizer])
def test_edits_anywhere_still_equal_full_encoding(make) -> None:
    """A rendering that differs early, shrinks, or repeats exactly: always the full encoding's ids."""
    tok = make()
    enc = ResumableEncoder(tok, "<|im_start|>")
    texts = [_render(CONVERSATION[:5]), _render(CONVERSATION[:5], generation=False),
             _render([("system", "another system prompt")] + CONVERSATION[1:5]), _render(CONVERSATION[:3]),
             _render(CONVERSATION[:3]), "no markers at all", _render(CONVERSATION[:6]),
             _render(CONVERSATION[:6]).replace("shelf\n\n", "shelf\n"), "", _render(CONVERSATION[:2])]
    for text in texts:
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False).ids
    enc.forget()
    assert enc.encode(texts[0]) == tok.encode(texts[0], add_special_tokens=False).ids
    assert enc.last_encoded_chars == len(texts[0])


def test_refuses_tokenizers_that_treat_the_start_differently() -> None:
    tok = Tokenizer(BPE(vocab={"a": 0, "▁": 1, "▁a": 2}, merges=[("▁", "a")]))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.add_special_tokens(["<|im_start|>"])
    assert "Metaspace" in resumable_reason(tok, "<|im_start|>")
    enc = ResumableEncoder(tok, "<|im_start|>")
    assert not enc.enabled
    for text in ["a<|im_start|>a", "a<|im_start|>a<|im_start|>a a"]:
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False).ids
        assert enc.last_encoded_chars == len(text)
    tok2 = _byte_tokenizer()
    tok2.normalizer = normalizers.Prepend("▁")
    assert "Prepend" in resumable_reason(tok2, "<|im_start|>")
    assert "not an added token" in resumable_reason(_byte_tokenizer(), "<|nope|>")


def test_common_chars() -> None:
    for a, b in [("", ""), ("abc", "abc"), ("abc", "abd"), ("abc", "ab"), ("x", "y"), ("héllo🤖a", "héllo🤖b")]:
        n = common_chars(a, b)
        assert a[:n] == b[:n] and (n == min(len(a), len(b)) or a[n] != b[n])
