"""Suffix cache (edgespec.drafters.suffix_cache): a byte budget with LRU eviction, client partitions that never
see each other, persistence that survives a restart (and a torn line), clear errors for bad settings."""

from __future__ import annotations

import json

import pytest

from edgespec.drafters.suffix_cache import SuffixCache, partition_of
from edgespec.errors import ConfigError

VOCAB = 100


def _outputs(n: int, length: int = 30) -> list[list[int]]:
    return [[(i * 7 + j) % VOCAB for j in range(length)] for i in range(n)]


def test_budget_evicts_the_oldest_output():
    probe = SuffixCache(1 << 30, 8, VOCAB)
    outs = _outputs(6)
    for o in outs[:3]:
        probe.add(o)
    budget = probe.nbytes()                     # room for exactly the first three
    cache = SuffixCache(budget, 8, VOCAB)
    for o in outs:
        cache.add(o)
        assert cache.nbytes() <= budget
    assert 1 <= len(cache) < 6
    trie = cache.trie()
    # the newest output is there, the oldest gone
    assert trie.walk(outs[-1][:8]) is not None and trie.walk(outs[0][:8]) is None


def test_zero_budget_keeps_nothing_and_lone_tokens_are_not_kept():
    cache = SuffixCache(0, 8, VOCAB)
    cache.add([1, 2, 3])
    assert len(cache) == 0 and cache.trie() is None
    cache = SuffixCache(1 << 20, 8, VOCAB)
    cache.add([5])
    assert len(cache) == 0


def test_partitions_are_separate_and_keys_are_hashed():
    cache = SuffixCache(1 << 20, 8, VOCAB)
    cache.select("robot-a")
    cache.add([1, 2, 3, 4])
    cache.select("robot-b")
    assert cache.trie() is None                 # b sees nothing of a
    cache.add([9, 8, 7])
    assert cache.trie().walk([1, 2]) is None and cache.trie().walk([9, 8]) is not None
    cache.select("robot-a")
    assert cache.trie().walk([1, 2]) is not None and cache.trie().walk([9, 8]) is None
    cache.select(None)
    assert cache.trie() is None
    assert "robot-a" not in cache.tries and partition_of("robot-a") in cache.tries
    assert partition_of(None) == partition_of("") == ""


def test_persisted_outputs_come_back_after_a_restart(tmp_path, capsys):
    path = tmp_path / "log.jsonl.suffix.jsonl"
    cache = SuffixCache(1 << 20, 8, VOCAB, path)
    cache.select("robot-a")
    cache.add([1, 2, 3, 4])
    cache.select(None)
    cache.add([5, 6, 7])
    text = path.read_text()
    assert "robot-a" not in text                # the key never reaches the disk
    with open(path, "a") as f:                  # a torn last line (power cut) and a record of another model
        f.write(json.dumps({"key": "", "ids": [1, VOCAB + 5]}) + "\n" + '{"key": "", "ids": [1, 2')
    again = SuffixCache(1 << 20, 8, VOCAB, path)
    assert "skipped 2 line(s)" in capsys.readouterr().err
    assert len(again) == 2 and again.trie().walk([5, 6]) is not None
    again.select("robot-a")
    assert again.trie().walk([1, 2, 3]) is not None
    # the load compacted the file to the kept outputs
    assert [json.loads(line)["ids"] for line in path.read_text().splitlines()] == [[1, 2, 3, 4], [5, 6, 7]]


def test_persisted_file_is_bounded_by_the_budget(tmp_path):
    path = tmp_path / "s.jsonl"
    probe = SuffixCache(1 << 30, 8, VOCAB)
    for o in _outputs(2):
        probe.add(o)
    cache = SuffixCache(probe.nbytes(), 8, VOCAB, path)
    for o in _outputs(200):
        cache.add(o)
    lines = path.read_text().splitlines()
    assert len(lines) <= max(64, len(cache)) + len(cache) + 1
    assert len(SuffixCache(probe.nbytes(), 8, VOCAB, path)) == len(cache)


@pytest.mark.parametrize("kw,match", [
    (dict(max_bytes=-1), "suffix cache size -1"),
    (dict(max_bytes=1.5), "suffix cache size 1.5"),
    (dict(max_depth=1), "suffix_max_depth 1"),
    (dict(vocab_size=0), "vocab_size 0"),
])
def test_bad_settings_are_named(kw, match):
    args = dict(max_bytes=1 << 20, max_depth=8, vocab_size=VOCAB) | kw
    with pytest.raises(ConfigError, match=match):
        SuffixCache(**args)


def test_a_folder_in_place_of_the_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="not a file"):
        SuffixCache(1 << 20, 8, VOCAB, tmp_path)


def test_a_completion_is_kept_with_the_prompt_tail_before_it():
    from edgespec.drafters.suffix_cache import PROMPT_TAIL

    cache = SuffixCache(1 << 20, 16, VOCAB)
    prompt = list(range(20, 20 + PROMPT_TAIL + 5))
    cache.add_completion(prompt, [90, 91, 92])
    trie = cache.trie()
    assert trie.walk(prompt[-PROMPT_TAIL:] + [90, 91, 92]) is not None      # the header predicts the answer start
    assert trie.walk(prompt[-PROMPT_TAIL - 1:-PROMPT_TAIL]) is None           # older prompt tokens are not kept
    cache.add_completion(prompt, [])
    assert len(cache) == 1


def test_eviction_churn_does_not_leave_the_cache_bloated():
    outs = _outputs(300, length=40)
    cache = SuffixCache(60_000, 12, VOCAB)
    for o in outs:
        cache.add(o)
    kept = [ids.tolist() for _, ids in cache._lru.values()]
    fresh = SuffixCache(1 << 30, 12, VOCAB)
    for o in kept:
        fresh.add(o)
    assert len(kept) >= 2 and cache.nbytes() <= 60_000
    assert cache.nbytes() < 1.5 * fresh.nbytes()     # freed slots were given back by a rebuild
