"""Adaptive draft length (CPU default): the rule itself, the arch defaults, and the setting override."""

from __future__ import annotations

import pytest

from edgespec.arch.base import ArchHooks
from edgespec.arch.rtx import RtxHooks
from edgespec.arch.thor import ThorHooks
from edgespec.speculative.session import DraftLength


def test_fixed_length_never_moves():
    d = DraftLength(6, adaptive=False)
    for drafted, accepted in [(6, 0), (6, 6), (3, 1)]:
        d.update(drafted, accepted)
        assert d.k == 6


def test_adaptive_grows_after_full_accepts_and_shrinks_to_what_paid():
    d = DraftLength(10, adaptive=True)
    assert d.k == 10                      # starts at K
    d.update(10, 3)                       # rejection at draft 4: next time draft 3 + 1
    assert d.k == 4
    d.update(4, 4)                        # all accepted: +2
    assert d.k == 6
    d.update(6, 6)
    d.update(8, 8)
    assert d.k == 10                      # capped at K
    d.update(10, 10)
    assert d.k == 10
    d.update(10, 0)                       # nothing accepted: one draft
    assert d.k == 1
    d.update(1, 0)
    assert d.k == 1                       # never below one
    d.update(0, 0)                        # a cycle without drafts changes nothing
    assert d.k == 1


def test_shrink_never_grows():
    d = DraftLength(8, adaptive=True)
    d.update(8, 1)
    assert d.k == 2
    d.update(2, 1)                        # rejected at the last draft: accepted + 1 = 2, not more
    assert d.k == 2


@pytest.mark.parametrize("hooks,expected", [(ArchHooks, True), (RtxHooks, False), (ThorHooks, False)])
def test_arch_defaults(hooks, expected):
    assert hooks().defaults.adaptive_k is expected


def test_session_takes_the_setting_over_the_arch_default(tiny_models):
    from edgespec.drafters.ngram import NGramProposer
    from edgespec.speculative.session import SpecSession

    model = tiny_models["llama"]
    assert SpecSession.with_defaults(model, ArchHooks(), NGramProposer(), k=4, max_len=64).adaptive_k is True
    assert SpecSession.with_defaults(model, ArchHooks(), NGramProposer(), k=4, max_len=64,
                                     adaptive_k=False).adaptive_k is False
    assert SpecSession.with_defaults(model, RtxHooks(), NGramProposer(), k=4, max_len=64,
                                     adaptive_k=True).adaptive_k is True
