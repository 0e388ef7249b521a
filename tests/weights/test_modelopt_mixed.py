"""ModelOpt MIXED_PRECISION checkpoints (NVFP4 MLPs, per-tensor FP8 attention, FP8 KV cache without scales).

nvidia-modelopt does not install on a CPU machine, so the files are built to its documented export layout
(tests/quant_layouts.py); the oracle is the same model with each layer's dequantized matrix as a dense weight.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from quant_layouts import write_modelopt_mixed
from test_dflash import plain_greedy, prompt_ids
from test_spec_lossless import OracleProposer

from edgespec.arch.detect import select_hooks
from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.drafters.ngram import NGramProposer
from edgespec.errors import CheckpointError, UnsupportedModelError
from edgespec.loading.checkpoint import load_target
from edgespec.models.layers import Linear
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession
from edgespec.weights import PackedLinear

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("modelopt")
    out = {}
    # The Qwen hybrid as its VLM release names it (model.language_model.*), llama as a plain text model.
    for family, prefix in (("qwen3_5", "model.language_model."), ("llama", "model.")):
        dense = write_random_checkpoint(root / family, tiny_config(family), seed=9, prefix=prefix)
        out[family] = write_modelopt_mixed(dense, root / f"{family}-q", root / f"{family}-ref", seed=2)
    return out


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_mixed_precision_matches_dequantized_reference(mixed, family):
    qdir, rdir = mixed[family]
    model = load_target(qdir, max_positions=64)
    ref = load_target(rdir, max_positions=64)
    layers = model.model.layers
    assert {m.weight.format for m in layers[0].mlp.modules() if isinstance(m, PackedLinear)} == {"nvfp4"}
    attn = layers[3].self_attn if family == "qwen3_5" else layers[0].self_attn
    assert {m.weight.format for m in attn.modules() if isinstance(m, PackedLinear)} == {"fp8_row"}
    if family == "qwen3_5":
        gdn = layers[0].linear_attn
        assert {m.weight.format for m in gdn.modules() if isinstance(m, PackedLinear)} == {"fp8_row"}
        assert any(isinstance(m, Linear) for m in gdn.modules())    # the a/b gates stay in 16 bits
    assert model.checkpoint_kv_cache == "fp8"
    toks = torch.tensor(prompt_ids(model.config.vocab_size, n=12))
    tol = 2e-4 if family == "qwen3_5" else 1e-4
    with torch.inference_mode():
        cq, cr = model.new_cache(64), ref.new_cache(64)
        torch.testing.assert_close(model.forward(toks, cq).logits, ref.forward(toks, cr).logits, rtol=tol, atol=tol)
        torch.testing.assert_close(model.decode(torch.tensor([5]), cq), ref.decode(torch.tensor([5]), cr),
                                   rtol=tol, atol=tol)


def test_mixed_precision_speculative_equals_plain_with_fp8_kv(mixed):
    model = load_target(mixed["qwen3_5"][0], max_positions=256)
    vocab = model.config.vocab_size
    prompt = prompt_ids(vocab, n=19, seed=4)
    plain = plain_greedy(model, prompt, 14)
    # The checkpoint's FP8 KV cache (own per-token scales): speculative output equals plain decoding with it.
    hooks = select_hooks("base", CPU)
    ref = SpecSession.with_defaults(model, hooks, NGramProposer(), k=1, kv_fp8=True, max_len=128)
    fp8_plain = ref.generate(prompt, max_tokens=14, policy=StrictGreedy()).token_ids
    for kv_fp8, want in ((False, plain), (True, fp8_plain)):
        s = SpecSession.with_defaults(model, hooks, OracleProposer(want, vocab, seed=1), k=4, kv_fp8=kv_fp8,
                                      max_len=128)
        assert s.generate(prompt, max_tokens=14, policy=StrictGreedy()).token_ids == want


def _edit_quant(folder, change):
    for name in ("hf_quant_config.json",):
        data = json.loads((folder / name).read_text())
        change(data["quantization"])
        (folder / name).write_text(json.dumps(data))
    return folder


def test_unsupported_layer_algorithm_is_named(mixed, tmp_path):
    folder = shutil.copytree(mixed["llama"][0], tmp_path / "m")
    _edit_quant(folder, lambda q: q["quantized_layers"].update(
        {"model.layers.1.mlp.up_proj": {"quant_algo": "W4A8_AWQ", "group_size": 128}}))
    with pytest.raises(UnsupportedModelError, match="quantized_layers.model.layers.1.mlp.up_proj \\(W4A8_AWQ\\): "
                                                    "modelopt quant_algo 'W4A8_AWQ' is not supported"):
        load_target(folder)


def test_quantized_layer_missing_from_quantized_layers_is_refused(mixed, tmp_path):
    folder = shutil.copytree(mixed["llama"][0], tmp_path / "m")
    _edit_quant(folder, lambda q: q["quantized_layers"].pop("model.layers.2.self_attn.o_proj"))
    with pytest.raises(CheckpointError, match="layer model.layers.2.self_attn.o_proj has quantized tensors"):
        load_target(folder)


def test_engine_serves_the_fp8_kv_cache_the_checkpoint_asks_for(mixed, tmp_path):
    """kv_dtype auto follows kv_cache_quant_algo FP8 (own per-token scales); an explicit kv_dtype wins."""
    from edgespec.bench.shapes import write_chat_tokenizer
    from edgespec.config import Settings
    from edgespec.engine import Engine
    from edgespec.plan import build_plan

    folder = write_chat_tokenizer(shutil.copytree(mixed["llama"][0], tmp_path / "m"))
    for kv, want in (("auto", True), ("model", False)):
        engine = Engine.load(build_plan(Settings(model=str(folder), drafter="ngram", kv_dtype=kv, max_seq_len=128)))
        assert engine.session.kv_fp8 is want, kv
