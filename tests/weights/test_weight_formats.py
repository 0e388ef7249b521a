"""Quantized checkpoints (block-FP8, NVFP4, AWQ, GPTQ v1/v2) load natively and compute what their tensors mean.

Each format's tiny checkpoint is written here in the public layout (tests/quant_layouts.py packs it with plain
loops, independently of edgespec's repacking) together with a dense fp32 checkpoint of the dequantized matrices:
the packed model's logits must equal that reference model's, packed layers must stay packed (never widened), and
greedy speculative output must equal plain output for n-gram, MTP and DFlash on every format.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_layouts import FORMATS, awq_layer, fp8_layer, gptq_layer, nvfp4_layer, write_quantized
from safetensors.torch import load_file, save_file
from test_dflash import MixedProposer, make_drafter, plain_greedy, prompt_ids
from test_spec_lossless import OracleProposer

from edgespec.arch.detect import select_hooks
from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.drafters.dflash import load_dflash_checkpoint
from edgespec.drafters.mtp import MTPProposer
from edgespec.drafters.ngram import NGramProposer
from edgespec.errors import CheckpointError, UnsupportedModelError
from edgespec.loading.checkpoint import load_target
from edgespec.loading.quant_config import parse_quant_config
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession
from edgespec.weights import PackedLinear, weight_format
from edgespec.weights.fp8_block import FP8BlockWeight
from edgespec.weights.int4 import Int4Weight
from edgespec.weights.nvfp4 import NVFP4Weight

CPU = torch.device("cpu")
_CLASS = {"fp8": FP8BlockWeight, "nvfp4": NVFP4Weight, "awq": Int4Weight, "gptq": Int4Weight,
          "gptq_v2": Int4Weight}


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense")
    return {"llama": write_random_checkpoint(root / "llama", tiny_config("llama"), seed=11),
            "qwen3_5": write_random_checkpoint(root / "q35", tiny_config("qwen3_5"), seed=12, with_mtp=True)}


@pytest.fixture(scope="module")
def quantized(dense_dirs, tmp_path_factory):
    """(quantized folder, reference folder) per (family, format), written on first use."""
    root = tmp_path_factory.mktemp("quant")
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(family: str, fmt: str) -> tuple[Path, Path]:
        if (family, fmt) not in made:
            made[family, fmt] = write_quantized(dense_dirs[family], root / f"{family}-{fmt}",
                                                root / f"{family}-{fmt}-ref", fmt, seed=len(fmt))
        return made[family, fmt]
    return get


# ---- one layer of each layout: the repacked buffers dequantize to what the file means -------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_layer_layouts_dequantize_exactly(fmt, tmp_path):
    gen = torch.Generator().manual_seed(3)
    shape = (48, 256)
    parts, dense = {"fp8": lambda: fp8_layer(shape, gen), "nvfp4": lambda: nvfp4_layer(shape, gen),
                    "awq": lambda: awq_layer(shape, gen, 64), "gptq": lambda: gptq_layer(shape, gen, 64),
                    "gptq_v2": lambda: gptq_layer(shape, gen, 64, v2=True)}[fmt]()
    from edgespec.loading.quant_config import QuantSpec
    from edgespec.loading.quantized import packed_slots
    from edgespec.loading.safetensors_io import fill_slots, read_headers

    method = {"fp8": "fp8_block", "gptq_v2": "gptq"}.get(fmt, fmt)
    spec = QuantSpec(method, "test", group_size=64, zeros_minus_one=fmt == "gptq")
    packed = {"fp8_block": FP8BlockWeight(*shape, torch.float32), "nvfp4": NVFP4Weight(*shape, torch.float32)}.get(
        method) or Int4Weight(*shape, torch.float32, 64)
    layer = PackedLinear(packed)
    save_file({f"l.{k}": v.contiguous() for k, v in parts.items()}, str(tmp_path / "l.safetensors"))
    slots = packed_slots("l", layer, spec)
    problems = fill_slots(slots, read_headers([tmp_path / "l.safetensors"]),
                          lambda k: None if k.endswith("input_scale") else k)
    assert problems == []
    torch.testing.assert_close(packed.dequantize(torch.float32), dense, rtol=1e-6, atol=0)
    x = torch.randn(3, shape[1], generator=gen)
    torch.testing.assert_close(layer(x), x @ dense.t(), rtol=1e-5, atol=1e-5)
    for lo, hi in ((0, 1), (5, 21), (17, 48)):
        torch.testing.assert_close(packed.dequantize_rows(lo, hi, torch.float32), dense[lo:hi], rtol=1e-6, atol=0)


@pytest.mark.parametrize("cls", [FP8BlockWeight, NVFP4Weight, Int4Weight])
def test_cat_stacks_rows_or_refuses(cls):
    gen = torch.Generator().manual_seed(1)
    parts = [cls.quantize(torch.randn(n, 256, generator=gen)) for n in (256, 128, 64)]
    merged = cls.cat(parts)
    if cls is NVFP4Weight:
        assert merged is None                         # three different global scales: kept separate
        amax = torch.tensor(4.0)
        parts = [NVFP4Weight.quantize(torch.randn(n, 256, generator=gen), global_amax=amax) for n in (256, 64)]
        merged = cls.cat(parts)
    assert merged is not None and merged.format == cls.format
    torch.testing.assert_close(merged.dequantize(), torch.cat([p.dequantize() for p in parts]), rtol=0, atol=0)
    if cls is FP8BlockWeight:                         # a part ending inside a 128-row block cannot be stacked
        assert cls.cat([cls.quantize(torch.randn(64, 256)), cls.quantize(torch.randn(128, 256))]) is None
    assert weight_format(cls.format) is cls


# ---- whole models ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_match_dequantized_reference(quantized, family, fmt):
    qdir, rdir = quantized(family, fmt)
    model = load_target(qdir, max_positions=64)
    ref = load_target(rdir, max_positions=64)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(isinstance(m.weight, _CLASS[fmt]) for m in packed)
    # Never widened: no dense matrix of a quantized layer is held, and the model is smaller than the reference.
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert dense_bytes + sum(m.weight.nbytes for m in packed) < sum(p.numel() * 4 for p in ref.parameters())
    if family == "qwen3_5":
        gdn = model.model.layers[0].linear_attn
        assert isinstance(getattr(gdn, "in_proj_qkv", None) or gdn.in_proj, (PackedLinear, torch.nn.Module))
        assert isinstance(model.mtp.fc, PackedLinear)
    toks = torch.tensor(prompt_ids(model.config.vocab_size, n=12))
    with torch.inference_mode():
        got = model.forward(toks, model.new_cache(64)).logits
        want = ref.forward(toks, ref.new_cache(64)).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        cache_q, cache_r = model.new_cache(64), ref.new_cache(64)
        model.forward(toks, cache_q), ref.forward(toks, cache_r)
        torch.testing.assert_close(model.decode(torch.tensor([3]), cache_q), ref.decode(torch.tensor([3]), cache_r),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_speculative_equals_plain(quantized, dense_dirs, fmt, tmp_path):
    """The losslessness matrix on the weight-format axis: n-gram (llama, qwen3_5), MTP and DFlash (qwen3_5)."""
    n = 14
    for family in ("llama", "qwen3_5"):
        model = load_target(quantized(family, fmt)[0], max_positions=256)
        vocab = model.config.vocab_size
        prompt = prompt_ids(vocab, n=19, seed=4)
        plain = plain_greedy(model, prompt, n)
        for arch in ("base", "thor"):
            for prop in (NGramProposer(), OracleProposer(plain, vocab, seed=len(arch))):
                s = SpecSession.with_defaults(model, select_hooks(arch, CPU), prop, k=4, kv_fp8=False, max_len=128)
                assert s.generate(prompt, max_tokens=n, policy=StrictGreedy()).token_ids == plain, (family, arch)
        if family != "qwen3_5":
            continue
        mtp = MixedProposer(MTPProposer(model, max_len=128), plain, vocab, seed=2)
        s = SpecSession.with_defaults(model, select_hooks("base", CPU), mtp, k=3, max_len=128)
        out = s.generate(prompt, max_tokens=n, policy=StrictGreedy())
        assert out.token_ids == plain and 0 < out.telemetry.accepted_tokens < out.telemetry.draft_tokens
        drafter = make_drafter.write_dflash_drafter(tmp_path / "dflash", dense_dirs[family], seed=1, num_layers=1,
                                                    block_size=5, target_layer_ids=[1, 3])
        prop = MixedProposer(load_dflash_checkpoint(drafter, model, window_size=8), plain, vocab, seed=3)
        s = SpecSession.with_defaults(model, select_hooks("base", CPU), prop, max_len=128)
        assert s.generate(prompt, max_tokens=n, policy=StrictGreedy()).token_ids == plain


# ---- bad input ------------------------------------------------------------------------------------------------
def _edit(folder: Path, tensors=None, config=None) -> Path:
    if tensors is not None:
        t = load_file(str(folder / "model.safetensors"))
        tensors(t)
        save_file(t, str(folder / "model.safetensors"))
    if config is not None:
        c = json.loads((folder / "config.json").read_text())
        config(c)
        (folder / "config.json").write_text(json.dumps(c))
    return folder


def _copy(quantized, family, fmt, tmp_path) -> Path:
    import shutil
    return Path(shutil.copytree(quantized(family, fmt)[0], tmp_path / "copy"))


def test_truncated_quantized_shard(quantized, tmp_path):
    folder = _copy(quantized, "llama", "fp8", tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors.*tensor .* ends at byte .*truncated"):
        load_target(folder)


KEY = "model.layers.1.mlp.up_proj"


@pytest.mark.parametrize("fmt, edit, match", [
    ("fp8", lambda t: t.pop(f"{KEY}.weight_scale_inv"), f"missing key.*{KEY}.weight_scale_inv"),
    ("fp8", lambda t: t.update({f"{KEY}.weight_scale_inv": torch.ones(3, 3)}),
     f"shape mismatch.*{KEY}.weight_scale_inv.*\\(3, 3\\).*128x128"),
    ("nvfp4", lambda t: t.pop(f"{KEY}.weight_scale_2"), f"missing key.*{KEY}.weight_scale_2"),
    ("nvfp4", lambda t: t.update({f"{KEY}.weight_scale": torch.ones(160, 4)}),
     f"shape mismatch.*{KEY}.weight_scale.*dtype float32, expected float8_e4m3fn"),
    ("awq", lambda t: t.pop(f"{KEY}.qzeros"), f"missing key.*{KEY}.qzeros"),
    ("awq", lambda t: t.update({f"{KEY}.scales": torch.ones(1, 160, dtype=torch.float16)}),
     f"{KEY}.scales.*checkpoint \\(1, 160\\), expected \\(2, 160\\)"),
    ("gptq", lambda t: t.update({f"{KEY}.g_idx": torch.arange(64, dtype=torch.int32) % 2}),
     f"{KEY}.g_idx.*not the trivial group order"),
])
def test_bad_tensors_are_named(quantized, tmp_path, fmt, edit, match):
    folder = _edit(_copy(quantized, "llama", fmt, tmp_path), tensors=edit)
    with pytest.raises(CheckpointError, match=match):
        load_target(folder)


def test_fp8_tensor_without_quantization_config_is_refused(quantized, tmp_path):
    folder = _edit(_copy(quantized, "llama", "fp8", tmp_path), config=lambda c: c.pop("quantization_config"),
                   tensors=lambda t: [t.pop(k) for k in list(t) if k.endswith("weight_scale_inv")])
    with pytest.raises(CheckpointError,
                       match="weight in model.safetensors is float8_e4m3fn but its parameter holds float32"):
        load_target(folder)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "bitsandbytes"}, "quantized checkpoint format 'bitsandbytes' is not supported; supported: "
                                       "fp8.*modelopt NVFP4.*awq.*gptq"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}, "gptq with desc_act true"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 32}, "gptq with bits=8"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "fp8", "fmt": "e4m3"}, "per-tensor FP8"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "modelopt 'W4A8_AWQ' is not supported"),
])
def test_unsupported_quantization_configs(quantized, tmp_path, qc, match):
    folder = _edit(_copy(quantized, "llama", "awq", tmp_path), config=lambda c: c.update(quantization_config=qc))
    with pytest.raises(UnsupportedModelError, match=match):
        load_target(folder)


def test_quant_config_forms():
    spec = parse_quant_config({"text_config": {"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "*.a_proj"]}}})
    assert spec.method == "fp8_block" and spec.block == (128, 128)
    assert spec.is_excluded("lm_head") and spec.is_excluded("model.layers.0.a_proj")
    assert not spec.is_excluded("model.layers.0.q_proj")
    assert parse_quant_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                       "desc_act": False}}).zeros_minus_one
    assert not parse_quant_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                           "checkpoint_format": "gptq_v2"}}).zeros_minus_one
    assert parse_quant_config({}) is None
