"""The whole layer stack in one compiled call (edgespec.models.cpu_stack) against the per-layer path and the fp32
oracle: bit for bit on Llama, within float rounding on Qwen3 (its per-layer q/k norms run in torch), every row
as in a one-row call, and None (the per-layer path) wherever it does not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_files import write_tiny_gguf

from edgespec.kernels.cpu import gguf_native
from edgespec.loading.gguf_model import load_gguf_target
from edgespec.models import cpu_stack

pytestmark = pytest.mark.skipif(gguf_native.library() is None, reason="the compiled kernels cannot be built here")
TAPS = (0, 1)


def _model(tmp_path: Path, qtype: str = "Q4_1", arch: str = "llama", **kw):
    return load_gguf_target(write_tiny_gguf(tmp_path / "m.gguf", qtype, arch=arch, **kw), max_positions=256)[0]


def _run(model, ids: torch.Tensor, stacked: bool) -> list[torch.Tensor]:
    """Logits and taps of a 5-row prefill then 6 one-row steps, on the stack or the per-layer path."""
    cpu_stack._plans[model] = cpu_stack.build_plan(model) if stacked else None
    cache = model.new_cache(64)
    out = model.forward(ids[:5], cache, taps=TAPS)
    got = [out.logits, out.taps, out.hidden]
    for t in ids[5:]:
        out = model.forward(t.view(1), cache, taps=TAPS)
        got += [out.logits, out.taps, out.hidden]
    cpu_stack._plans.pop(model, None)
    return got


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F32"])
def test_llama_stack_equals_the_per_layer_path_bit_for_bit(tmp_path: Path, qtype: str) -> None:
    model = _model(tmp_path, qtype, tied=qtype != "Q8_0")
    assert cpu_stack.build_plan(model) is not None
    ids = torch.tensor([1, 5, 260, 7, 99, 3, 42, 200, 17, 4, 8])
    with torch.inference_mode():
        a, b = _run(model, ids, True), _run(model, ids, False)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_qwen3_stack_matches_the_per_layer_path(tmp_path: Path) -> None:
    model = _model(tmp_path, "Q8_0", arch="qwen3")
    assert model.model.layers[0].self_attn.q_norm is not None and cpu_stack.build_plan(model) is not None
    ids = torch.tensor([1, 5, 260, 7, 99, 3, 42, 200, 17])
    with torch.inference_mode():
        a, b = _run(model, ids, True), _run(model, ids, False)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_rows_equal_one_row_calls_and_prefill_is_exact(tmp_path: Path) -> None:
    model = _model(tmp_path, "Q4_1")
    ids = torch.tensor([1, 5, 260, 7, 99, 3, 42, 200, 17, 4, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18, 19])
    with torch.inference_mode():
        whole = model.forward(ids, model.new_cache(64), taps=TAPS)
        cache = model.new_cache(64)
        model.forward(ids[:3], cache)
        rows = [model.forward(ids[t:t + 1], cache, taps=TAPS) for t in range(3, len(ids))]
    for t, row in enumerate(rows, start=3):
        assert torch.equal(row.logits[0], whole.logits[t]) and torch.equal(row.taps[0], whole.taps[t])


@pytest.mark.parametrize("why", ["fp8_cache", "grad", "taps_out_of_order", "native_off"])
def test_declines_what_it_does_not_cover(tmp_path: Path, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tmp_path, "Q4_1")
    h = torch.randn(2, model.config.hidden_size)
    cs = model.rope.angles(0, 2, None, torch.float32)
    cache = model.new_cache(16, kv_fp8=why == "fp8_cache")
    taps = (1, 0) if why == "taps_out_of_order" else ()
    if why == "native_off":
        monkeypatch.setattr(gguf_native, "_tried", True)
        monkeypatch.setattr(gguf_native, "_lib", None)
        cpu_stack._plans.pop(model, None)
    if why == "grad":
        assert cpu_stack.stack_forward(model, h, cache, 0, cs, taps) is None
        return
    with torch.inference_mode():
        assert cpu_stack.stack_forward(model, h, cache, 0, cs, taps) is None
    cpu_stack._plans.pop(model, None)


def test_a_hybrid_model_has_no_plan(tmp_path: Path) -> None:
    from edgespec.bench.shapes import tiny_config, write_random_checkpoint
    from edgespec.loading.checkpoint import load_target

    write_random_checkpoint(tmp_path / "hybrid", tiny_config("qwen3_5"))
    assert cpu_stack.build_plan(load_target(tmp_path / "hybrid")) is None
