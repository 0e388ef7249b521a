"""The arch hooks' kernel choice for packed weights, on CPU: no Triton product is chosen off CUDA, the torch
reference serves, and a kernel stored on a weight is what its product calls."""

from __future__ import annotations

import torch
from quant_layouts import write_quantized

from edgespec.arch.detect import select_hooks
from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.loading.checkpoint import load_target
from edgespec.weights import PackedWeight


def test_cpu_hooks_keep_the_reference_and_a_stored_kernel_is_called(tmp_path):
    dense = write_random_checkpoint(tmp_path / "dense", tiny_config("llama"), seed=3)
    folder, _ = write_quantized(dense, tmp_path / "q", tmp_path / "ref", "nvfp4", seed=1)
    model = load_target(folder, max_positions=64)
    packed = [m for m in model.modules() if isinstance(m, PackedWeight)]
    assert packed
    for arch in ("base", "rtx", "thor"):
        assert select_hooks(arch, torch.device("cpu")).choose_weight_kernels(model) == 0
        assert all(p.kernel is None for p in packed)
    calls = []

    def spy(weight, x, bias):
        calls.append(weight)
        return weight.matmul_ref(x, bias)

    packed[0].kernel = spy
    x = torch.randn(2, packed[0].in_features)
    torch.testing.assert_close(packed[0].matmul(x), packed[0].matmul_ref(x))
    assert calls == [packed[0]]
