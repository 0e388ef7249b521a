"""The results file: one JSON line appended (and flushed to disk) after each measurement, read back on resume.

Two kinds of lines: ``measurement`` (one candidate on one prompt) and ``reference`` (plain greedy output of one
prompt for one KV format, what speculative output is compared with). Every line carries the *context*
fingerprint of the run that wrote it (model, device, dtype, tokens per run, repeats, the base settings the
search does not tune): a resumed run with another context ignores those lines instead of mixing figures.
A line cut short by a crash or Ctrl-C mid-write is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from edgespec.errors import ConfigError


def context_id(context: Mapping[str, Any]) -> str:
    return hashlib.sha1(json.dumps(context, sort_keys=True, default=str).encode()).hexdigest()[:12]


def measurement_key(candidate_key: str, prompt_id: str, prompt_sha: str) -> str:
    return f"m|{candidate_key}|{prompt_id}|{prompt_sha}"


def reference_key(kv_dtype: str, cuda_graphs: bool, prefill_chunk: int, prompt_id: str, prompt_sha: str) -> str:
    # Invariant 1 of the design: speculative output equals plain output computed with the same KV format and
    # kernels; the prefill chunking changes the order of the prompt's reductions, so it is part of "kernels".
    return f"r|kv={kv_dtype}|graphs={cuda_graphs}|chunk={prefill_chunk}|{prompt_id}|{prompt_sha}"


class ResultStore:
    """Append-only JSONL results of one output folder, indexed by key for the current context."""

    def __init__(self, path: Path, context: Mapping[str, Any]) -> None:
        self.path = path
        self.context = dict(context)
        self.context_id = context_id(context)
        self._by_key: dict[str, dict[str, Any]] = {}
        self.loaded = 0          # lines of this context read back
        self.ignored = 0         # lines of another context, or unreadable

    def load(self) -> None:
        """Read the existing file (if any) so done measurements are not repeated."""
        if not self.path.exists():
            return
        try:
            lines = self.path.read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"cannot read results file {self.path}: {e}") from None
        for line in lines:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                self.ignored += 1       # torn last line of an interrupted write
                continue
            if not isinstance(rec, dict) or rec.get("context") != self.context_id or "key" not in rec:
                self.ignored += 1
                continue
            self._by_key[rec["key"]] = rec
            self.loaded += 1

    def get(self, key: str) -> dict[str, Any] | None:
        return self._by_key.get(key)

    def add(self, record: dict[str, Any]) -> dict[str, Any]:
        """Append ``record`` (it gains the context id) and make it durable before returning."""
        rec = {**record, "context": self.context_id}
        line = json.dumps(rec, default=str)
        with self.path.open("a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())   # a power cut or kill right after must not lose a measurement that took minutes
        self._by_key[rec["key"]] = rec
        return rec

    def records(self, kind: str | None = None) -> Iterator[dict[str, Any]]:
        for rec in self._by_key.values():
            if kind is None or rec.get("type") == kind:
                yield rec
