"""Bad checkpoints and bad settings: each error names the file, key or value, never a bare torch traceback."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.config import Settings, load_settings
from edgespec.errors import CheckpointError, ConfigError, PromptTooLongError, UnsupportedModelError
from edgespec.loading.checkpoint import load_target
from edgespec.loading.hf_config import parse_config


@pytest.fixture()
def ckpt(tmp_path):
    return write_random_checkpoint(tmp_path / "m", tiny_config("llama"), seed=1)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere"):
        load_target(tmp_path / "nowhere")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_target(ckpt)


def test_corrupt_config_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_target(ckpt)


def test_missing_safetensors(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_target(ckpt)


def test_truncated_safetensors(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated or corrupt"):
        load_target(ckpt)


def test_missing_shard(tmp_path):
    path = write_random_checkpoint(tmp_path / "s", tiny_config("llama"), shards=2)
    next(path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_target(path)


def test_unexpected_key(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.surprise.weight"] = torch.zeros(2)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected key.*surprise"):
        load_target(ckpt)


def test_missing_key(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing key.*model.layers.1.mlp.up_proj.weight"):
        load_target(ckpt)


def test_shape_mismatch(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"down_proj.weight.*\(3, 3\).*expected"):
        load_target(ckpt)


def test_unknown_model_type():
    with pytest.raises(UnsupportedModelError, match="'gpt_neox'"):
        parse_config({**tiny_config("llama"), "model_type": "gpt_neox"})


def test_moe_refused_clearly():
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        parse_config({**tiny_config("qwen3"), "model_type": "qwen3_moe"})


def test_config_without_required_fields():
    cfg = tiny_config("llama")
    del cfg["hidden_size"]
    with pytest.raises(CheckpointError, match="hidden_size"):
        parse_config(cfg)
    cfg = tiny_config("qwen3_5")
    del cfg["linear_num_key_heads"]
    with pytest.raises(CheckpointError, match="linear_num_key_heads"):
        parse_config(cfg)
    with pytest.raises(CheckpointError, match="model_type"):
        parse_config({"hidden_size": 8})


def test_prompt_longer_than_max_seq_len(tiny_models):
    model = tiny_models["llama"]
    cache = model.new_cache(32)
    with pytest.raises(PromptTooLongError, match="max_seq_len 32"):
        model.prefill(torch.zeros(40, dtype=torch.long), cache)


def test_layer_types_length_checked():
    cfg = tiny_config("qwen3_5")
    cfg["layer_types"] = cfg["layer_types"][:-1]
    with pytest.raises(CheckpointError, match="layer_types"):
        parse_config(cfg)


# -- settings ------------------------------------------------------------------------------------------------
def test_settings_layers_yaml_env_cli(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("max_seq_len: 1024\nkv_dtype: fp8\ndrafter: ngram\n")
    s = load_settings(path, cli={"drafter": "none"}, environ={"EDGESPEC_MAX_SEQ_LEN": "2048"})
    assert (s.max_seq_len, s.kv_dtype, s.drafter) == (2048, "fp8", "none")


def test_settings_reject_unknown_keys_by_name(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("max_seq_lenn: 1024\n")
    with pytest.raises(ConfigError, match="max_seq_lenn"):
        load_settings(path, environ={})
    with pytest.raises(ConfigError, match="kv_dtipe"):
        load_settings(environ={"EDGESPEC_KV_DTIPE": "fp8"})


def test_settings_values_checked():
    with pytest.raises(ConfigError, match="kv_dtype.*'fp4'"):
        load_settings(cli={"kv_dtype": "fp4"}, environ={})
    with pytest.raises(ConfigError, match="max_seq_len.*minimum"):
        load_settings(cli={"max_seq_len": "4"}, environ={})
    with pytest.raises(ConfigError, match="port.*not a valid int"):
        load_settings(cli={"port": "eighty"}, environ={})
    with pytest.raises(ConfigError, match="num_draft_tokens.*maximum"):
        Settings().with_overrides(num_draft_tokens=64)
    with pytest.raises(ConfigError, match="not found"):
        load_settings("/nonexistent.yaml", environ={})


def test_settings_yaml_not_a_mapping(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_settings(path, environ={})
    path.write_text("a: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(path, environ={})


def test_tokenizer_vocab_larger_than_model(tmp_path, demo_model_dir):
    """A tokenizer that does not fit the model is refused at engine start."""
    from edgespec.engine import Engine
    from edgespec.plan import build_plan

    folder = tmp_path / "mismatch"
    write_random_checkpoint(folder, tiny_config("llama"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir / name, folder / name)
    with pytest.raises(ConfigError, match="vocab_size"):
        Engine.load(build_plan(Settings(model=str(folder), max_seq_len=64)))
    json.loads((folder / "config.json").read_text())  # folder left intact
