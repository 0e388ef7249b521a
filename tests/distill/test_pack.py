"""Packed training batches (pack_blocks): several sequences' blocks in one forward give the per-sequence logits."""

from __future__ import annotations

import pytest
import torch

from edgespec.bench import random_drafter as make_drafter
from edgespec.distill.objective import BlockObjective, make_blocks, pack_blocks
from edgespec.loading.checkpoint import load_target


@pytest.mark.parametrize("window", [None, 5])
def test_packed_forward_equals_one_sequence_at_a_time(tiny_checkpoints, tmp_path, window) -> None:
    from edgespec.distill.dflash_kind import load_drafter

    target = load_target(tiny_checkpoints["qwen3"], max_positions=256)
    # a sliding layer and a full one: both mask kinds see positions per sequence
    folder = make_drafter.write_dflash_drafter(tmp_path / "d", tiny_checkpoints["qwen3"], num_layers=2,
                                               block_size=4, sliding_layers=1, sliding_window=6, seed=5)
    drafter = load_drafter(str(folder), target)
    obj = BlockObjective(drafter, target.model.embed_tokens.weight, target.lm_head_weight, 128, window=window)
    gen = torch.Generator().manual_seed(3)
    batches = []
    for length, prompt_len, anchors in ((20, 6, [6, 9, 15]), (31, 10, [10, 11, 25, 29]), (14, 4, [8])):
        tokens = torch.randint(0, target.config.vocab_size, (length,), generator=gen)
        taps = torch.randn(length, len(drafter.cfg.target_layer_ids), target.config.hidden_size, generator=gen)
        batches.append(make_blocks(tokens, prompt_len, taps, torch.tensor(anchors), 4, drafter.cfg.mask_token_id))
    with torch.no_grad():
        want = torch.cat([obj(b) for b in batches])
        packed = pack_blocks(batches)
        got = obj(packed)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(packed.labels, torch.cat([b.labels for b in batches]))
