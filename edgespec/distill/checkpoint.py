"""What ``edgespec distill`` writes: the published drafter folder, and the training state a killed run resumes.

The output folder is a published-layout drafter (``config.json`` + ``model.safetensors`` in bf16 +
``distill.json``: how it was made) after every save. ``train_state.pt`` beside it holds the fp32 weights, the
optimizer state and a :class:`RunState`: the step, where in which epoch's order the run stood, the planned step
count, and every figure measured so far (the loss curve and the held-out estimates), so a resumed run continues
the same curve from the last checkpoint. Files are written to a temporary name and renamed: a kill leaves the
previous checkpoint whole.
"""

from __future__ import annotations

import json
import math
import os
import pickle
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from edgespec.errors import CheckpointError

STATE_FILE = "train_state.pt"


@dataclass
class RunState:
    """Where a training run stands (restored on resume with the weights and optimizer state)."""

    step: int = 0
    epoch: int = 0                  # epochs started; the current one shuffles with sampler epoch ``epoch - 1``
    consumed: int = 0               # sequences of the current epoch's order (per rank) already trained on
    total_steps: int | None = None  # the step count a time budget fitted (kept on resume: the same schedule)
    first_al: float | None = None   # held-out AL before the first step
    curve: list[list[float]] = field(default_factory=list)      # [step, loss, top1] per step, mean over ranks
    held_out: list[list[float]] = field(default_factory=list)   # [step, epoch, AL] per held-out estimate
    best_al: float = -math.inf

    @property
    def last_loss(self) -> float:
        return self.curve[-1][1] if self.curve else float("nan")

    @property
    def last_al(self) -> float | None:
        return self.held_out[-1][2] if self.held_out else self.first_al


def save_drafter(folder: Path, drafter: torch.nn.Module, config: dict[str, Any], info: dict[str, Any],
                 draft_vocab: dict[str, Any] | None = None) -> None:
    """Write the published layout (bf16, no prefix): weights, then ``config.json`` and ``distill.json``, and the
    token ranking of the draft vocabulary (``draft_vocab.json``, :mod:`edgespec.drafters.draft_vocab`) when given."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in drafter.state_dict().items()}
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "distill.json").write_text(json.dumps(info, indent=2))
    if draft_vocab is not None:
        from edgespec.drafters.draft_vocab import write_draft_vocab
        write_draft_vocab(folder, draft_vocab)


def save_state(folder: Path, drafter: torch.nn.Module, optim: torch.optim.Optimizer, state: RunState) -> None:
    """Write ``train_state.pt`` atomically."""
    tmp = folder / (STATE_FILE + ".tmp")
    torch.save({"drafter": drafter.state_dict(), "optim": optim.state_dict(), "run": asdict(state)}, tmp)
    os.replace(tmp, folder / STATE_FILE)


def load_state(folder: Path, drafter: torch.nn.Module, optim: torch.optim.Optimizer, device: torch.device
               ) -> RunState:
    """Restore the weights and optimizer state a killed run saved and return its :class:`RunState`; a fresh
    :class:`RunState` when the folder holds none. A state of another drafter shape is an error naming the file."""
    path = folder / STATE_FILE
    if not path.exists():
        return RunState()
    try:
        saved = torch.load(path, map_location=device, weights_only=True)
        drafter.load_state_dict(saved["drafter"])
        optim.load_state_dict(saved["optim"])
    except (RuntimeError, KeyError, ValueError, EOFError, OSError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"cannot resume from {path} ({e}): it was written for another drafter or run; "
                              f"use another --out or delete it") from None
    if "run" in saved:
        return RunState(**saved["run"])
    # A state written before the run's position was kept: the step and start AL only.
    return RunState(step=int(saved["step"]), first_al=saved.get("first_al"))
