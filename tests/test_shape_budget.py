"""``edgespec doctor --shape``: the memory budget of a published shape in a weight format from its config alone
(every MoE expert counted), the 35B-A3B int4 + MTP + 32k FP8 KV figure against 24 GB, and a configuration that
does not fit refused with its numbers; bad input named."""

from __future__ import annotations

import pytest
import torch

from edgespec.bench.shape_budget import parse_memory, shape_budget
from edgespec.bench.shapes import SHAPES, config_dict
from edgespec.cli import main
from edgespec.errors import ConfigError
from edgespec.loading.hf_config import parse_config
from edgespec.memory import kv_cache_bytes

SHAPE = "qwen3.5-35b-a3b"


@pytest.fixture(scope="module")
def int4_budget():
    """35B-A3B int4 + its MTP head + a 32k FP8 KV cache against 24 GB (one meta build, ~20 s)."""
    return shape_budget(SHAPE, "int4", 32768, True, "mtp", parse_memory("24GB"))


def test_35b_a3b_int4_mtp_32k_fp8_fits_24gb(int4_budget):
    budget, split = int4_budget
    cfg = parse_config(config_dict(**SHAPES[SHAPE]))
    # every routed expert lives in memory: 40 layers x 256 experts x (gate+up+down) int4 g128 (codes, fp16
    # scales, uint8 zeros) -- computed here from the shape, not read back from the module tree
    per_matrix = lambda out_f, in_f: out_f * in_f // 2 + out_f * (in_f // 128) * 3     # noqa: E731
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    assert split["experts"] == 40 * 256 * (per_matrix(2 * I, H) + per_matrix(H, I))
    assert budget.kv_cache == kv_cache_bytes(cfg, 32768, torch.bfloat16, kv_fp8=True)
    assert split["mtp_head"] == budget.drafter > 256 * per_matrix(2 * I, H)          # one MoE layer of experts
    assert budget.fits and budget.total <= 24e9


def test_doctor_shape_prints_and_refuses_with_numbers(int4_budget, monkeypatch, capsys):
    # the int4 report as doctor prints it (its budget from the fixture: one meta build less)
    monkeypatch.setattr("edgespec.bench.shape_budget.shape_budget", lambda *a, **k: int4_budget)
    assert main(["doctor", "--shape", SHAPE, "--format", "int4", "--max-seq-len", "32768", "--drafter", "mtp",
                 "--memory", "24GB"]) == 0
    out = capsys.readouterr().out
    assert "experts 15.70 GiB" in out and "23.35 GB of 24.00 GB" in out and out.rstrip().endswith("fits")
    monkeypatch.undo()
    # the same model in block-FP8 does not fit 24 GB: refused, every part named with its size
    assert main(["doctor", "--shape", SHAPE, "--format", "fp8", "--max-seq-len", "32768", "--drafter", "mtp",
                 "--memory", "24GB"]) == 2
    err = capsys.readouterr().err
    assert "does not fit a 24.0 GB share: weights 33.26 GiB + kv 2.39 GiB + drafter" in err


def test_shape_budget_bad_input():
    with pytest.raises(ConfigError, match="expected a size such as 24GB"):
        parse_memory("24 bananas")
    with pytest.raises(ConfigError, match="format 'int3'"):
        shape_budget(SHAPE, "int3", 1024, True, None, None)
    with pytest.raises(ConfigError, match="unknown shape 'qwen9'"):
        shape_budget("qwen9", "int4", 1024, True, None, None)
    with pytest.raises(ConfigError, match="has no MTP head"):
        shape_budget("qwen3-4b", "int4", 1024, True, "mtp", None)
    assert main(["doctor", "--shape", SHAPE, "--memory", "lots"]) == 2


