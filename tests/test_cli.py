"""The command line on a fresh install: doctor, generate on the demo model (text + telemetry), bad input exits 2."""

from __future__ import annotations

import json

import pytest

from edgespec.cli import main


def test_doctor_prints_versions_and_arch(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for key in ("torch", "triton", "device", "detected arch"):
        assert key in out


def test_generate_answers_with_telemetry(demo_model_dir, capsys):
    code = main(["generate", "--model", str(demo_model_dir), "--drafter", "ngram", "--max-tokens", "40",
                 "--max-seq-len", "512", "--json",
                 "Output a compact JSON action list for a robot to pick up the red cube. "
                 "Use fields action and target."])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert "{" in out["text"] and out["completion_tokens"] > 5
    tel = out["telemetry"]
    assert tel["drafter"] == "ngram" and tel["acceptance_length"] >= 1.0 and tel["decode_tok_s"] > 0


def test_bad_settings_exit_2_with_a_message(capsys):
    assert main(["generate", "--kv-dtype", "fp4", "hello"]) == 2
    assert "kv_dtype" in capsys.readouterr().err
    assert main(["generate", "--model", "/nonexistent/model", "hello"]) == 2
    assert "/nonexistent/model" in capsys.readouterr().err


def test_bench_shape_sweep_rejects_bad_input_before_any_work(capsys):
    assert main(["bench", "shapes", "qwen3.5-4b,gpt-5"]) == 2
    assert "gpt-5" in capsys.readouterr().err
    assert main(["bench", "shapes", "qwen3.5-4b", "--kv", "int4"]) == 2
    assert "int4" in capsys.readouterr().err
    assert main(["bench", "shapes", "qwen3.5-4b", "--kv", "none"]) == 2       # nothing left to measure
    assert "--attn-in-place" in capsys.readouterr().err
    assert main(["bench", "shapes", "qwen3.5-4b", "--device", "tpu"]) == 2
    assert "--device 'tpu'" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert main(["bench", "shapes", "qwen3.5-4b"]) == 2
        assert "CUDA" in capsys.readouterr().err


def test_bench_shapes_on_the_cpu_runs_the_small_shape_unless_shapes_are_named(tmp_path, monkeypatch, capsys):
    """``bench shapes --device cpu`` is a smoke run: the GPU default list (a 27B in fp32, a 4B's 2048-row prefills,
    the transformers comparison) would not finish on a host, so the default runs one small shape, short prefills
    and no transformers; named shapes run as named."""
    import edgespec.bench.gpu as gpu

    seen = []

    def fake_bench_shape(shape, **kw):
        seen.append((shape, kw["prefill_lengths"]))
        raise RuntimeError("recorded")            # kept in the report as that shape's error

    monkeypatch.setattr(gpu, "bench_shape", fake_bench_shape)
    monkeypatch.setattr(gpu, "bench_hf", lambda *a, **k: pytest.fail("no transformers run on the CPU by default"))
    assert main(["bench", "shapes", "--device", "cpu", "--kv", "model", "--sweep-out", str(tmp_path)]) == 1  # failed: 1
    assert seen == [(gpu.CPU_SHAPE, (128,))]
    seen.clear()
    assert main(["bench", "shapes", "qwen3-4b", "--device", "cpu", "--kv", "model", "--sweep-out",
                 str(tmp_path)]) == 1
    assert seen == [("qwen3-4b", (128,))]
    capsys.readouterr()


def test_generate_with_an_image_file(tmp_path, capsys):
    """``edgespec generate --image PATH`` on a tiny vision-language model: answered with the vision telemetry; a
    missing file and an image with --raw exit 2 naming the problem."""
    pytest.importorskip("PIL")
    from edgespec.bench.vision_shapes import encode_frame, synthetic_frame, write_tiny_vl_checkpoint

    folder = write_tiny_vl_checkpoint(tmp_path / "vl", seed=1)
    frame = tmp_path / "frame.jpg"
    frame.write_bytes(encode_frame(synthetic_frame(120, 160, seed=2), "JPEG"))
    code = main(["generate", "--model", str(folder), "--image", str(frame), "--max-tokens", "6", "--json",
                 "Where is the cube?"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["telemetry"]["vision"]["images"] == 1 and out["telemetry"]["vision"]["encoded"] == 1
    assert main(["generate", "--model", str(folder), "--image", str(tmp_path / "none.png"), "x"]) == 2
    assert "cannot read image file" in capsys.readouterr().err
    assert main(["generate", "--model", str(folder), "--image", str(frame), "--raw", "x"]) == 2
    assert "--raw" in capsys.readouterr().err
