"""The GDN state bank: every layer's state and slots in stacked tensors, copied for all layers at once."""

from __future__ import annotations

import pytest
import torch


def test_model_cache_needs_its_state_bank():
    """GDN layers without the bank their copies go through would make rollback a silent no-op: refused."""
    from edgespec.cache.model_cache import ModelCache
    from edgespec.cache.state import GDNStateBank

    bank = GDNStateBank(2, 8, 4, 2, 4, 4, torch.float32, "cpu", checkpoint_slots=3)
    with pytest.raises(ValueError, match="GDNStateBank"):
        ModelCache(bank.layers, 16)
    cache = ModelCache(bank.layers, 16, bank)
    assert cache.max_checkpoint_rows == 2
    bank.layers[1].recurrent.fill_(2.0)
    cache.snapshot()
    bank.layers[1].recurrent.zero_()
    cache.restore_snapshot()
    assert torch.all(bank.layers[1].recurrent == 2.0) and torch.all(bank.recurrent_slots[1, 0] == 2.0)
    cache.reset()
    assert torch.all(bank.recurrent == 0) and torch.all(bank.conv == 0)
