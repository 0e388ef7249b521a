"""tools/vision_bench.py's frame plan (the processor's grid and the tower's arithmetic) and the vision section of
tools/thor_projection.py: interpolation to 20 SMs, the byte floor, the price of a frame in decode steps, and bad
inputs refused by name. The timings themselves need a GPU (the lead's run)."""

from __future__ import annotations

import json

import pytest
import torch
from _tools import load_tool

from edgespec.bench.vision_shapes import QWEN35_TOWER
from edgespec.loading.images import ProcessorConfig
from edgespec.memory import image_kv_bytes, vision_bytes
from edgespec.models.config import VisionConfig

bench = load_tool("vision_bench")
proj = load_tool("thor_projection")
TOWER = VisionConfig(**QWEN35_TOWER, out_hidden_size=5120)


def test_frame_plan_of_camera_frames():
    vga = bench.frame_plan(TOWER, 640, 480, ProcessorConfig())
    hd = bench.frame_plan(TOWER, 1280, 720, ProcessorConfig())
    assert (vga["resized"], vga["patches"], vga["tokens"]) == ("640x480", 1200, 300)
    assert (hd["resized"], hd["patches"], hd["tokens"]) == ("1280x704", 3520, 880)
    # ~0.41 G multiply-adds per patch in the blocks, plus attention quadratic in the patches
    assert 0.9 < vga["tflop"] < 1.3 and 3.5 < hd["tflop"] < 5.5
    smaller = bench.frame_plan(TOWER, 1280, 720, ProcessorConfig(max_pixels=640 * 480))
    assert smaller["tokens"] <= 300                                 # image_max_pixels bounds the tokens


def _run(tmp_path, sms, tower_ms, prefill_ms=None, decode_ms=None):
    frames = [{"frame": "640x480", "tokens": 300, "tflop": 1.1, "tower_ms": tower_ms[0]},
              {"frame": "1280x720", "tokens": 880, "tflop": 4.4, "tower_ms": tower_ms[1]}]
    data = {"device": "test GPU", "sms": 132, "sm_clock_mhz": 1575, "tower_bytes": 0.9e9,
            "sm_limit": {"requested": sms, "granted": sms, "device_sms": 132}, "frames": frames}
    if prefill_ms is not None:
        for f, p in zip(frames, prefill_ms, strict=True):
            f["prefill_ms"] = p
        data["text"] = {"shape": "qwen3.5-27b", "format": "int4", "weight_bytes": 15e9, "decode_ms": decode_ms}
    path = tmp_path / f"v{sms}.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_vision_projection_interpolates_and_prices_a_frame(tmp_path, capsys):
    a = _run(tmp_path, 16, (30.0, 120.0), (100.0, 300.0), 80.0)
    b = _run(tmp_path, 24, (20.0, 80.0), (70.0, 200.0), 60.0)
    p = proj.vision_projection([a, b], 1575.0)
    vga = p["frames"][0]
    assert vga["tower_ms"] == pytest.approx(24.0)             # rate linear in SMs: 1 / ((1/30 + 1/20) / 2)
    assert vga["bound"] == "SMs" and p["text"]["decode_ms"] == pytest.approx(1 / ((1 / 80 + 1 / 60) / 2))
    assert vga["decode_steps"] == pytest.approx((24.0 + 1 / ((1 / 100 + 1 / 70) / 2)) / p["text"]["decode_ms"])
    assert proj.main(["--vision", a, b]) == 0
    out = capsys.readouterr().out
    assert "PROJECTION of the vision tower" in out and "1280x720" in out and "decode steps" in out


def test_vision_projection_floor_and_bad_inputs(tmp_path, capsys):
    fast = [_run(tmp_path, 16, (1.0, 2.0)), _run(tmp_path, 24, (0.5, 1.0))]
    p = proj.vision_projection(fast, 1575.0)
    assert p["frames"][0]["bound"] == "bytes" and p["frames"][0]["tower_ms"] == pytest.approx(0.9e9 / 259e9 * 1e3)
    assert "text" not in p
    full_chip = tmp_path / "full.json"
    full_chip.write_text(json.dumps({"frames": [], "sm_limit": None}))
    assert proj.main(["--vision", str(full_chip)]) == 2
    assert "written with --sm-limit" in capsys.readouterr().err
    assert proj.main(["--vision", fast[0]]) == 2                    # one SM count cannot bracket 20
    assert "bracket" in capsys.readouterr().err


def test_vision_memory_parts():
    """The tower's budget: weights + one frame's activations + the encoder cache; a frame's share of the KV."""
    from edgespec.bench.shapes import SHAPES, config_dict
    from edgespec.loading.hf_config import parse_config

    cfg = parse_config(config_dict(**SHAPES["qwen3.5-27b"]))
    assert vision_bytes(cfg, 10**9, torch.bfloat16) == 0       # no tower in a text-only config
    cfg.vision = TOWER
    part = vision_bytes(cfg, 10**9, torch.bfloat16)
    assert 10**9 < part < 10**9 + 400 * 2**20
    # 16 attention layers x 4 KV heads x 256 x 2 (K, V) x 300 tokens, one byte each in FP8 + a float scale per head
    assert image_kv_bytes(cfg, 300, torch.bfloat16, kv_fp8=True) == 2 * 16 * 300 * 4 * (256 + 4)
