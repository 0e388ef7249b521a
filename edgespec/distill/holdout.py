"""Held-out sets for ``edgespec distill`` that measure generality, not memory of the training prompts.

A random split of templated prompts holds out prompts whose siblings (same template, other objects) are trained
on: the held-out AL then says how well the drafter learnt its templates, which is what a user never sends. Two
guards:

* ``--holdout-by template`` or ``source``: whole groups are held out. A prompt's template is its entry's
  ``template`` label, else its first :data:`TEMPLATE_WORDS` words (prompts written from one template open alike);
  its source is its entry's ``source`` label, or for ``--from-log`` the log file it came from. About one group in
  ``--holdout-every`` is held out (at least one, never all), chosen by a hash of its name.
* ``--held-out FILE``: the user's own held-out set (a prompt file the target answers, or a request log), never
  trained on: a training sequence with the same prompt is dropped.

:func:`split` returns the train and held-out sequences and a :class:`HoldoutReport` for the drafter folder.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgespec.distill.data import Sequence_
from edgespec.errors import ConfigError

TEMPLATE_WORDS = 4
SPLITS = ("prompt", "template", "source")


@dataclass
class HoldoutReport:
    """How the held-out set was made, and (after training) the drafter's AL on it; written as held_out.json."""

    split: str                                  # prompt | template | source | file
    held_out_sequences: int
    train_sequences: int
    held_out_groups: list[str] = field(default_factory=list)
    groups: int = 0
    dropped_overlap: int = 0                    # training sequences dropped: their prompt is in the held-out file
    held_out_al: float | None = None
    held_out_al_start: float | None = None

    def write(self, folder: Path) -> Path:
        path = Path(folder) / "held_out.json"
        path.write_text(json.dumps(asdict(self), indent=2))
        return path

    def line(self) -> str:
        groups = f" ({len(self.held_out_groups)} of {self.groups} {self.split}s held out: " \
                 f"{', '.join(self.held_out_groups[:4])}{' ...' if len(self.held_out_groups) > 4 else ''})" \
            if self.held_out_groups else ""
        al = "n/a" if self.held_out_al is None else f"{self.held_out_al:.2f}"
        start = "" if self.held_out_al_start is None else f" (at start {self.held_out_al_start:.2f})"
        return (f"held-out AL {al}{start} over {self.held_out_sequences} sequences, split by {self.split}"
                f"{groups}; trained on {self.train_sequences}")


def template_of(text: str, label: str | None = None) -> str:
    """A prompt's template: its label, else its first :data:`TEMPLATE_WORDS` words, lowercased.

    >>> template_of("Output a JSON action list for a robot arm to move the red cup")
    'output a json action'
    """
    if label:
        return label
    return " ".join(text.lower().split()[:TEMPLATE_WORDS])


def held_groups(groups: Sequence[str], every: int) -> list[str]:
    """The groups to hold out: ``ceil(n / every)`` of the ``n`` distinct groups (at least 1, at most ``n - 1``),
    those with the smallest hash of their name (stable across runs and machines)."""
    names = sorted(set(groups))
    if len(names) < 2:
        raise ConfigError(f"a held-out split by group needs at least 2 groups; the data has {len(names)} "
                          f"({', '.join(names) or 'none'}): label the prompts (template:/source:), use "
                          f"--holdout-by prompt, or pass --held-out FILE")
    if every < 2:
        raise ConfigError(f"--holdout-every {every}: hold out one group in N needs N >= 2")
    n = min(len(names) - 1, max(1, math.ceil(len(names) / every)))
    return sorted(names, key=lambda g: hashlib.sha256(g.encode()).digest())[:n]


def prompt_key(seq: Sequence_) -> bytes:
    """The prompt tokens of a sequence, as a dict key."""
    return seq.tokens[:seq.prompt_len].numpy().astype("int64").tobytes()


def split(seqs: Sequence[Sequence_], by: str, every: int, group_of: Mapping[bytes, str] | None = None,
          held_file: Sequence[Sequence_] | None = None) -> tuple[list[Sequence_], list[Sequence_], HoldoutReport]:
    """``(train, held_out, report)``. ``group_of`` maps a sequence's :func:`prompt_key` to its template or
    source (``by`` template/source); ``held_file`` is the user's held-out set (it wins over ``by``)."""
    if held_file is not None:
        if not held_file:
            raise ConfigError("--held-out holds no sequence with 2 or more output tokens")
        held_keys = {prompt_key(s) for s in held_file}
        train = [s for s in seqs if prompt_key(s) not in held_keys]
        if not train:
            raise ConfigError("every training prompt is also in --held-out: nothing left to train on")
        return train, list(held_file), HoldoutReport("file", len(held_file), len(train),
                                                     dropped_overlap=len(seqs) - len(train))
    if by not in SPLITS:
        raise ConfigError(f"--holdout-by {by!r} is not one of {', '.join(SPLITS)}")
    if by == "prompt":
        from edgespec.distill.train import is_held_out

        held = [s for s in seqs if is_held_out(s, every)]
        train = [s for s in seqs if not is_held_out(s, every)] or list(seqs)
        return train, held, HoldoutReport("prompt", len(held), len(train))
    if group_of is None:
        raise ConfigError(f"--holdout-by {by} needs the {by} of every prompt")
    missing = [s for s in seqs if prompt_key(s) not in group_of]
    if missing:
        raise ConfigError(f"--holdout-by {by}: {len(missing)} sequence(s) of the data folder have a prompt the "
                          f"prompt set does not hold (data from another prompt set?)")
    groups = [group_of[prompt_key(s)] for s in seqs]
    out = set(held_groups(groups, every))
    held = [s for s, g in zip(seqs, groups, strict=True) if g in out]
    train = [s for s, g in zip(seqs, groups, strict=True) if g not in out]
    return train, held, HoldoutReport(by, len(held), len(train), sorted(out), len(set(groups)))
