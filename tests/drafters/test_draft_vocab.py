"""The frequency-ranked draft vocabulary (edgespec.drafters.draft_vocab): proposals are the argmax over the subset
of the full head's scores, speculative output equals plain, and a bad ranking file gets an error naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgespec.arch.detect import select_hooks
from edgespec.bench import random_drafter
from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.drafters.dflash import load_dflash_checkpoint
from edgespec.drafters.draft_vocab import VOCAB_FILE, load_draft_ids, rank_by_counts, write_draft_vocab
from edgespec.errors import CheckpointError, ConfigError
from edgespec.loading.checkpoint import load_target
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("draft-vocab")
    target_dir = write_random_checkpoint(tmp / "target", tiny_config("llama"))
    folder = random_drafter.write_dflash_drafter(tmp / "drafter", target_dir, num_layers=2, block_size=8)
    return load_target(target_dir), folder


def _fill_window(proposer, rows: int) -> None:
    taps = torch.randn(rows, len(proposer.taps), proposer.target.config.hidden_size,
                       generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        proposer._append(taps, 0)
    proposer.history = list(range(rows + 1))


def test_proposals_are_the_argmax_over_the_subset(tiny) -> None:
    target, folder = tiny
    prop = load_dflash_checkpoint(folder, target, window_size=16)
    _fill_window(prop, 12)
    vocab = target.config.vocab_size
    full = prop.propose(prop.history[-1], 7)
    full_logits = prop.last_logits.clone()
    assert torch.equal(full.tokens, full_logits.argmax(-1))
    # a subset without the full head's choices, in no particular order
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    ids = ids[~torch.isin(ids, full.tokens)][:vocab // 3]
    prop.set_draft_vocab(ids)
    # the ranked ids, then the request's own tokens outside them (answers copy the request's words)
    own = sorted(set(prop.history) - set(ids.tolist()))
    vocab_ids = torch.cat([ids, torch.tensor(own)])
    assert torch.equal(prop._draft_ids, vocab_ids)
    sub = prop.propose(prop.history[-1], 7).tokens
    assert torch.equal(sub, vocab_ids[full_logits[:, vocab_ids].argmax(-1)])
    logits = prop.last_logits
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[vocab_ids] = False
    assert torch.isinf(logits[:, outside]).all()
    torch.testing.assert_close(logits[:, vocab_ids], full_logits[:, vocab_ids])
    # a committed token outside the vocabulary joins it; a new request starts from the ranked ids again
    fresh = next(t for t in range(vocab) if t not in set(vocab_ids.tolist()))
    prop.commit([fresh], 0, None)
    assert prop._draft_ids[-1].item() == fresh and prop._request_rows.shape[0] == len(own) + 1
    prop.reset()
    assert torch.equal(prop._draft_ids, ids) and prop._request_rows is None
    _fill_window(prop, 12)
    prop.set_draft_vocab(None)                 # back to the full head
    assert torch.equal(prop.propose(prop.history[-1], 7).tokens, full.tokens)


def test_speculative_output_equals_plain_with_a_draft_vocabulary(tiny, tmp_path) -> None:
    target, folder = tiny
    vocab = target.config.vocab_size
    write_draft_vocab(folder, {"source": "test: the highest ids first", "ids": list(range(vocab - 1, -1, -1))})
    prop = load_dflash_checkpoint(folder, target, window_size=16, draft_vocab=vocab // 4)
    assert prop._draft_ids.tolist() == list(range(vocab - 1, vocab - 1 - vocab // 4, -1))
    prompt = [5, 9, 2, 7, 11, 3]
    plain = SpecSession.with_defaults(target, select_hooks("base", CPU), None, max_len=128)
    want = plain.generate(prompt, max_tokens=20, policy=StrictGreedy()).token_ids
    spec = SpecSession.with_defaults(target, select_hooks("base", CPU), prop, max_len=128)
    assert spec.generate(prompt, max_tokens=20, policy=StrictGreedy()).token_ids == want


def test_rank_by_counts_and_the_unranked_rest() -> None:
    content = rank_by_counts([[4, 4, 1, 7], [7, 4, 9]], "counts")
    assert content["ids"] == [4, 7, 1, 9] and content["tokens_counted"] == 7


def test_the_unranked_ids_follow_in_id_order(tmp_path: Path) -> None:
    write_draft_vocab(tmp_path, {"source": "t", "ids": [5, 2]})
    assert load_draft_ids(tmp_path, 5, 8).tolist() == [5, 2, 0, 1, 3]
    assert load_draft_ids(tmp_path, 1, 8).tolist() == [5]


@pytest.mark.parametrize("text, match", [
    (None, "missing"),
    ("{not json", "not readable JSON"),
    ('{"source": "x"}', "non-empty list 'ids'"),
    ('{"ids": []}', "non-empty list 'ids'"),
    ('{"ids": [1, "2"]}', "not integers"),
    ('{"ids": [1, true]}', "not integers"),
    ('{"ids": [1, 99]}', r"outside the head's vocabulary 0\.\.15"),
    ('{"ids": [-1]}', "outside"),
    ('{"ids": [3, 1, 3]}', "token id 3 is ranked more than once"),
])
def test_a_bad_ranking_file_is_named(tmp_path: Path, text: str | None, match: str) -> None:
    if text is not None:
        (tmp_path / VOCAB_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=match) as e:
        load_draft_ids(tmp_path, 4, 16)
    assert VOCAB_FILE in str(e.value)


@pytest.mark.parametrize("n", [-1, 17])
def test_a_draft_vocab_size_outside_the_head_is_refused(tmp_path: Path, n: int) -> None:
    write_draft_vocab(tmp_path, {"ids": [1]})
    with pytest.raises(ConfigError, match=f"draft_vocab {n}"):
        load_draft_ids(tmp_path, n, 16)


def test_the_shipped_ranking_loads_for_the_demo_head() -> None:
    from edgespec.drafters.dflash import demo_drafter_path

    folder = demo_drafter_path()
    raw = json.loads((folder / VOCAB_FILE).read_text())
    assert raw["source"] and raw["ids"]
    ids = load_draft_ids(folder, 8192, 49152)
    assert ids.unique().numel() == 8192


def test_demo_gguf_head_subset_proposals_and_output(demo_gguf) -> None:
    """The demo's GGUF head: the gathered rows score as the full head does, and greedy output stays plain's."""
    from edgespec.config import Settings
    from edgespec.engine import Engine, Request
    from edgespec.plan import build_plan

    plain = Engine.load(build_plan(Settings(model="demo", drafter="none", max_tokens=24)))
    spec = Engine.load(build_plan(Settings(model="demo", drafter="dflash", max_tokens=24, draft_vocab=4096)))
    req = Request(messages=[{"role": "user", "content": "Move the arm to the bin and report the joints as JSON."}],
                  max_tokens=24)
    assert spec.complete(req).token_ids == plain.complete(req).token_ids
    prop = spec.proposer.model
    assert prop._head_subset.blocks.shape[0] == 4096
    with torch.inference_mode():
        hidden = prop.block_hidden(prop.history[-1])[1:]
        full = prop._head(hidden).float()
        drafts = prop.propose(prop.history[-1], 15).tokens
    ids = prop._draft_ids
    assert torch.equal(drafts, ids[full[:, ids].argmax(-1)])
