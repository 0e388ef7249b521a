"""The CPU KV cache carved from one lazily zeroed block, and loaders that skip the throw-away random init."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgespec.cache.kv import KVCache, lazy_zeros
from edgespec.models.meta_init import meta_modules


def test_lazy_zeros_are_zero_writable_and_typed() -> None:
    block = lazy_zeros(3 * 5, torch.bfloat16).view(3, 5)
    assert block.dtype == torch.bfloat16 and block.shape == (3, 5)
    assert torch.count_nonzero(block) == 0
    block[1, 2] = 7
    assert block[1, 2].item() == 7 and torch.count_nonzero(block) == 1


def test_kv_cache_takes_given_storage_and_refuses_a_wrong_shape() -> None:
    k, v = lazy_zeros(2 * 8 * 2 * 4, torch.float32).view(2, 8, 2, 4)
    cache = KVCache(8, 2, 4, torch.float32, "cpu", storage=(k, v))
    assert cache.k.data_ptr() == k.data_ptr() and cache.v.data_ptr() == v.data_ptr()
    with pytest.raises(ValueError, match="KV storage must be two"):
        KVCache(8, 2, 5, torch.float32, "cpu", storage=(k, v))
    with pytest.raises(ValueError, match="no FP8"):
        KVCache(8, 2, 4, torch.float32, "cpu", fp8=True, storage=(k, v))


def test_meta_modules_skip_init_and_restore_the_initialisers() -> None:
    before = nn.init.normal_
    with meta_modules():
        layer = nn.Linear(4, 3)
        assert nn.init.normal_ is not before
    assert layer.weight.is_meta
    assert nn.init.normal_ is before
    real = nn.Linear(4, 3)                       # initialisers work again outside the block
    assert torch.count_nonzero(real.weight) > 0
