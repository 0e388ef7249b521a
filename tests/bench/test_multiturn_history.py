"""bench multi-turn's session log: about the asked number of tokens, each line encoded once."""

from __future__ import annotations

from types import SimpleNamespace

from edgespec.bench.multiturn import history_text


class _WordTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return list(range(len(text.split())))


def test_history_is_about_the_asked_length_and_linear():
    tok = _WordTokenizer()
    text = history_text(SimpleNamespace(tokenizer=tok), 3000, None)
    lines = text.splitlines()
    assert len(text.split()) >= 3000 and len(text.split()) - 3000 < max(len(line.split()) for line in lines)
    assert lines[0].startswith("[000] operator: ")
    assert tok.calls < 100          # once per prompt of the set, not once per line of the log
