"""GGUF weights served in their own blocks (edgespec.weights.gguf, edgespec.loading.gguf_model).

Oracles: gguf-py's own dequantisation for the block decoding; the fp32 conversion of the same file
(edgespec convert) for the whole model's logits; plain greedy decoding for speculative output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import write_tiny_gguf

from edgespec.convert.gguf import convert_gguf
from edgespec.errors import CheckpointError, UnsupportedModelError
from edgespec.kernels.cpu import gguf_native
from edgespec.loading.checkpoint import load_target
from edgespec.loading.gguf_model import PackedEmbedding, load_gguf_target
from edgespec.memory import module_bytes
from edgespec.weights.base import PackedLinear, weight_format
from edgespec.weights.gguf import GGML_FORMATS, GGUFBlockWeight, Q4_0Weight, Q4_1Weight, Q8_0Weight

FORMATS = ["Q4_0", "Q4_1", "Q8_0"]
native = pytest.mark.skipif(gguf_native.library() is None, reason="the GGUF C product cannot be built here")


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))


def _blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(quantized bytes, gguf-py's dequantisation of them)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    qt = getattr(Q, qtype)
    packed = quants.quantize(data, qt)
    return packed, quants.dequantize(packed, qt)


# ---- block formats -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", FORMATS)
def test_decoding_equals_gguf_py(qtype: str) -> None:
    packed, ref = _blocks(qtype, 70, 96)
    cls = {"Q4_0": Q4_0Weight, "Q4_1": Q4_1Weight, "Q8_0": Q8_0Weight}[qtype]
    w = cls(torch.from_numpy(packed.copy()), 70, 96)
    assert weight_format(cls.format) is cls and GGML_FORMATS[cls.ggml_type] is cls
    assert torch.equal(w.dequantize(torch.float32), torch.from_numpy(ref))
    assert torch.equal(w.dequantize_rows(5, 9, torch.float32), torch.from_numpy(ref[5:9]))
    idx = torch.tensor([[3, 0], [69, 3]])
    assert torch.equal(w.rows(idx), torch.from_numpy(ref)[idx])
    assert w.nbytes == packed.size


@native
@pytest.mark.parametrize("qtype", FORMATS)
def test_compiled_product_matches_reference_and_is_row_count_independent(qtype: str) -> None:
    packed, _ = _blocks(qtype, 203, 160, seed=1)   # 203 rows: a partial 16-row chunk at the end
    w = GGML_FORMATS[{"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}[qtype]](torch.from_numpy(packed.copy()), 203, 160)
    x = torch.randn(11, 160)
    with torch.inference_mode():
        assert w.fast_product(x)
        fast = w.matmul(x)
        ref = w.matmul_ref(x)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-4)
        # every row equals a one-row product bit for bit (verify rows == decode steps), for any row count
        for m in (1, 2, 3, 4, 5, 8, 11):
            part = w.matmul(x[:m])
            assert torch.equal(part, fast[:m]), m
        bias = torch.randn(203)
        assert torch.equal(w.matmul(x[:2], bias), fast[:2] + bias)


def test_reference_fallback_without_the_compiled_product(monkeypatch: pytest.MonkeyPatch) -> None:
    packed, ref = _blocks("Q4_1", 40, 64)
    w = Q4_1Weight(torch.from_numpy(packed.copy()), 40, 64)
    monkeypatch.setattr(gguf_native, "_tried", True)
    monkeypatch.setattr(gguf_native, "_lib", None)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert not w.fast_product(x)
        torch.testing.assert_close(w.matmul(x), x @ torch.from_numpy(ref).T, rtol=1e-5, atol=1e-5)


def test_bad_block_buffer_is_named() -> None:
    with pytest.raises(ValueError, match="gguf_q8_0: blocks must be uint8"):
        Q8_0Weight(torch.zeros(4, 33, dtype=torch.uint8), 4, 32)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        Q4_0Weight(torch.zeros(4, 18, dtype=torch.uint8), 4, 40)


# ---- whole models ------------------------------------------------------------------------------------------


def _logits_and_steps(model, ids: torch.Tensor, steps: int = 4) -> list[torch.Tensor]:
    cache = model.new_cache(128)
    out = [model.forward(ids, cache).logits]
    token = out[0][-1].argmax()
    for _ in range(steps):
        logits = model.decode(token.view(1), cache)
        out.append(logits[None])
        token = logits.argmax()
    return out


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_equals_fp32_conversion(tmp_path: Path, qtype: str, tied: bool) -> None:
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype, tied=tied)
    packed, folder = load_gguf_target(path, max_positions=256)
    layer = packed.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear) and isinstance(layer.mlp.gate_up_proj, PackedLinear)
    assert isinstance(packed.model.embed_tokens, PackedEmbedding)
    assert (packed.lm_head is None) == tied
    dense = load_target(convert_gguf(path, tmp_path / "fp32"), max_positions=256)
    ids = torch.tensor([1, 5, 260, 7, 99, 3, 42, 200, 17])
    got, want = _logits_and_steps(packed, ids), _logits_and_steps(dense, ids)
    for a, b in zip(got, want, strict=True):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 1e-5 * scale + 1e-6
    assert (folder / "tokenizer.json").is_file() and not (folder / "model.safetensors").exists()
    # The memory budget `bench` prints beside its figures counts the packed blocks the model holds.
    assert packed.memory_budget.weights == module_bytes(packed) < module_bytes(dense)


def test_packed_weights_are_views_of_the_file(tmp_path: Path) -> None:
    """Served as stored: every packed weight but the merged q/k/v (q and k rows reordered) views the one mapping
    of the file, gate/up (adjacent in the file) included -- no copy of the blocks."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_1", tied=True)
    model, _ = load_gguf_target(path, max_positions=64)
    size = path.stat().st_size
    views = {name: mod.weight.blocks.untyped_storage().nbytes() == size for name, mod in model.named_modules()
             if isinstance(getattr(mod, "weight", None), GGUFBlockWeight)}
    assert views and all(ok != name.endswith("qkv_proj") for name, ok in views.items()), views


