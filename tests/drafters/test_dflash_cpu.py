"""The DFlash draft step on the CPU: the block forward as one compiled call (edgespec.models.cpu_stack) against the
drafter's per-layer torch path, with full and sliding (causal, windowed) layers and a partly filled window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgespec.bench import random_drafter
from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.drafters.dflash import load_dflash_checkpoint
from edgespec.kernels.cpu import gguf_native
from edgespec.loading.checkpoint import load_target
from edgespec.models import cpu_stack

pytestmark = pytest.mark.skipif(gguf_native.library() is None, reason="the compiled kernels cannot be built here")


@pytest.fixture()
def proposer(tmp_path: Path):
    target_dir = write_random_checkpoint(tmp_path / "target", tiny_config("llama"))
    target = load_target(target_dir)
    folder = random_drafter.write_dflash_drafter(tmp_path / "drafter", target_dir, num_layers=3, block_size=8,
                                                 sliding_layers=2, sliding_window=6)
    return load_dflash_checkpoint(folder, target, window_size=16)


def _fill_window(proposer, rows: int) -> None:
    taps = torch.randn(rows, len(proposer.taps), proposer.target.config.hidden_size)
    with torch.inference_mode():
        proposer._append(taps, 0)
    proposer.history = list(range(rows + 1))


@pytest.mark.parametrize("rows", [3, 16, 21])     # window partly filled, full, wrapped around
def test_block_forward_in_one_call_matches_the_torch_layers(proposer, rows: int) -> None:
    drafter = proposer.drafter
    _fill_window(proposer, rows)
    with torch.inference_mode():
        cpu_stack._plans.pop(drafter, None)
        fast = proposer.block_hidden(7)
        assert cpu_stack._plans[drafter] is not None, "the drafter did not run on the compiled stack"
        cpu_stack._plans[drafter] = None                  # the per-layer torch path
        ref = proposer.block_hidden(7)
    cpu_stack._plans.pop(drafter, None)
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)


def test_proposals_match_the_torch_layers(proposer) -> None:
    _fill_window(proposer, 16)
    with torch.inference_mode():
        cpu_stack._plans.pop(proposer.drafter, None)
        fast = proposer.propose(proposer.history[-1], 7).tokens.clone()
        cpu_stack._plans[proposer.drafter] = None
        ref = proposer.propose(proposer.history[-1], 7).tokens
    cpu_stack._plans.pop(proposer.drafter, None)
    assert torch.equal(fast, ref)
