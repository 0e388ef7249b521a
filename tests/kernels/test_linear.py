"""The CPU linear path (numpy's OpenBLAS) against its torch reference, and when it must stand aside."""

from __future__ import annotations

import shutil

import pytest
import torch

from edgespec.kernels.quant import linear as L
from edgespec.kernels.quant.route import ROWS_MAX


@pytest.fixture
def blas():
    L.configure_cpu()
    assert L.cpu_blas_active()


# Shapes of the demo model (hidden 576, MLP 1536, merged q/k/v 960) plus odd sizes and a block-splitting width.
SHAPES = [(576, 960), (1536, 576), (576, 3072), (37, 129), (300, 5000)]


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 40])
@pytest.mark.parametrize("k_in,n_out", SHAPES)
def test_blas_linear_matches_torch(blas, rows, k_in, n_out):
    x, w, b = torch.randn(rows, k_in), torch.randn(n_out, k_in), torch.randn(n_out)
    with torch.inference_mode():
        got, ref = L.linear(x, w, b), L.linear_ref(x, w, b)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_rows_round_like_one_row_steps(blas, monkeypatch):
    """Up to ROWS_MAX rows, each row is the same GEMV as a one-row call: a verify row equals a decode step bit for
    bit. Blocks are made small here so the multi-row call really splits the weight."""
    monkeypatch.setattr(L, "BLOCK_BYTES", 64 << 10)
    w = torch.randn(3000, 576)
    x = torch.randn(ROWS_MAX, 576)
    with torch.inference_mode():
        together = L.linear(x, w)
        for m in range(x.shape[0]):
            assert torch.equal(together[m], L.linear(x[m:m + 1], w)[0]), m


def test_leading_dims_and_inference_tensors(blas):
    with torch.inference_mode():
        x = torch.randn(2, 3, 64)
        w = torch.randn(80, 64)
        got = L.linear(x, w)
    assert got.shape == (2, 3, 80)
    assert torch.allclose(got, x @ w.t(), atol=1e-5)


def test_falls_back_to_torch_when_it_must(blas):
    w = torch.randn(32, 16, requires_grad=True)
    x = torch.randn(4, 16)
    # autograd on: torch computes (and the gradient flows)
    L.linear(x, w).sum().backward()
    assert w.grad is not None
    with torch.inference_mode():
        # bf16 weights: torch
        wb, xb = w.detach().bfloat16(), x.bfloat16()
        assert torch.equal(L.linear(xb, wb), torch.nn.functional.linear(xb, wb))
        # torch's pool raised again: the BLAS path stands aside so the two pools never fight
        torch.set_num_threads(2)
        assert not L.cpu_blas_active()
        assert torch.equal(L.linear(x, w.detach()), torch.nn.functional.linear(x, w.detach()))


def test_blas_path_keeps_openblas_to_one_thread():
    """numpy's OpenBLAS pool beside the GGUF product's pool oversubscribes the cores (a 16-row product waited a
    scheduler time slice, 13-27 ms instead of ~1 ms): with that pool, one BLAS thread; off, the previous count."""
    from threadpoolctl import threadpool_info

    def blas_threads() -> list[int]:
        return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]

    L.configure_cpu(False)
    before = blas_threads()
    L.configure_cpu()
    assert blas_threads() == before          # a dense model: OpenBLAS's own threads run its GEMVs
    L.configure_cpu(own_pool=True)
    assert blas_threads() and all(n == 1 for n in blas_threads())
    L.configure_cpu(False)
    assert blas_threads() == before


def test_disabled_by_default_and_by_setting():
    L.configure_cpu(False)
    assert not L.cpu_blas_active()


def test_engine_turns_it_on_for_fp32_cpu_only(tiny_checkpoints, tmp_path):
    from edgespec.bench.shapes import write_chat_tokenizer
    from edgespec.config import load_settings
    from edgespec.engine import Engine
    from edgespec.plan import build_plan

    folder = shutil.copytree(tiny_checkpoints["llama"], tmp_path / "llama")
    write_chat_tokenizer(folder)
    L.configure_cpu(False)
    Engine.load(build_plan(load_settings(cli=None).with_overrides(model=str(folder), cpu_blas=False)))
    assert not L.cpu_blas_active()
    Engine.load(build_plan(load_settings(cli=None).with_overrides(model=str(folder), dtype="bfloat16")))
    assert not L.cpu_blas_active()
    Engine.load(build_plan(load_settings(cli=None).with_overrides(model=str(folder))))
    assert L.cpu_blas_active() and torch.get_num_threads() == 1


def test_served_model_on_blas_matches_torch_path(tiny_models):
    """Whole tiny models (merged projections, as served) agree on the two paths."""
    gen = torch.Generator().manual_seed(3)
    for family, model in tiny_models.items():
        ids = torch.randint(0, model.config.vocab_size, (24,), generator=gen)
        L.configure_cpu(False)
        ref = model.forward(ids, model.new_cache(32)).logits
        L.configure_cpu()
        got = model.forward(ids, model.new_cache(32)).logits
        tol = 1e-3 if family == "qwen3_5" else 1e-4   # the random hybrid amplifies rounding (see test_golden)
        assert (got - ref).abs().max().item() < tol, family



def test_gpu_product_kernels_reject_bad_shapes_before_launching():
    """The Triton GEMV / skinny GEMM check their operands first (runs wherever Triton imports; no GPU needed)."""
    pytest.importorskip("triton")
    from edgespec.kernels.quant.triton_gemv import gemv_triton, skinny_gemm_triton

    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="not \\[1, K\\]"):
        gemv_triton(torch.randn(2, 16), w)                  # two rows
    with pytest.raises(ValueError, match="not \\[1, K\\]"):
        gemv_triton(torch.randn(1, 15), w)                  # K mismatch
    with pytest.raises(ValueError, match="contiguous"):
        gemv_triton(torch.randn(1, 16), torch.randn(16, 8).t())  # column-major [8, 16] weight
    with pytest.raises(ValueError, match="rows 1..16"):
        skinny_gemm_triton(torch.randn(17, 16), w)          # too many rows
    with pytest.raises(ValueError, match="rows 1..16"):
        skinny_gemm_triton(torch.randn(4, 15), w)


def test_fused_pointwise_kernels_reject_bad_shapes_before_launching():
    pytest.importorskip("triton")
    from edgespec.kernels.pointwise.triton_activation import gdn_gates_triton, silu_mul_triton
    from edgespec.kernels.pointwise.triton_norm import add_rms_norm_triton

    with pytest.raises(ValueError, match="not even"):
        silu_mul_triton(torch.randn(2, 7))
    with pytest.raises(ValueError, match="do not fit"):
        gdn_gates_triton(torch.randn(2, 4), torch.randn(2, 3), torch.randn(4), torch.randn(4))
    with pytest.raises(ValueError, match="do not fit"):
        gdn_gates_triton(torch.randn(2, 4), torch.randn(2, 4), torch.randn(3), torch.randn(4))
    with pytest.raises(ValueError, match="must match"):
        add_rms_norm_triton(torch.randn(2, 8), torch.randn(2, 9), torch.randn(8), 1e-6, False)
    with pytest.raises(ValueError, match="must match"):
        add_rms_norm_triton(torch.randn(2, 8), torch.randn(2, 8).bfloat16(), torch.randn(8), 1e-6, False)
