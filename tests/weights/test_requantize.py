"""``lm_head_weights``: the target's untied output projection quantized after loading. The logits move by the
format's rounding only, speculative decoding stays equal to plain decoding of the model so served, and the bad
cases (tied head, already packed head, unknown format) are refused by name."""

from __future__ import annotations

import pytest
import torch
from test_dflash import prompt_ids
from test_spec_lossless import OracleProposer

from edgespec.arch.detect import select_hooks
from edgespec.bench.gpu import weight_bytes_per_token
from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.config import load_settings
from edgespec.errors import ConfigError
from edgespec.loading.checkpoint import load_target
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession
from edgespec.weights import PackedLinear
from edgespec.weights.requantize import quantize_lm_head

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    folder = write_random_checkpoint(tmp_path_factory.mktemp("head") / "m",
                                     tiny_config("qwen3_5", tie_word_embeddings=False), seed=8)
    return folder


@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_quantized_head_logits_and_lossless(untied, fmt):
    dense = load_target(untied, max_positions=256)
    model = load_target(untied, max_positions=256)
    head = model.lm_head.weight
    dense_read = weight_bytes_per_token(model)
    assert quantize_lm_head(model, fmt) and isinstance(model.lm_head, PackedLinear)
    assert weight_bytes_per_token(model) == (dense_read - head.numel() * head.element_size()
                                             + model.lm_head.weight.nbytes)
    assert model.lm_head.weight.nbytes < dense.lm_head.weight.numel() * 4 / 3
    hidden = torch.randn(5, model.config.hidden_size)
    ref, out = dense.logits(hidden), model.logits(hidden)
    assert ((out - ref).norm() / ref.norm()).item() < 0.15          # the format's rounding, nothing more
    prompt = prompt_ids(model.config.vocab_size, n=19, seed=4)
    for arch in ("base", "thor"):
        # plain decoding with the same hooks: thor serves an FP8 KV cache, so its plain output is its own
        plain = SpecSession.with_defaults(model, select_hooks(arch, CPU), None, max_len=128).generate(
            prompt, max_tokens=16, policy=StrictGreedy()).token_ids
        s = SpecSession.with_defaults(model, select_hooks(arch, CPU), OracleProposer(plain, model.config.vocab_size,
                                      seed=2), k=5, max_len=128)
        assert s.generate(prompt, max_tokens=16, policy=StrictGreedy()).token_ids == plain, arch


@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_tied_head_packs_the_table(tmp_path, fmt):
    """A tied head is the embedding table: packing it serves the lookups from the packed rows (equal to the
    format's dequantized rows) and the head from the packed product; speculative == plain."""
    from edgespec.weights import PackedEmbedding
    tied = write_random_checkpoint(tmp_path / "tied", tiny_config("qwen3_5", tie_word_embeddings=True), seed=8)
    model = load_target(tied, max_positions=256)
    dense_read, dense_table = weight_bytes_per_token(model), model.lm_head_weight
    assert model.lm_head is None and quantize_lm_head(model, fmt)
    table = model.model.embed_tokens
    # bytes read per token: the packed table in full (it is the head) instead of the dense one
    assert weight_bytes_per_token(model) == (dense_read - dense_table.numel() * dense_table.element_size()
                                             + table.weight.nbytes)
    assert isinstance(table, PackedEmbedding) and model.lm_head_weight is table.weight
    ids = torch.tensor([[3, 0, 77], [model.config.vocab_size - 1, 5, 3]])
    rows = model.embed(ids)
    assert rows.shape == (2, 3, model.config.hidden_size)
    for i, t in enumerate(ids.reshape(-1).tolist()):
        assert torch.equal(rows.reshape(-1, rows.shape[-1])[i], table.weight.dequantize_rows(t, t + 1, rows.dtype)[0])
    prompt = prompt_ids(model.config.vocab_size, n=19, seed=4)
    plain = SpecSession.with_defaults(model, select_hooks("base", CPU), None, max_len=128).generate(
        prompt, max_tokens=12, policy=StrictGreedy()).token_ids
    s = SpecSession.with_defaults(model, select_hooks("base", CPU), OracleProposer(plain, model.config.vocab_size,
                                  seed=2), k=5, max_len=128)
    assert s.generate(prompt, max_tokens=12, policy=StrictGreedy()).token_ids == plain


def test_refusals(untied, tmp_path):
    model = load_target(untied, max_positions=64)
    assert not quantize_lm_head(model, "model")
    quantize_lm_head(model, "int4")
    with pytest.raises(ConfigError, match="already packed"):
        quantize_lm_head(model, "fp8")
    with pytest.raises(ConfigError, match="packed format 'int2'"):
        quantize_lm_head(load_target(untied, max_positions=64), "int2")
    with pytest.raises(ConfigError, match="lm_head_weights"):
        load_settings(cli={"lm_head_weights": "int2"}, environ={})


@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_banded_quantization_is_the_same_bits(fmt, monkeypatch):
    """A matrix taller than a band is quantized band by band (bounded scratch) into exactly the tensors the
    format's quantizer makes of it whole, a ragged last band and a partial FP8 block included."""
    from edgespec.weights import requantize
    torch.manual_seed(3)
    w = torch.randn(300, 256) * torch.linspace(0.1, 3.0, 300)[:, None]       # rows of different ranges
    whole = requantize.quantize_weight(fmt, w)
    monkeypatch.setattr(requantize, "QUANT_BAND_ROWS", 128)
    banded = requantize.quantize_weight(fmt, w)
    assert type(banded) is type(whole) and banded.out_features == 300
    for name, t in whole.named_buffers():
        assert torch.equal(getattr(banded, name), t), name
