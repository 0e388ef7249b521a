"""GGUF K-quants (Q4_K, Q5_K, Q6_K) served in their own super-blocks, and llama.cpp's Q4_K_M-style mixes.

Oracles: gguf-py's ``quants.dequantize`` for the block decoding (gguf-py cannot quantize to K-quants, so the
blocks are random bytes with sensible fp16 scales: every byte pattern is a valid block); the fp32 conversion of
the same file (``edgespec convert``, which dequantizes with gguf-py) for the model's logits; plain greedy
decoding for speculative output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import write_tiny_gguf

from edgespec.convert.gguf import convert_gguf
from edgespec.errors import UnsupportedModelError
from edgespec.kernels.cpu import gguf_native
from edgespec.loading.checkpoint import load_target
from edgespec.loading.gguf_model import PackedEmbedding, load_gguf_target
from edgespec.weights.base import PackedLinear, weight_format
from edgespec.weights.gguf_kquants import K_FORMATS, Q4_KWeight, random_kquant

KQUANTS = ["Q4_K", "Q5_K", "Q6_K"]
# llama.cpp's Q4_K_M keeps attn_v, ffn_down and the output head in Q6_K; Q5_K stands in for its other picks.
Q4_K_M = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K", "ffn_up": "Q5_K"}
SHAPE = dict(hidden=256, ffn=512)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))


def _weight(kind: str, rows: int, cols: int, seed: int = 0):
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    raw = random_kquant(rows, cols, kind, np.random.default_rng(seed))
    cls = K_FORMATS[int(getattr(Q, kind))]
    return cls(torch.from_numpy(raw.copy()), rows, cols), torch.from_numpy(quants.dequantize(raw, getattr(Q, kind)))


@pytest.mark.parametrize("kind", KQUANTS)
def test_decoding_equals_gguf_py(kind: str) -> None:
    w, ref = _weight(kind, 37, 768)
    assert weight_format(w.format) is type(w) and w.nbytes == w.blocks.numel()
    torch.testing.assert_close(w.dequantize(torch.float32), ref, rtol=0, atol=0)
    torch.testing.assert_close(w.dequantize_rows(5, 21, torch.float32), ref[5:21], rtol=0, atol=0)
    idx = torch.tensor([[3, 0], [36, 3]])
    torch.testing.assert_close(w.rows(idx), ref[idx], rtol=0, atol=0)


@pytest.mark.parametrize("kind", KQUANTS)
def test_products_match_and_are_row_count_independent(kind: str) -> None:
    """The compiled product (CPU, fp32) and the torch reference agree with gguf-py's weights; a verify row rounds
    like the plain decode step of the same token (speculative == plain), in both."""
    w, ref = _weight(kind, 70, 512, seed=1)          # 70 rows: a partial 16-row chunk of the compiled product
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert w.fast_product(x) == (gguf_native.library() is not None)
        for product in (w.matmul, w.matmul_ref):
            batch = product(x)
            for r in range(6):
                assert torch.equal(product(x[r:r + 1])[0], batch[r])
            torch.testing.assert_close(batch, x @ ref.t(), rtol=1e-5, atol=1e-5)


def _logits_and_steps(model, ids: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    cache = model.new_cache(128)
    out = [model.forward(ids, cache).logits]
    token = out[0][-1].argmax()
    for _ in range(steps):
        out.append(model.decode(token.view(1), cache)[None])
        token = out[-1][0].argmax()
    return out


@pytest.mark.parametrize("qtype, mix, tied", [("Q4_K", Q4_K_M, False), ("Q5_K", None, True),
                                              ("Q6_K", None, False)])
def test_packed_model_equals_fp32_conversion(tmp_path: Path, qtype: str, mix, tied: bool) -> None:
    path = write_tiny_gguf(tmp_path / f"{qtype}.gguf", qtype, embed_qtype=qtype, tied=tied, mix=mix, **SHAPE)
    packed, _ = load_gguf_target(path, max_positions=128)
    formats = {m.weight.format for m in packed.modules() if isinstance(m, (PackedLinear, PackedEmbedding))}
    assert formats == ({"gguf_q4_k", "gguf_q5_k", "gguf_q6_k"} if mix else {f"gguf_{qtype.lower()}"})
    dense = load_target(convert_gguf(path, tmp_path / "fp32"), max_positions=128)
    ids = torch.tensor([1, 5, 200, 7, 99, 3, 42])
    with torch.inference_mode():
        for a, b in zip(_logits_and_steps(packed, ids), _logits_and_steps(dense, ids), strict=True):
            assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item() + 1e-6


def test_speculative_equals_plain_on_q4_k_m(tmp_path: Path) -> None:
    from edgespec.config import Settings
    from edgespec.engine import Engine
    from edgespec.kernels.quant.linear import configure_cpu
    from edgespec.plan import build_plan
    from edgespec.speculative.acceptance import StrictGreedy

    path = write_tiny_gguf(tmp_path / "m.gguf", "Q4_K", embed_qtype="Q4_K", tied=False, mix=Q4_K_M, **SHAPE)
    engine = Engine.load(build_plan(Settings(model=str(path), drafter="ngram", num_draft_tokens=4, max_seq_len=128)))
    ids = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    plain = engine.session.generate(ids, max_tokens=16, policy=StrictGreedy(), stop_ids=[], k=0)
    spec = engine.session.generate(ids, max_tokens=16, policy=StrictGreedy(), stop_ids=[], k=None)
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 16
    configure_cpu(False)


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K"])
def test_two_and_three_bit_kquants_are_named(tmp_path: Path, kind: str) -> None:
    path = write_tiny_gguf(tmp_path / "low.gguf", "Q4_K", embed_qtype="Q4_K", mix={"ffn_gate": kind}, **SHAPE)
    with pytest.raises(UnsupportedModelError, match=rf"blk\.0\.ffn_gate\.weight is {kind}.*2- and 3-bit"):
        load_gguf_target(path)


def test_bad_super_block_buffer_is_named() -> None:
    with pytest.raises(ValueError, match="gguf_q4_k: in_features 320 is not a multiple of 256"):
        Q4_KWeight(torch.zeros(4, 180, dtype=torch.uint8), 4, 320)
    with pytest.raises(ValueError, match=r"gguf_q4_k: blocks must be uint8 \[4, 144\]"):
        Q4_KWeight(torch.zeros(4, 140, dtype=torch.uint8), 4, 256)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_q4_k_m_on_the_gpu_matches_the_cpu(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", "Q4_K", embed_qtype="Q4_K", tied=False, mix=Q4_K_M, **SHAPE)
    cpu, _ = load_gguf_target(path, max_positions=128)
    gpu, _ = load_gguf_target(path, max_positions=128, device="cuda")
    ids = torch.tensor([1, 5, 200, 7, 99, 3, 42])
    with torch.inference_mode():
        for a, b in zip(_logits_and_steps(gpu, ids.cuda()), _logits_and_steps(cpu, ids), strict=True):
            assert (a.cpu() - b).abs().max().item() <= 1e-4 * b.abs().max().item() + 1e-5


def test_qwen3_gguf_matches_transformers_and_reads_its_tokenizer(tmp_path: Path) -> None:
    """A qwen3 Q4_K_M GGUF: q/k norms and head_dim from the metadata, rows as the file has them (NeoX RoPE), the
    logits of transformers' Qwen3ForCausalLM on the file's dequantized weights, and the tokenizer and chat
    template of the file (Qwen2's pre-tokenizer splits digits one by one)."""
    from transformers import AutoModelForCausalLM

    from edgespec.loading.tokenizer import ChatTokenizer

    path = write_tiny_gguf(tmp_path / "q3.gguf", "Q4_K", embed_qtype="Q6_K", arch="qwen3", tied=False, mix=Q4_K_M,
                           **SHAPE)
    packed, folder = load_gguf_target(path, max_positions=128, merge=False)
    assert packed.config.model_type == "qwen3"
    assert packed.model.layers[0].self_attn.q_proj.weight.format == "gguf_q4_k"
    hf = AutoModelForCausalLM.from_pretrained(convert_gguf(path, tmp_path / "fp32"), dtype=torch.float32).eval()
    ids = torch.tensor([1, 5, 200, 7, 99, 3, 42])
    with torch.inference_mode():
        got = packed.forward(ids, packed.new_cache(64)).logits
        want = hf(ids[None]).logits[0]
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    tok = ChatTokenizer.from_folder(folder)
    assert [tok.decode([i]) for i in tok.encode("12")] == ["1", "2"]     # llama3's split would merge "12"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_peer_q4_k_m_file_without_tokenizer_benches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tools/peer_gguf.py --q4-k-m writes llama-quantize's Q4_K_M mix with llama.cpp's "none" vocabulary (the peer
    files have no tokenizer): the native loader reads it for benchmarks (Q6_K output and the attn_v / ffn_down of
    the layers use_more_bits picks, Q4_K elsewhere), ``edgespec.bench.gguf_file`` times it, and serving it names
    the missing tokenizer."""
    import subprocess
    import sys

    import gguf

    from edgespec.bench.gguf_file import main as bench_main
    from edgespec.config import Settings
    from edgespec.engine import Engine
    from edgespec.errors import CheckpointError, ConfigError
    from edgespec.plan import build_plan

    path = tmp_path / "peer.gguf"
    site = str(Path(gguf.__file__).parent.parent)
    subprocess.run([sys.executable, "tools/peer_gguf.py", str(path), "--gguf-py", site, "--q4-k-m", "--hidden", "256",
                    "--layers", "8", "--heads", "4", "--kv-heads", "2", "--ffn", "512", "--vocab", "320"],
                   check=True, capture_output=True, cwd=Path(__file__).resolve().parents[2])
    model, folder = load_gguf_target(path, max_positions=64)
    assert not (folder / "tokenizer.json").exists()
    kinds = {name: m.weight.format for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    # use_more_bits(i, 8): layers 0 and 7, and (i - 1) % 3 == 2 -> layer 3 (and 6)
    assert [i for i in range(8) if kinds[f"model.layers.{i}.mlp.down_proj"] == "gguf_q6_k"] == [0, 3, 6, 7]
    assert kinds["lm_head"] == "gguf_q6_k" and kinds["model.layers.1.mlp.down_proj"] == "gguf_q4_k"
    assert bench_main(["--gguf", str(path), "--context", "16", "--iters", "2", "--verify-rows", "4",
                       "--device", "cpu"]) == 0
    assert "gguf_q4_k x" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="no such file"):
        bench_main(["--gguf", str(tmp_path / "missing.gguf")])
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Engine.load(build_plan(Settings(model=str(path))))
