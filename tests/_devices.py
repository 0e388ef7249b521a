"""The device parameter of tests that run on CPU and, where there is a GPU, again on CUDA."""

from __future__ import annotations

import pytest
import torch

# A "cuda" case marked gpu, skipped cleanly without a CUDA device.
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs CUDA")])
DEVICES = ["cpu", CUDA]
