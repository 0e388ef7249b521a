"""The arch hook sets own their stages (``edgespec.arch``): what ``ThorHooks`` and ``RtxHooks`` override, checked on
the CPU with the reference kernels swapped in for the GPU products.

* products (``packed_kernel``): chosen by compute capability without a device -- Thor's NVFP4/MXFP4 on the
  block-scaled MMA, RTX's bf16-staged products (NVFP4 block-scaled on an RTX 50), base the portable ones;
* Thor's block-scaled verify: a tiny model whose NVFP4/MXFP4 layers run the block-scaled product's torch twin
  (``block_scaled_matmul_ref``: the residual-series activations included) stays lossless: speculative == plain;
* Thor's prefill: chunks sized to the memory free, the same output as the portable prefill in those chunks;
* rollback: the session's accept stage goes through ``hooks.rollback``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_spec_lossless import OracleProposer

from edgespec.arch.base import ArchHooks
from edgespec.arch.rtx import RtxHooks
from edgespec.arch.thor import PREFILL_CHUNK_ALIGN, ThorHooks, prefill_bytes_per_token
from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.drafters.quantize import quantize_linears
from edgespec.kernels.quant.block_scaled_ref import block_scaled_matmul_ref
from edgespec.kernels.quant.quant_ref import pack
from edgespec.loading.checkpoint import load_target
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession
from edgespec.weights.base import PackedWeight

_TRITON = importlib.util.find_spec("triton") is not None


def test_thor_and_rtx_override_their_stages():
    assert ThorHooks.packed_kernel is not ArchHooks.packed_kernel
    assert ThorHooks.prefill is not ArchHooks.prefill
    assert RtxHooks.packed_kernel is not ArchHooks.packed_kernel
    assert ThorHooks.make_defaults().rollback == "deferred" and ThorHooks.make_defaults().kv_fp8


@pytest.mark.skipif(not _TRITON, reason="needs Triton (the kernel modules import it)")
def test_products_by_capability(monkeypatch):
    """Which product each format gets per hook set and compute capability (no GPU: ``capability`` given)."""
    import edgespec.kernels as kernels
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    probes = {fmt: pack(fmt, torch.zeros(128, 256)) for fmt in ("int4", "nvfp4", "mxfp4", "fp8_block")}

    def names(hooks, cap):
        return {f: getattr(hooks.weight_kernel(p, cap), "__name__", None) for f, p in probes.items()}

    from edgespec.kernels.quant.triton_block_scaled import dot_scaled_available
    # NVFP4's E4M3 scales need a Triton that lowers them (3.9 here; a device's older Triton keeps the portable one)
    nvfp4 = "block_scaled_kernel" if dot_scaled_available() else "quant_kernel"
    thor = names(ThorHooks(), (11, 0))
    assert thor == {"int4": "quant_kernel", "nvfp4": nvfp4, "mxfp4": "block_scaled_kernel",
                    "fp8_block": "quant_kernel"}
    assert names(ThorHooks(), (9, 0))["nvfp4"] == "quant_kernel"       # no block-scaled MMA: the portable product
    hopper = names(RtxHooks(), (9, 0))
    assert hopper["nvfp4"] == "quant_kernel" and hopper["mxfp4"] == "block_scaled_kernel"   # mxfp4: emulated
    rtx50 = names(RtxHooks(), (12, 0))
    assert rtx50["nvfp4"] == nvfp4 and rtx50["int4"] == "quant_kernel"
    assert names(RtxHooks(), (10, 0))["nvfp4"] == nvfp4 and names(RtxHooks(), (10, 0))["mxfp4"] == "block_scaled_kernel"
    assert names(ArchHooks(), (10, 0))["nvfp4"] == "quant_kernel"
    assert ArchHooks().weight_kernel(probes["nvfp4"]) is None           # a CPU weight, no capability: reference


class _ThorWithTwin(ThorHooks):
    """Thor with the block-scaled product's torch twin where the GPU product would run."""

    def weight_kernel(self, packed: PackedWeight, capability=None):
        return block_scaled_matmul_ref if packed.format in ("nvfp4", "mxfp4") else None


class _Recording(_ThorWithTwin):
    def __init__(self) -> None:
        super().__init__()
        self.rollbacks = 0

    def rollback(self, *args, **kwargs):
        self.rollbacks += 1
        return super().rollback(*args, **kwargs)


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("hooks") / "q", tiny_config("qwen3_5"), seed=5)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_thor_block_scaled_verify_stays_lossless(tiny_qwen, fmt):
    model = load_target(tiny_qwen, max_positions=512)
    assert quantize_linears(model, fmt, torch.float32) > 0
    vocab = model.config.vocab_size
    prompt = list(range(3, 24))
    plain = SpecSession.with_defaults(model, _ThorWithTwin(), None, max_len=256).generate(
        prompt, max_tokens=20, policy=StrictGreedy()).token_ids
    hooks = _Recording()
    s = SpecSession.with_defaults(model, hooks, OracleProposer(plain, vocab, seed=3), k=5, max_len=256)
    assert all(p.kernel is block_scaled_matmul_ref for p in model.modules() if isinstance(p, PackedWeight))
    out = s.generate(prompt, max_tokens=20, policy=StrictGreedy())
    assert out.token_ids == plain
    assert hooks.rollbacks > 0 and out.telemetry.draft_tokens > 0


def test_thor_prefill_chunks_to_free_memory(tiny_qwen):
    model = load_target(tiny_qwen, max_positions=512)
    per_token = prefill_bytes_per_token(model)
    tight = ThorHooks(free=lambda device: 16 * 100 * per_token)        # room for 100 tokens' activations
    assert tight.prefill_chunk(model, 256) == PREFILL_CHUNK_ALIGN
    assert ThorHooks(free=lambda device: 1 << 40).prefill_chunk(model, 256) == 256
    assert ThorHooks(free=lambda device: 0).prefill_chunk(model, 256) == PREFILL_CHUNK_ALIGN
    prompt = torch.arange(3, 3 + 150)
    outs = []
    for hooks, chunk in ((tight, 256), (ArchHooks(), PREFILL_CHUNK_ALIGN)):
        cache = model.new_cache(512)
        outs.append(hooks.prefill(model, cache, prompt, chunk, ()))
        assert cache.length == 150
    assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].hidden, outs[1].hidden)
