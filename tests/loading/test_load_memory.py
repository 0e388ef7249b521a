"""Loading never stages a second copy of the weights, and the memory budget is right and refuses up front.

Peak host memory is measured in a fresh subprocess (``VmHWM`` after resetting it through ``/proc/self/clear_refs``;
tracemalloc does not see torch's allocations) while it loads a ~240 MB fp32 checkpoint: into fp32 the peak growth
must stay within the weights plus a small margin, into bf16 within the bf16 weights plus the staging buffer (the
old loader allocated fp32 first and mapped the whole file: ~2x).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from edgespec.bench.shapes import config_dict, tiny_config, write_random_checkpoint
from edgespec.loading.checkpoint import load_target
from edgespec.loading.safetensors_io import STAGING_BYTES
from edgespec.memory import MemoryBudgetError, kv_cache_bytes, module_bytes, plan_budget

MiB = 1 << 20
SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from edgespec.loading.checkpoint import load_target
    from edgespec.memory import host_peak_rss, module_bytes

    def rss():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    # torch imports its meta-device operator registrations on first use (~75 MB of code, once per process,
    # whatever the model): import them before the baseline, so the figure is what the weights cost.
    from edgespec.loading.hf_config import load_config
    from edgespec.models.decoder import TargetModel
    with torch.device("meta"):
        TargetModel(load_config(Path(sys.argv[1])), max_positions=1)
    try:
        Path("/proc/self/clear_refs").write_text("5")      # reset VmHWM to the current RSS
    except OSError:
        pass
    before = rss()
    model = load_target(sys.argv[1], dtype=getattr(torch, sys.argv[2]), max_positions=64)
    print(json.dumps({"growth": host_peak_rss() - before, "weights": module_bytes(model), "before": before}))
""")


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    cfg = config_dict(model_type="llama", vocab_size=8192, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
    return write_random_checkpoint(tmp_path_factory.mktemp("big") / "m", cfg, seed=0)


def _measure(path, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(path), dtype], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype, extra", [("float32", 0), ("bfloat16", STAGING_BYTES)])
def test_peak_host_memory_is_the_weights(big_checkpoint, dtype, extra):
    r = _measure(big_checkpoint, dtype)
    # Margin: rotary tables, one merged projection group (gate+up of one layer) and allocator rounding.
    limit = r["weights"] + extra + 48 * MiB
    assert r["weights"] > 100 * MiB
    assert r["growth"] <= limit, (f"load grew RSS by {r['growth'] / MiB:.0f} MiB for {r['weights'] / MiB:.0f} MiB "
                                  f"of weights (limit {limit / MiB:.0f} MiB)")


def test_budget_matches_what_is_allocated(tmp_path):
    path = write_random_checkpoint(tmp_path / "m", tiny_config("llama"), seed=2)
    model = load_target(path, max_positions=1024, merge=False)
    budget = model.memory_budget
    assert budget.weights == module_bytes(model) > 0
    for fp8 in (False, True):
        cache = model.new_cache(1024, kv_fp8=fp8)
        held = sum(t.numel() * t.element_size() for layer in cache.kv_layers for t in vars(layer).values()
                   if isinstance(t, torch.Tensor))
        assert kv_cache_bytes(model.config, 1024, model.dtype, fp8) == held
    assert budget.total == budget.weights + budget.kv_cache + budget.drafter + budget.workspace
    assert any("weights" in line for line in budget.lines())


def test_budget_refuses_up_front_with_the_numbers(tmp_path):
    path = write_random_checkpoint(tmp_path / "m", tiny_config("llama", max_position_embeddings=1 << 30), seed=2)
    with pytest.raises(MemoryBudgetError, match=r"does not fit cpu: weights .* \+ kv .* GiB; free on cpu: .* GiB"):
        load_target(path, max_positions=1 << 30)
    budget = plan_budget(load_target(path, max_positions=64).config, 10, torch.device("cpu"), torch.float32, 64)
    assert budget.fits


def test_doctor_prints_the_budget_and_the_measured_peak(tmp_path, capsys):
    from edgespec.cli import main

    path = write_random_checkpoint(tmp_path / "m", tiny_config("qwen3_5"), seed=2, with_mtp=True)
    assert main(["doctor", "--model", str(path), "--max-seq-len", "512", "--device", "cpu", "--load"]) == 0
    out = capsys.readouterr().out
    for part in ("weights:", "kv cache + states:", "drafter:", "workspace:", "free on cpu:", "fits",
                 "measured load peak:"):
        assert part in out
    huge = write_random_checkpoint(tmp_path / "h", tiny_config("llama", max_position_embeddings=1 << 31), seed=2)
    assert main(["doctor", "--model", str(huge), "--max-seq-len", str(1 << 31), "--device", "cpu"]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_bench_random_model_is_built_lean_and_merged():
    from edgespec.bench.gpu import random_model, weight_bytes_per_token

    model = random_model("smollm2-135m", torch.device("cpu"), torch.bfloat16, 64)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.memory_budget.weights == module_bytes(model)
    assert 0 < weight_bytes_per_token(model) <= module_bytes(model)
    out = model.forward(torch.tensor([1, 2, 3]), model.new_cache(64)).logits
    assert torch.isfinite(out).all()
