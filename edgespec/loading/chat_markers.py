"""The control tokens that open and close a chat turn, read off the checkpoint's own chat template: ChatML's
``<|im_start|>`` / ``<|im_end|>``, Llama 3's ``<|start_header_id|>`` / ``<|eot_id|>``, Gemma's ``<start_of_turn>`` /
``<end_of_turn>``. Nothing in the engine names them.

How: the template renders a user turn, then the same conversation with an assistant reply. The text the reply adds
starts with the token that opens every turn (it must add exactly one more of it), and the reply's content is
followed by the token that closes an assistant turn (only whitespace between).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edgespec.loading.resumable_encoder import common_chars

# The probe conversation: plain text no template rewrites.
PROBE_REQUEST = "Where is the red cup?"
PROBE_REPLY = "On the shelf by the door."

Render = Callable[[Sequence[Mapping[str, Any]]], str]


@dataclass(frozen=True)
class TurnMarkers:
    """The control tokens of a chat template's turns: ``opener`` starts every turn, ``closer`` ends an assistant
    turn; None where the template has no such token (or no template renders)."""

    opener: str | None = None
    closer: str | None = None


def turn_markers(render: Render, controls: re.Pattern[str] | None) -> TurnMarkers:
    """The :class:`TurnMarkers` of the template behind ``render`` (messages -> text, no generation prompt), among
    the control tokens ``controls`` matches (the tokenizer's added tokens)."""
    if controls is None:
        return TurnMarkers()
    request = [{"role": "user", "content": PROBE_REQUEST}]
    try:
        one = render(request)
        two = render([*request, {"role": "assistant", "content": PROBE_REPLY}])
    except Exception:
        # No template, one that does not parse or refuses this conversation, or a template's own bug on the
        # probe: the markers are unknown, and chat requests report the template's error themselves.
        return TurnMarkers()
    added = two[common_chars(one, two):]
    first = controls.match(added.lstrip())
    opener = first.group() if first is not None else None
    if opener is not None and two.count(opener) != one.count(opener) + 1:
        opener = None          # not one per turn: a token the reply's markup happens to start with
    closer = None
    at = added.find(PROBE_REPLY)
    if at >= 0:
        end = at + len(PROBE_REPLY)
        after = controls.search(added, end)
        if after is not None and not added[end:after.start()].strip():
            closer = after.group()
    return TurnMarkers(opener, closer)
