"""A DFlash window smaller than the drafter's block is refused when the drafter is built, by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from _plans import proposer_from

from edgespec.bench.random_drafter import write_dflash_drafter
from edgespec.config import Settings
from edgespec.drafters.dflash import WindowTooSmallError, load_dflash_checkpoint
from edgespec.errors import ConfigError
from edgespec.loading.checkpoint import load_target


@pytest.fixture(scope="module")
def drafter_b6(tiny_checkpoints, tmp_path_factory) -> Path:
    return write_dflash_drafter(tmp_path_factory.mktemp("d") / "b6", tiny_checkpoints["qwen3"], num_layers=1,
                                block_size=6, seed=1)


@pytest.mark.parametrize("window", [1, 3, 5])
def test_window_below_block_size_is_refused_at_load(tiny_checkpoints, drafter_b6, window) -> None:
    target = load_target(tiny_checkpoints["qwen3"], max_positions=128)
    with pytest.raises(WindowTooSmallError, match=f"window_size {window} is below the block_size 6"):
        load_dflash_checkpoint(drafter_b6, target, window_size=window)


def test_window_refusal_through_settings_is_a_config_error(tiny_checkpoints, drafter_b6) -> None:
    target = load_target(tiny_checkpoints["qwen3"], max_positions=128)
    with pytest.raises(ConfigError, match="--window-size 6 or more"):
        proposer_from(Settings(drafter="dflash", drafter_path=str(drafter_b6), window_size=4), target)
    prop = proposer_from(Settings(drafter="dflash", drafter_path=str(drafter_b6), window_size=6, lookup_min_match=0),
                          target)
    assert prop.window_size == 6          # equal to the block size is enough
