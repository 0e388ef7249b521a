"""The deployment's recent outputs, as suffix tries the suffix drafter matches against: bounded, LRU, per client.

A robot controller sends the same kinds of requests all day and its answers repeat across requests (the same JSON
keys, tool calls and plan shapes with other objects). :class:`SuffixCache` keeps the outputs of recent requests in
one :class:`~edgespec.drafters.suffix_tree.SuffixTrie` per client partition, so a request drafts from what this
deployment answered before. Partitions keep clients apart: a draft from another client's output would be verified
(the output cannot change) but its acceptance, visible in timing and telemetry, would leak what that client asked.
Keys are stored only as hashes.

The budget (``max_bytes``) covers every partition's trie and stored tokens; past it the oldest output, whichever
partition holds it, is removed. With ``path`` the outputs are also appended to a JSONL file (one
``{"key": hash, "ids": [...]}`` per line) and read back at start, so a restart keeps what the robot taught it; the
file is rewritten with only the kept outputs when it has grown to twice their number.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edgespec.drafters.suffix_tree import SuffixTrie
from edgespec.errors import ConfigError

# Prompt tokens kept before each output (add_completion): enough for the assistant turn's header, which is what
# precedes every answer; an 8-token tail raised steady-state AL from 3.18 to 3.29 in an offline replay of 24 demo
# answers (a robot_stream seed the bench does not use).
PROMPT_TAIL = 8
# One LRU entry beyond the OrderedDict's own table: its (partition, ids) tuple and its int key.
_ENTRY_BYTES = sys.getsizeof(("", None)) + sys.getsizeof(1 << 40)


def partition_of(client_key: str | None) -> str:
    """The partition name of a client key: '' for none, else a hash (the key itself is never kept)."""
    if client_key is None or client_key == "":
        return ""
    return hashlib.sha256(client_key.encode()).hexdigest()[:24]


class SuffixCache:
    """Recent outputs per client partition, each partition a suffix trie, within ``max_bytes`` over all of them."""

    def __init__(self, max_bytes: int, max_depth: int, vocab_size: int, path: str | Path | None = None) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ConfigError(f"suffix cache size {max_bytes!r} must be a whole number of bytes >= 0 (0 = off)")
        if max_depth < 2:
            raise ConfigError(f"suffix_max_depth {max_depth} must be >= 2")
        if vocab_size < 1:
            raise ConfigError(f"suffix cache vocab_size {vocab_size} must be >= 1")
        self.max_bytes, self.max_depth, self.vocab_size = max_bytes, max_depth, vocab_size
        self.tries: dict[str, SuffixTrie] = {}
        self._lru: OrderedDict[int, tuple[str, np.ndarray]] = OrderedDict()   # oldest first
        self._next_id = 0
        self._token_bytes = 0
        self.partition = ""
        self.path = None if path is None else Path(path).expanduser()
        self._appended = 0
        if self.path is not None:
            self._load()

    # -- partitions ---------------------------------------------------------------------------------------------
    def select(self, client_key: str | None) -> None:
        """Use the partition of ``client_key`` for the next request's drafts and :meth:`add`."""
        self.partition = partition_of(client_key)

    def trie(self) -> SuffixTrie | None:
        """The selected partition's trie (None while it holds nothing)."""
        return self.tries.get(self.partition)

    # -- contents -----------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._lru)

    def nbytes(self) -> int:
        """Memory held by every partition's trie, the stored outputs and the LRU's entries."""
        return (sum(t.nbytes() for t in self.tries.values()) + self._token_bytes
                + sys.getsizeof(self._lru) + len(self._lru) * _ENTRY_BYTES)

    def add_completion(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Remember a request's output with the last :data:`PROMPT_TAIL` prompt tokens before it (the chat
        template's assistant header), so a later request's context at the start of its answer matches too."""
        if output_ids:
            self.add(list(prompt_ids[-PROMPT_TAIL:]) + list(output_ids))

    def add(self, tokens: Sequence[int]) -> None:
        """Remember one output in the selected partition (then evict the oldest outputs while over budget)."""
        self._insert(self.partition, tokens)
        if self.path is not None and len(tokens) >= 2 and self.max_bytes > 0:
            self._append(self.partition, tokens)

    def _insert(self, partition: str, tokens: Sequence[int]) -> None:
        if len(tokens) < 2 or self.max_bytes == 0:   # a lone token predicts nothing
            return
        ids = np.array(tokens, dtype=np.int32)      # a copy: it owns its data, so getsizeof counts it
        trie = self.tries.get(partition)
        if trie is None:
            trie = self.tries[partition] = SuffixTrie(self.max_depth)
        trie.add(ids.tolist())
        self._lru[self._next_id] = (partition, ids)
        self._next_id += 1
        self._token_bytes += sys.getsizeof(ids)
        while self._lru and self.nbytes() > self.max_bytes:
            evicted = self._evict_oldest()
            trie = self.tries.get(evicted)
            if trie is not None and trie.free_slots and self.nbytes() > self.max_bytes:
                self._rebuild(evicted)      # the freed slots' capacity may be all that is over the budget

    def _evict_oldest(self) -> str:
        """Remove the oldest output; returns its partition."""
        _, (partition, ids) = self._lru.popitem(last=False)
        trie = self.tries[partition]
        trie.remove(ids.tolist())
        self._token_bytes -= sys.getsizeof(ids)
        if trie.counts[0] == 0:
            del self.tries[partition]
        elif trie.free_slots > trie.nodes:
            self._rebuild(partition)
        return partition

    def _rebuild(self, partition: str) -> None:
        """A partition's trie anew from its kept outputs: freed node slots keep their list capacity, which only a
        rebuild gives back (cost: one add of each output, amortised over the evictions that freed the slots)."""
        fresh = SuffixTrie(self.max_depth)
        for part, kept in self._lru.values():
            if part == partition:
                fresh.add(kept.tolist())
        self.tries[partition] = fresh

    # -- persistence --------------------------------------------------------------------------------------------
    def _load(self) -> None:
        """Read the file back (oldest first); lines that are not records of this vocabulary are skipped, with one
        warning naming the file: a cache is an optimisation, a torn last line after a power cut must not stop
        the robot's server."""
        if not self.path.exists():
            return
        if not self.path.is_file():
            raise ConfigError(f"suffix cache {self.path} exists but is not a file")
        bad: list[int] = []
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    key, ids = rec["key"], rec["ids"]
                    if not (isinstance(key, str) and isinstance(ids, list)
                            and all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids)):
                        raise ValueError
                except (ValueError, KeyError, TypeError):
                    bad.append(n)
                    continue
                self._insert(key, ids)
        if bad:
            print(f"edgespec: suffix cache {self.path}: skipped {len(bad)} line(s) that are not outputs of this "
                  f"model (first: line {bad[0]})", file=sys.stderr)
        self.compact()

    def _append(self, partition: str, tokens: Sequence[int]) -> None:
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"key": partition, "ids": [int(t) for t in tokens]}) + "\n")
            self._appended += 1
            if self._appended > max(64, len(self._lru)):
                self.compact()
        except OSError as e:     # a full disk must not fail the request the robot is waiting for
            print(f"edgespec: suffix cache {self.path} not written: {e}", file=sys.stderr)

    def compact(self) -> None:
        """Rewrite the file with exactly the outputs kept now (atomically: a crash leaves the old or the new)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for partition, ids in self._lru.values():
                f.write(json.dumps({"key": partition, "ids": ids.tolist()}) + "\n")
        os.replace(tmp, self.path)
        self._appended = 0
