"""Drafter blending (edgespec.distill.blend): every tensor the weighted mean of the two parents, the result a
drafter the runtime loads; drafters of another shape and bad alphas refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from edgespec.bench import random_drafter as make_drafter
from edgespec.distill.blend import blend
from edgespec.drafters.dflash import load_dflash_checkpoint
from edgespec.errors import CheckpointError, ConfigError
from edgespec.loading.checkpoint import load_target


@pytest.fixture(scope="module")
def parents(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    shape = {"num_layers": 1, "block_size": 4, "target_layer_ids": [0, 2]}
    a = make_drafter.write_dflash_drafter(root / "a", tiny_checkpoints["qwen3"], seed=1, **shape)
    b = make_drafter.write_dflash_drafter(root / "b", tiny_checkpoints["qwen3"], seed=2, **shape)
    return a, b


@pytest.mark.parametrize("alpha", [0.0, 0.25, 1.0])
def test_every_tensor_is_the_weighted_mean(parents, tmp_path, alpha):
    a, b = parents
    out = blend(a, b, alpha, tmp_path / "mix")
    wa, wb, got = (load_file(str(p / "model.safetensors")) for p in (a, b, out))
    assert got.keys() == wa.keys()
    for k in wa:
        want = ((1 - alpha) * wa[k].float() + alpha * wb[k].float()).bfloat16()
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], want), k
    assert json.loads((out / "distill.json").read_text())["blend"]["alpha"] == alpha


def test_the_blend_loads_as_a_drafter(parents, tiny_checkpoints, tmp_path):
    out = blend(*parents, 0.5, tmp_path / "mix")
    target = load_target(tiny_checkpoints["qwen3"], max_positions=64)
    assert load_dflash_checkpoint(str(out), target) is not None


def test_bad_inputs_are_named(parents, tiny_checkpoints, tmp_path):
    a, b = parents
    with pytest.raises(ConfigError, match="alpha 1.5 must be within 0..1"):
        blend(a, b, 1.5, tmp_path / "x")
    with pytest.raises(CheckpointError, match="needs config.json and model.safetensors"):
        blend(a, tmp_path, 0.5, tmp_path / "x")
    other = make_drafter.write_dflash_drafter(tmp_path / "c", tiny_checkpoints["qwen3"], seed=3, num_layers=1,
                                              block_size=6, target_layer_ids=[0, 2])
    with pytest.raises(ConfigError, match=r"differ in config.json \(block_size"):
        blend(a, other, 0.5, tmp_path / "x")