def test_loading_imports_no_compiler_stack(tmp_path: Path) -> None:
    """Building on the meta device and materialising must not pull in torch._dynamo / sympy / triton (about
    140 MB resident for the process: the rotary tables under the meta device did, and empty_like of a meta
    tensor imports sympy)."""
    import os
    import subprocess
    import sys

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_1", tied=True)
    code = ("import sys, torch\n"
            "from edgespec.loading.gguf_model import load_gguf_target\n"
            "model, _ = load_gguf_target(sys.argv[1], max_positions=64)\n"
            "model.forward(torch.tensor([1, 2, 3]), model.new_cache(64))\n"
            "print(sorted(m for m in ('sympy', 'torch._dynamo', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "EDGESPEC_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("adjacent", [True, False])
def test_cat_of_adjacent_parts_is_a_view(adjacent: bool) -> None:
    packed, _ = _blocks("Q4_1", 48, 64)
    store = torch.from_numpy(packed.copy())
    parts = [store[:16], store[16:48]] if adjacent else [store[16:48], store[:16]]
    merged = Q4_1Weight.cat([Q4_1Weight(p, p.shape[0], 64) for p in parts])
    assert torch.equal(merged.blocks, torch.cat(parts))
    assert (merged.blocks.data_ptr() == store.data_ptr()) == adjacent     # a view only where the bytes run on


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_speculative_equals_plain_on_a_packed_gguf(tmp_path: Path, qtype: str) -> None:
    from edgespec.config import Settings
    from edgespec.engine import Engine
    from edgespec.plan import build_plan
    from edgespec.speculative.acceptance import StrictGreedy

    path = write_tiny_gguf(tmp_path / "tiny.gguf", qtype, embed_qtype=qtype)
    engine = Engine.load(build_plan(Settings(model=str(path), drafter="ngram", num_draft_tokens=5, max_seq_len=256)))
    assert isinstance(engine.model.model.layers[1].mlp.down_proj, PackedLinear)
    ids = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    plain = engine.session.generate(ids, max_tokens=40, policy=StrictGreedy(), stop_ids=[], k=0)
    spec = engine.session.generate(ids, max_tokens=40, policy=StrictGreedy(), stop_ids=[], k=None)
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 40
    # The packed products run on their own pool: OpenBLAS (a dense drafter's products) keeps to one thread.
    from threadpoolctl import threadpool_info
    assert all(p["num_threads"] == 1 for p in threadpool_info() if p["user_api"] == "blas")
    from edgespec.kernels.quant.linear import configure_cpu
    configure_cpu(False)


def test_gguf_weights_fp32_setting_converts(tmp_path: Path) -> None:
    from edgespec.config import Settings
    from edgespec.engine import Engine
    from edgespec.plan import build_plan

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_1")
    engine = Engine.load(build_plan(Settings(model=str(path), gguf_weights="fp32", max_seq_len=64)))
    assert not any(isinstance(m, PackedLinear) for m in engine.model.modules())
    assert (engine.model_dir / "model.safetensors").is_file()


# ---- bad input ---------------------------------------------------------------------------------------------


def test_truncated_gguf_is_named(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_1")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 3000])
    with pytest.raises(CheckpointError, match="tiny.gguf"):
        load_gguf_target(path)


def test_missing_gguf_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="GGUF file not found"):
        load_gguf_target(tmp_path / "absent.gguf")


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_1", arch="qwen2")
    with pytest.raises(UnsupportedModelError, match="architecture 'qwen2'"):
        load_gguf_target(path)


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q5_0")
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_q\.weight is Q5_0.*Q4_0, Q4_1"):
        load_gguf_target(path)


def test_budget_counts_the_drafter(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    model, _ = load_gguf_target(path, max_positions=64, drafter_bytes=12345)
    assert model.memory_budget.drafter == 12345
