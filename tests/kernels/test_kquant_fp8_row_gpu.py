"""The GGUF K-quant and per-row FP8 Triton products (``edgespec.kernels.quant.triton_kquant``,
``edgespec.kernels.quant.triton_fp8_row``) on CUDA; skipped cleanly without a GPU or Triton.

Oracles: the CPU decode of the same bytes (the torch reference, bit-equal to gguf-py's ``dequantize`` in
tests/weights/test_gguf_kquants.py): one-hot fp32 activation rows make the product return each weight as the kernel
decoded it, which must equal the CPU's fp32 weight bit for bit (in the 16-row decode launch, with its K split, and
in both prefill paths: decoded bands multiplied by cuBLAS, and the fused 64-row tile); bf16 products against the
fp32 reference within bf16 rounding; a row's result the same bits at any row count (speculative == plain); and a
Q4_K_M model served through the arch hooks: every packed weight on a kernel, speculative output equal to plain
output.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from edgespec.weights.fp8_row import FP8RowWeight
from edgespec.weights.gguf_kquants import K_FORMATS, random_kquant

_READY = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _READY, reason="needs a CUDA device and Triton")]

DEV = "cuda"
KINDS = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def _kquant(kind: str, rows: int, cols: int, seed: int = 0):
    """The same random super-blocks as a CPU weight and a CUDA weight."""
    raw = torch.from_numpy(random_kquant(rows, cols, kind, np.random.default_rng(seed)))
    cls = K_FORMATS[KINDS[kind]]
    return cls(raw.clone(), rows, cols, torch.float32), cls(raw.to(DEV), rows, cols, torch.bfloat16)


def _one_hot_transposed(matmul, packed, cols: int) -> torch.Tensor:
    """``W^T`` as the product computes it: one-hot fp32 rows, 16 at a time (decode launch) -> ``[cols, rows]``."""
    eye = torch.eye(cols, device=DEV)
    return torch.cat([matmul(packed, eye[i:i + 16]) for i in range(0, cols, 16)])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(96, 512), (1000, 1280)])
def test_kquant_decode_is_the_cpu_decode_bit_for_bit(kind: str, shape: tuple[int, int]) -> None:
    from edgespec.kernels.quant.triton_kquant import kquant_matmul
    from edgespec.kernels.quant.triton_kquant_decode import kquant_dequantize_band
    rows, cols = shape
    cpu, gpu = _kquant(kind, rows, cols)
    ref = cpu.dequantize(torch.float32).t()
    eye = torch.eye(cols, device=DEV)
    assert torch.equal(_one_hot_transposed(kquant_matmul, gpu, cols).cpu(), ref), "16-row launch"
    assert torch.equal(kquant_matmul(gpu, eye).cpu(), ref), "prefill: decoded bands, cuBLAS"
    assert torch.equal(kquant_matmul(gpu, eye, config={"DEQUANT": 0}).cpu(), ref), "prefill: fused 64-row tile"
    band = kquant_dequantize_band(gpu, 3, rows - 5, torch.bfloat16)
    assert torch.equal(band.cpu(), ref.t()[3:rows - 5].to(torch.bfloat16)), "bf16 band: one rounding"


@pytest.mark.parametrize("kind", KINDS)
def test_kquant_bf16_products_and_row_count_independence(kind: str) -> None:
    from edgespec.kernels.quant.triton_kquant import kquant_matmul
    cpu, gpu = _kquant(kind, 768, 2048, seed=1)
    w = cpu.dequantize(torch.float32).to(DEV)
    bias = torch.randn(768, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(100, 2048, device=DEV, dtype=torch.bfloat16)
    for m in (1, 7, 16, 40, 100):
        ref = x[:m].float() @ w.t() + bias.float()
        assert rel_err(kquant_matmul(gpu, x[:m], bias), ref) < 1e-2, m
    # the tiles' launches (up to 64 rows, past the CUDA-core GEMV's: tests/kernels/test_kquant_gemv_gpu.py): row 0
    # gives the same bits at every row count
    one = kquant_matmul(gpu, x[:1], config={"TILES": 1})
    for m in (5, 8, 16, 40):
        assert torch.equal(kquant_matmul(gpu, x[:m])[:1], one), m


def test_fp8_row_product_is_the_reference_weight_and_bf16_matches() -> None:
    from edgespec.kernels.quant.triton_fp8_row import choose_fp8_row_kernel, fp8_row_matmul
    for rows, cols in ((96, 512), (1000, 1000)):       # 1000: a ragged last K tile
        w = FP8RowWeight.quantize(torch.randn(rows, cols, device=DEV) * 0.05, torch.bfloat16)
        ref = w.dequantize(torch.float32)
        assert torch.equal(_one_hot_transposed(fp8_row_matmul, w, cols), ref.t())
        assert torch.equal(fp8_row_matmul(w, torch.eye(cols, device=DEV)), ref.t())
        x = torch.randn(100, cols, device=DEV, dtype=torch.bfloat16)
        for m in (1, 5, 16, 40, 100):
            assert rel_err(fp8_row_matmul(w, x[:m]), x[:m].float() @ ref.t()) < 1e-2, (rows, m)
        assert torch.equal(fp8_row_matmul(w, x[:16])[:1], fp8_row_matmul(w, x[:1]))
    assert choose_fp8_row_kernel(w) is not None
    assert choose_fp8_row_kernel(FP8RowWeight.quantize(torch.randn(64, 256))) is None    # CPU weight: none


def test_kernels_replay_in_a_cuda_graph() -> None:
    from edgespec.kernels.quant.triton_fp8_row import choose_fp8_row_kernel
    from edgespec.kernels.quant.triton_kquant import choose_kquant_kernel
    _, q4 = _kquant("Q4_K", 256, 512)
    f8 = FP8RowWeight.quantize(torch.randn(256, 512, device=DEV) * 0.05, torch.bfloat16)
    for packed, kern in ((q4, choose_kquant_kernel(q4)), (f8, choose_fp8_row_kernel(f8))):
        assert kern is not None
        x = torch.randn(4, 512, device=DEV, dtype=torch.bfloat16)
        kern(packed, x, None)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = kern(packed, x, None)
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, packed.matmul_ref(x.float())) < 1e-2


def test_q4_k_m_gguf_served_on_the_kernels_stays_lossless(tmp_path, monkeypatch) -> None:
    """A Q4_K_M-style GGUF (Q4_K, Q5_K and Q6_K tensors) loaded on CUDA in bf16: the arch hooks put every packed
    matrix on the K-quant kernels, logits agree with the torch reference product, and speculative output (oracle and
    n-gram drafters) equals plain output."""
    from gguf_files import write_tiny_gguf
    from test_spec_lossless import OracleProposer

    from edgespec.arch.detect import select_hooks
    from edgespec.drafters.ngram import NGramProposer
    from edgespec.kernels.quant.triton_kquant import kquant_kernel
    from edgespec.loading.gguf_model import load_gguf_target
    from edgespec.speculative.acceptance import StrictGreedy
    from edgespec.speculative.parity import lossless
    from edgespec.speculative.session import SpecSession
    from edgespec.weights.base import PackedLinear

    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    mix = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K", "ffn_up": "Q5_K"}
    path = write_tiny_gguf(tmp_path / "m.gguf", "Q4_K", embed_qtype="Q4_K", tied=False, mix=mix, hidden=256,
                           ffn=512)
    model, _ = load_gguf_target(path, dtype=torch.bfloat16, device=DEV, max_positions=256)
    hooks = select_hooks("rtx", torch.device(DEV))
    linears = [m.weight for m in model.modules() if isinstance(m, PackedLinear)]
    assert hooks.choose_weight_kernels(model) >= len(linears) > 0
    assert all(w.kernel is kquant_kernel for w in linears)
    toks = torch.tensor([1, 5, 200, 7, 99, 3, 42, 17], device=DEV)
    fast = model.forward(toks, model.new_cache(64)).logits
    for w in linears:
        w.kernel = None
    ref = model.forward(toks, model.new_cache(64)).logits
    assert (fast - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    vocab = model.config.vocab_size
    prompt = [1, 5, 200, 7, 99, 3, 42, 17, 1, 5, 200, 7]
    plain = SpecSession.with_defaults(model, select_hooks("rtx", torch.device(DEV)), None, max_len=128).generate(
        prompt, max_tokens=24, policy=StrictGreedy()).token_ids
    for prop in (OracleProposer(plain, vocab, seed=5), NGramProposer()):
        s = SpecSession.with_defaults(model, select_hooks("rtx", torch.device(DEV)), prop, k=7, max_len=128)
        out = s.generate(prompt, max_tokens=24, policy=StrictGreedy())
        assert lossless(model, prompt, plain, out.token_ids, kv_fp8=s.kv_fp8), type(prop).__name__
