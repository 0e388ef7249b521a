"""compressed-tensors checkpoints written by the real library load into packed layers module by module.

Oracle: the library's own dequantized weights (``decompress_model``) as a dense checkpoint; the packed model's
logits must match its logits, and greedy speculative decoding must equal plain decoding on the packed model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ct_layouts import SCHEMES, edit_config, write_ct
from test_dflash import plain_greedy, prompt_ids
from test_spec_lossless import OracleProposer

from edgespec.arch.detect import select_hooks
from edgespec.drafters.ngram import NGramProposer
from edgespec.errors import CheckpointError, UnsupportedModelError
from edgespec.loading.checkpoint import load_target
from edgespec.loading.quant_config import parse_quant_config
from edgespec.models.layers import Linear
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession
from edgespec.weights import PackedLinear

pytest.importorskip("compressed_tensors")

CPU = torch.device("cpu")
# hidden 128 / intermediate 256: every projection's inputs split into groups of 32, 64 and 128.
SHAPE = dict(hidden_size=128, intermediate_size=256)
FORMAT = {"int4-g32-sym": {"int4"}, "int4-g64-asym": {"int4"}, "int4-g128-sym": {"int4"},
          "int4-channel-asym": {"int4"}, "fp8-channel-dynamic": {"fp8_row"}, "fp8-tensor": {"fp8_row"},
          "fp8-block": {"fp8_block"},
          "nvfp4": {"nvfp4"}, "mixed": {"int4", "fp8_row"}}
CASES = [("llama", s) for s in SCHEMES] + [("qwen3_5", "int4-g64-asym"), ("qwen3_5", "mixed")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from edgespec.bench.shapes import tiny_config, write_random_checkpoint

    root = tmp_path_factory.mktemp("ct")
    dense = {f: write_random_checkpoint(root / f, tiny_config(f, **SHAPE), seed=5) for f in ("llama", "qwen3_5")}
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(family: str, scheme: str) -> tuple[Path, Path]:
        if (family, scheme) not in made:
            made[family, scheme] = write_ct(dense[family], root / f"{family}-{scheme}",
                                            root / f"{family}-{scheme}-ref", scheme)
        return made[family, scheme]
    return get


def _formats(model) -> set[str]:
    return {m.weight.format for m in model.modules() if isinstance(m, PackedLinear)}


@pytest.mark.parametrize("family, scheme", CASES)
def test_logits_match_library_dequantized(checkpoints, family, scheme):
    qdir, rdir = checkpoints(family, scheme)
    model = load_target(qdir, max_positions=64)
    ref = load_target(rdir, max_positions=64)
    assert _formats(model) == FORMAT[scheme]
    layers = model.model.layers
    assert isinstance(model.lm_head, Linear) and not isinstance(model.lm_head, PackedLinear)   # ignored
    if scheme == "mixed":
        # ignore by exact name and by regex, per-group targets: each module has its own format.
        assert isinstance(layers[0].mlp.down_proj, Linear)
        assert layers[1].mlp.down_proj.weight.format == "int4"
        attn = layers[3].self_attn if family == "qwen3_5" else layers[0].self_attn
        assert {m.weight.format for m in attn.modules() if isinstance(m, PackedLinear)} == {"fp8_row"}
    if family == "qwen3_5":
        gdn = layers[0].linear_attn
        assert any(isinstance(m, Linear) for m in gdn.modules())    # the ignored a/b gates stay in 16 bits
    toks = torch.tensor(prompt_ids(model.config.vocab_size, n=12))
    tol = 2e-4 if family == "qwen3_5" else 1e-4     # the GDN recurrence amplifies fp32 summation order
    with torch.inference_mode():
        cache_q, cache_r = model.new_cache(64), ref.new_cache(64)
        torch.testing.assert_close(model.forward(toks, cache_q).logits, ref.forward(toks, cache_r).logits,
                                   rtol=tol, atol=tol)
        torch.testing.assert_close(model.decode(torch.tensor([3]), cache_q), ref.decode(torch.tensor([3]), cache_r),
                                   rtol=tol, atol=tol)


@pytest.mark.parametrize("family, scheme", [("llama", "nvfp4"), ("llama", "int4-g64-asym"), ("qwen3_5", "mixed")])
def test_greedy_speculative_equals_plain(checkpoints, family, scheme):
    model = load_target(checkpoints(family, scheme)[0], max_positions=256)
    vocab = model.config.vocab_size
    prompt = prompt_ids(vocab, n=19, seed=4)
    plain = plain_greedy(model, prompt, 14)
    for prop in (NGramProposer(), OracleProposer(plain, vocab, seed=1)):
        s = SpecSession.with_defaults(model, select_hooks("base", CPU), prop, k=4, kv_fp8=False, max_len=128)
        assert s.generate(prompt, max_tokens=14, policy=StrictGreedy()).token_ids == plain


def _group0(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]


@pytest.mark.parametrize("change, match", [
    (lambda qc: _group0(qc)["weights"].update(actorder="group"), "actorder 'group'.*act-order"),
    (lambda qc: _group0(qc)["weights"].update(num_bits=2), "pack-quantized int2 is not supported.*2/3/8-bit"),
    (lambda qc: _group0(qc)["weights"].update(num_bits=3), "pack-quantized int3 is not supported"),
    (lambda qc: _group0(qc)["weights"].update(strategy="tensor"), "int4 strategy 'tensor'"),
    (lambda qc: _group0(qc).update(format="marlin-24"), "format 'marlin-24' is not supported"),
    (lambda qc: qc.update(kv_cache_scheme={"type": "int", "num_bits": 8}), "kv_cache_scheme: int8"),
    (lambda qc: qc.pop("config_groups"), "without config_groups"),
])
def test_unsupported_configs_are_named(checkpoints, tmp_path, change, match):
    import shutil
    folder = shutil.copytree(checkpoints("llama", "int4-g32-sym")[0], tmp_path / "m")
    with pytest.raises(UnsupportedModelError, match=match):
        load_target(edit_config(folder, change))


def test_quantized_module_the_config_ignores_is_refused(checkpoints, tmp_path):
    import shutil
    folder = shutil.copytree(checkpoints("llama", "int4-g32-sym")[0], tmp_path / "m")
    edit_config(folder, lambda qc: qc["ignore"].append("re:.*layers\\.1\\.mlp\\.up_proj$"))
    with pytest.raises(CheckpointError, match="layer model.layers.1.mlp.up_proj has quantized tensors but the "
                                              "config leaves it unquantized"):
        load_target(folder)


def test_config_parsing_notes_and_wrapped_names():
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g": {"targets": ["re:.*self_attn.*"], "weights": {"type": "float", "num_bits": 8,
                                                                              "strategy": "channel"},
                                  "input_activations": {"type": "float", "num_bits": 8, "dynamic": True}}},
          "ignore": ["model.language_model.layers.0.self_attn.o_proj"],
          "kv_cache_scheme": {"type": "float", "num_bits": 8}}
    spec = parse_quant_config({"quantization_config": qc})
    assert spec.kv_cache == "fp8" and "served unquantized (weight-only)" in spec.notes[0]
    assert spec.scheme_for("model.layers.0.self_attn.q_proj").fmt == "fp8_row"
    assert spec.scheme_for("model.layers.0.self_attn.o_proj") is None       # ignored under its VLM name
    assert spec.scheme_for("model.layers.0.mlp.up_proj") is None            # no group targets it


def test_load_holds_the_packed_weights_not_a_dense_copy(tmp_path):
    """Peak host memory of loading a ~240 MB (as fp32) int4 compressed-tensors model: the packed weights, the
    staging buffer and one layer's repack, far below the dense model."""
    from test_load_memory import MiB, _measure

    from edgespec.bench.shapes import config_dict, write_random_checkpoint
    from edgespec.loading.safetensors_io import STAGING_BYTES

    cfg = config_dict(model_type="llama", vocab_size=8192, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
    dense = write_random_checkpoint(tmp_path / "dense", cfg, seed=0)
    qdir, _ = write_ct(dense, tmp_path / "q", tmp_path / "ref", "int4-g128-sym")
    r = _measure(qdir, "float32")
    repack = 16 * 2816 * 1024        # the largest layer's codes unpacked to int64 on the host, twice
    limit = r["weights"] + STAGING_BYTES + repack + 48 * MiB
    dense_bytes = sum(p.stat().st_size for p in dense.glob("*.safetensors"))
    assert limit < dense_bytes and r["growth"] <= limit, (r["growth"] / MiB, limit / MiB, dense_bytes / MiB)
