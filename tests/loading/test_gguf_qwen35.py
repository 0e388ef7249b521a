"""Qwen3.5 hybrid GGUFs (llama.cpp's ``qwen35``) read in the file's own value-head order.

A tiny random qwen3_5 checkpoint (2 key heads, 4 value heads: the converter's V-head reorder applies) is written as
a GGUF the way llama.cpp's converter writes it (tests/gguf_qwen35_files.py, gguf-py), and the native loader must
give transformers' logits: F32 against the checkpoint itself, Q8_0 (packed, the compiled CPU products, out_proj's
permuted columns in their quantized blocks) against transformers on the weights the file holds. Speculative output
equals plain output; tokenizer and chat template come from the GGUF.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from gguf_qwen35_files import write_qwen35_gguf  # noqa: E402

from edgespec.bench.shapes import tiny_config, write_random_checkpoint  # noqa: E402
from edgespec.errors import CheckpointError  # noqa: E402
from edgespec.loading.gguf_model import load_gguf_target  # noqa: E402
from edgespec.weights.base import PackedLinear  # noqa: E402


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    from edgespec.kernels.quant.linear import configure_cpu, cpu_blas_active
    was_active = cpu_blas_active()
    configure_cpu(False)            # transformers' summation order (see tests/models/test_golden.py)
    yield
    if was_active:
        configure_cpu(True)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("q35") / "hf", tiny_config("qwen3_5"), seed=3)


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory) -> Path:
    """Every matrix input a whole number of 256-weight super-blocks (K-quants), out_proj's included."""
    cfg = tiny_config("qwen3_5", hidden_size=256, intermediate_size=512, head_dim=64, linear_key_head_dim=32,
                      linear_value_head_dim=64)
    return write_random_checkpoint(tmp_path_factory.mktemp("q35w") / "hf", cfg, seed=4)


def _hf_logits(folder: Path, ids: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if state is not None:
        missing, unexpected = hf.load_state_dict(state, strict=False)
        assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    with torch.no_grad():
        return hf(ids[None]).logits[0]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.forward(ids, model.new_cache(128)).logits


IDS = torch.tensor([1, 5, 200, 7, 99, 3, 42, 17, 250, 64, 2, 8] * 6)       # 72 rows: the chunked GDN crosses 64


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_K"])
def test_qwen35_gguf_matches_transformers(hf_folder: Path, wide_folder: Path, tmp_path: Path, qtype: str) -> None:
    if qtype == "Q4_K":
        hf_folder = wide_folder
    path, oracle = write_qwen35_gguf(hf_folder, tmp_path / f"m-{qtype}.gguf", qtype)
    model, folder = load_gguf_target(path, max_positions=256)
    cfg = model.config
    assert cfg.linear_value_head_order == "tiled" and cfg.linear_num_value_heads == 2 * cfg.linear_num_key_heads
    assert cfg.layer_types == transformers.AutoConfig.from_pretrained(hf_folder).layer_types
    packed = {n: m.weight.format for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    if qtype != "F32":      # every matrix served from its blocks as stored, out_proj included
        assert packed["model.layers.0.linear_attn.out_proj"] == f"gguf_{qtype.lower()}"
        assert len(packed) >= 4 * cfg.num_hidden_layers
    else:
        assert not packed
    ours = _logits(model, IDS)
    ref = _hf_logits(hf_folder, IDS, oracle if qtype != "F32" else None)
    assert (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    # the head order matters: the same tensors paired as HF pairs them give another model
    model.config.linear_value_head_order = "grouped"
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.tile_keys = 1
    assert (_logits(model, IDS) - ref).abs().max().item() > 1e-2


def test_qwen35_gguf_speculative_equals_plain_and_reads_its_tokenizer(hf_folder: Path, tmp_path: Path) -> None:
    from edgespec.config import Settings
    from edgespec.engine import Engine
    from edgespec.kernels.quant.linear import configure_cpu
    from edgespec.plan import build_plan
    from edgespec.speculative.acceptance import StrictGreedy

    path, _ = write_qwen35_gguf(hf_folder, tmp_path / "m.gguf", "Q8_0", mtp_layers=1)
    engine = Engine.load(build_plan(Settings(model=str(path), drafter="ngram", num_draft_tokens=4, max_seq_len=128)))
    assert engine.model.config.num_hidden_layers == 6          # the appended MTP layer is not a decoder layer
    chat = engine.tokenizer.encode_chat([{"role": "user", "content": "the robot"}])
    text = engine.tokenizer.decode(chat, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\nthe robot<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    ids = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    plain = engine.session.generate(ids, max_tokens=16, policy=StrictGreedy(), stop_ids=[], k=0)
    spec = engine.session.generate(ids, max_tokens=16, policy=StrictGreedy(), stop_ids=[], k=None)
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 16
    configure_cpu(False)


def test_qwen35_pre_tokenizer_keeps_combining_marks() -> None:
    """llama.cpp's "qwen35" split keeps a combining mark with its letters (Qwen2's splits it off)."""
    from tokenizers import Regex, pre_tokenizers

    from edgespec.loading.gguf_meta import _SPLITS

    word = "cafe\u0301 au lait"
    pieces = {pre: [p for p, _ in pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated")
                    .pre_tokenize_str(word)] for pre in ("qwen35", "qwen2")}
    assert pieces["qwen35"][0] == "cafe\u0301"
    assert pieces["qwen2"][0] == "cafe"


def test_damaged_qwen35_tensors_are_named(hf_folder: Path, tmp_path: Path) -> None:
    path, _ = write_qwen35_gguf(hf_folder, tmp_path / "bad.gguf", "F32", bad_a=True)
    with pytest.raises(CheckpointError, match=r"blk\.0\.ssm_a: A = -exp\(A_log\) must be negative"):
        load_gguf_target(path)


def test_bad_value_head_order_is_named(tmp_path: Path) -> None:
    from edgespec.loading.hf_config import parse_config

    with pytest.raises(CheckpointError, match="linear_value_head_order 'sideways' must be 'grouped' or 'tiled'"):
        parse_config(tiny_config("qwen3_5", linear_value_head_order="sideways"))


def test_qwen35_fp32_conversion_equals_the_native_load(hf_folder: Path, tmp_path: Path) -> None:
    """``edgespec convert --gguf`` of a qwen35 file (norms, A, conv and the MTP layer handled as the native loader
    does; the tiled head order kept in its config) loads as the same model."""
    from edgespec.convert.gguf import convert_gguf
    from edgespec.loading.checkpoint import load_target

    path, _ = write_qwen35_gguf(hf_folder, tmp_path / "m.gguf", "Q8_0", mtp_layers=1)
    native, _ = load_gguf_target(path, max_positions=256)
    dense = load_target(convert_gguf(path, tmp_path / "fp32"), max_positions=256)
    assert dense.config.linear_value_head_order == "tiled"
    a, b = _logits(native, IDS), _logits(dense, IDS)
    # (the packed Q8_0 products sum in another order than the dense matmul; the GDN recurrence amplifies it)
    assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())
