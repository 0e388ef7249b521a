"""The command line on a fresh install: doctor, generate on the demo model (text + telemetry), bad input exits 2."""

from __future__ import annotations

import json

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
