"""Arctic Inference's suffix decoding as the peer of our suffix drafter (edgespec.bench.peer_arctic): it drafts what
its suffix trees hold through the proposer protocol, runs as a ``bench session`` column beside ``suffix`` with every
answer equal to plain and the two ALs printed side by side, and a missing library drops the column with the reason."""

from __future__ import annotations

import pytest
from test_session_bench import _args

from edgespec.bench import peer_arctic
from edgespec.bench.session import parse_drafters, run_session
from edgespec.bench.shapes import tiny_config, write_chat_tokenizer, write_random_checkpoint
from edgespec.config import Settings
from edgespec.errors import ConfigError

needs_arctic = pytest.mark.skipif(peer_arctic.arctic_available() is not None,
                                  reason=str(peer_arctic.arctic_available()))


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("arctic") / "m"
    return write_chat_tokenizer(write_random_checkpoint(folder, tiny_config("llama", vocab_size=272), seed=3))


@needs_arctic
def test_drafts_the_continuation_of_a_repeat_and_learns_outputs():
    prop = peer_arctic.ArcticSuffixProposer(max_depth=24)
    prop.select("robot-1")
    prop.begin([5, 6, 7, 8, 9, 5, 6], None)
    assert prop.propose(6, 8).tokens.tolist() == [7, 8]             # a 2-token match, factor 1: 2 drafts
    assert prop.propose(6, 1).tokens.tolist() == [7]                 # capped by K
    prop.commit([40, 41, 42, 43], 0, None)
    prop.begin([1, 2, 3, 40, 41], None)                              # the next request of the same client
    draft = prop.propose(41, 8)
    assert draft.tokens.tolist() == [42, 43]                        # from the global tree of outputs
    prop.select("robot-2")                                           # another client: nothing learnt yet
    prop.begin([1, 2, 3, 40, 41], None)
    assert prop.propose(41, 8) is None
    prop.reset()


@needs_arctic
def test_session_column_beside_suffix(tiny_chat_model, capsys):
    args = _args("--session-drafters", "suffix,arctic", "--session-requests", "4", "--session-first", "1",
                 "--tokens", "16")
    figures = run_session(args, Settings(model=str(tiny_chat_model), max_seq_len=512))
    text = capsys.readouterr().out
    assert "suffix vs arctic (steady): AL" in text
    assert all(row["arctic"]["same_as_plain"] for row in figures["rows"])
    steady = figures["peers"]["suffix/arctic steady"]
    assert steady["ours"] == figures["steady"]["suffix"]["al"] and steady["peer"] == figures["steady"]["arctic"]["al"]


def test_missing_library_drops_the_column_with_the_reason(tiny_chat_model, monkeypatch, capsys):
    monkeypatch.setattr(peer_arctic, "arctic_available", lambda: "arctic-inference suffix decoding unavailable (x)")
    args = _args("--session-drafters", "arctic", "--session-requests", "1", "--tokens", "4")
    figures = run_session(args, Settings(model=str(tiny_chat_model), max_seq_len=512))
    assert "no arctic column: arctic-inference suffix decoding unavailable" in capsys.readouterr().out
    assert set(figures["first"]) == {"plain"} and figures["peers"] == {}
    with pytest.raises(ConfigError, match="unavailable"):
        peer_arctic.ArcticSuffixProposer()
    with pytest.raises(ConfigError, match="arctik not among"):
        parse_drafters("suffix,arctik")
    assert parse_drafters("arctic,suffix") == ["plain", "arctic", "suffix"]
