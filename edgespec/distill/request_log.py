"""Opt-in request log: prompts and outputs as JSONL, size-bounded and rotated, for on-device drafter adaptation.

A robot repeats the same kinds of requests all day; ``edgespec distill --from-log FILE --init DRAFTER`` fine-tunes
the drafter on exactly that traffic. Off by default (``request_log`` unset): nothing is written. When set, every
completed request appends one JSON object per line::

    {"time": 1764090000.1, "prompt_ids": [...], "output_ids": [...], "text": "...", "finish_reason": "stop",
     "drafter": "dflash", "acceptance_length": 3.2}

The file never grows past ``request_log_max_mb``: before a write that would cross it, ``log.jsonl`` becomes
``log.jsonl.1`` (``.1`` -> ``.2`` ...), keeping ``request_log_keep`` rotated files. Token ids are logged so
training needs no re-tokenisation; ``text`` keeps the file readable.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from edgespec.errors import ConfigError


class RequestLog:
    """Appends request records to a JSONL file, rotating it at ``max_bytes`` (``keep`` old files)."""

    def __init__(self, path: str | Path, max_bytes: int = 64 << 20, keep: int = 3) -> None:
        if max_bytes <= 0 or keep < 0:
            raise ConfigError(f"request log {path}: max size must be positive and keep >= 0")
        self.path = Path(path).expanduser()
        self.max_bytes = max_bytes
        self.keep = keep
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"request log {self.path}: cannot create its folder: {e}") from None

    def _rotate(self) -> None:
        if self.keep == 0:
            self.path.unlink(missing_ok=True)
            return
        for i in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (a JSON object on one line)."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        data = line.encode()
        with self._lock:
            size = self.path.stat().st_size if self.path.exists() else 0
            if size and size + len(data) > self.max_bytes:
                self._rotate()
            with open(self.path, "ab") as f:
                f.write(data)

    def log_completion(self, prompt_ids: Sequence[int], output_ids: Sequence[int], text: str, finish_reason: str,
                       drafter: str, acceptance_length: float | None) -> None:
        self.write({"time": round(time.time(), 3), "prompt_ids": list(prompt_ids), "output_ids": list(output_ids),
                    "text": text, "finish_reason": finish_reason, "drafter": drafter,
                    "acceptance_length": acceptance_length})


def read_log(path: str | Path) -> Iterator[tuple[list[int], list[int]]]:
    """``(prompt_ids, output_ids)`` of every record; a malformed line is an error naming file and line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"request log not found: {p}")
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                prompt, output = rec["prompt_ids"], rec["output_ids"]
                if not (isinstance(prompt, list) and isinstance(output, list)
                        and all(isinstance(t, int) for t in prompt + output)):
                    raise TypeError("prompt_ids and output_ids must be lists of token ids")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"request log {p} line {n} is not a request record: {e}") from None
            yield prompt, output


def log_data(paths: str | Path | Sequence[str | Path], folder: str | Path, target, model_dir: str | Path,
             taps: Sequence[int]) -> Path:
    """Turn logged requests into a distillation data folder: the target's taps over prompt + logged output
    (teacher forcing through the serving model), one sequence per record with an output of 2+ tokens."""
    import hashlib

    from edgespec.distill.batched import Generated
    from edgespec.distill.data import DataRecipe, capture_taps, target_fingerprint, write_sequences

    if isinstance(paths, (str, Path)):
        paths = [paths]
    items, digest = [], hashlib.sha256()
    vocab = target.config.vocab_size
    for path in paths:
        for prompt, output in read_log(path):
            if len(output) < 2:
                continue
            tokens = prompt + output
            if max(tokens) >= vocab or min(tokens) < 0:
                raise ConfigError(f"request log {path}: a token id is outside the target's vocabulary of {vocab} "
                                  f"(a log from another model?)")
            digest.update(json.dumps(tokens).encode())
            items.append(Generated(tokens=tokens, prompt_len=len(prompt), taps=capture_taps(target, tokens, taps)))
    if not items:
        raise ConfigError(f"request log(s) {', '.join(map(str, paths))} hold no request with 2+ output tokens")
    recipe = DataRecipe(target=target_fingerprint(model_dir), taps=list(taps), prompts_sha=digest.hexdigest()[:16],
                        max_new_tokens=0, samples_per_prompt=0, temperature=0.0, seed=0, batch=1,
                        extra={"from_log": [str(p) for p in paths]})
    return write_sequences(folder, items, recipe)