def test_qwen38_int4_dflash2_int4_32k_fp8_fits_and_projects(capsys):
    """Qwen3.8-27B int4 + z-lab's DFlash2 drafter shape in int4 + a 32k FP8 KV cache against a 32 GB share of a
    Thor's memory: the drafter's bytes computed here from its published shape (merged q/k/v and gate/up, two conv
    kernel projections per layer, fc over five taps, the selector; int4 g128 = codes + fp16 scales + uint8 zeros;
    norms, convolution kernels and the two 248320 x 256 codebooks in bf16), the cycle's bytes and the projection."""
    from edgespec.bench.shape_budget import cycle_bytes
    from edgespec.bench.shapes import qwen38_config

    budget, split = shape_budget("qwen3.8-27b", "int4", 32768, True, "qwen3.8-27b-dflash2", parse_memory("32GB"))
    per_matrix = lambda out_f, in_f: out_f * in_f // 2 + out_f * (in_f // 128) * 3     # noqa: E731
    H, L, V = 5120, 5, 248320
    linears = L * (per_matrix(4096 + 2 * 1024, H) + per_matrix(H, 4096) + per_matrix(2 * 17408, H)
                   + per_matrix(H, 17408) + 2 * per_matrix(H // 16 * 4, H)) + per_matrix(H, 5 * H) + per_matrix(256, H)
    bf16 = 2 * (L * (2 * H + 2 * 128 + 2 * 2 * 2 * H) + 2 * H + 2 * V * 256)
    assert split["drafter_weights"] == linears + bf16
    window = 4 * 128 * H + 2 * 4 * L * (128 + 8) * 8 * 128 + 8 * 128
    assert split["drafter_window"] == window and budget.drafter == linears + bf16 + window
    assert split["drafter_read"] == linears + bf16 - 2 * 2 * V * 256 + 2 * 2 * 7 * 16 * 256 + window
    assert split["head"] == V * H * 2                                    # the borrowed lm_head, read by each draft
    cfg = parse_config(qwen38_config(config_dict(**SHAPES["qwen3.8-27b"])))
    assert budget.kv_cache == kv_cache_bytes(cfg, 32768, torch.bfloat16, kv_fp8=True)
    assert budget.fits and budget.total <= 32e9
    parts = cycle_bytes(split, cfg, 32768, True)
    assert parts["kv"] == 2 * 16 * 32768 * 4 * (256 + 4)                 # fp8 values + a float32 scale per head
    assert parts["states"] == 2 * 48 * (48 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) * 3 * 2)
    assert main(["doctor", "--shape", "qwen3.8-27b", "--format", "int4", "--max-seq-len", "32768", "--drafter",
                 "qwen3.8-27b-dflash2", "--memory", "32GB"]) == 0
    out = capsys.readouterr().out
    assert "Thor projection: context 32768: cycle reads" in out and "at AL 5.47" in out and out.rstrip().endswith(
        "fits")
    with pytest.raises(ConfigError, match="drafts for 'qwen3.8-27b', not 'qwen3.5-9b'"):
        shape_budget("qwen3.5-9b", "int4", 1024, True, "qwen3.8-27b-dflash2", None)
    with pytest.raises(ConfigError, match="drafter format 'int3'"):
        shape_budget("qwen3.8-27b", "int4", 1024, True, "qwen3.8-27b-dflash2", None, drafter_format="int3")


def test_27b_int4_with_the_vision_tower_and_32k_fp8_kv_fits_thor():
    """Qwen3.5-27B int4 + its MTP head + the bf16 vision tower (sized for 1280x720 frames) + a 32k FP8 KV cache:
    the tower is its own part of the budget (its ~0.9 GB of weights counted once) and the whole fits a 32 GB share
    of Thor's 128 GB."""
    from edgespec.memory import vision_bytes

    text, _ = shape_budget("qwen3.5-27b", "int4", 32768, True, "mtp", parse_memory("32GB"))
    budget, split = shape_budget("qwen3.5-27b", "int4", 32768, True, "mtp", parse_memory("32GB"), vision=True)
    assert text.vision == 0 and budget.weights == text.weights and budget.kv_cache == text.kv_cache
    assert 0.8e9 < split["vision_tower"] < 1.0e9
    cfg = parse_config(config_dict(**SHAPES["qwen3.5-27b"]))
    from edgespec.bench.vision_shapes import QWEN35_TOWER
    from edgespec.models.config import VisionConfig
    cfg.vision = VisionConfig(**QWEN35_TOWER, out_hidden_size=cfg.hidden_size)
    assert budget.vision == vision_bytes(cfg, split["vision_tower"], torch.bfloat16) > split["vision_tower"]
    assert budget.fits and budget.total <= 32e9
