"""Sampled continuations draw on the logits' device, from a generator seeded by the caller's (reproducible)."""

from __future__ import annotations

import pytest
import torch

from edgespec.distill.batched import _device_generator


def test_generator_already_on_the_device_is_used_as_is() -> None:
    g = torch.Generator().manual_seed(1)
    assert _device_generator(g, torch.device("cpu")) is g
    assert _device_generator(None, torch.device("cpu")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_generator_seeds_a_device_generator_reproducibly() -> None:
    dev = torch.device("cuda")
    draws = []
    for _ in range(2):
        g = _device_generator(torch.Generator().manual_seed(7), dev)
        assert g.device.type == "cuda"
        draws.append(torch.multinomial(torch.full((4, 100), 0.01, device=dev), 1, generator=g))
    assert torch.equal(draws[0], draws[1])
