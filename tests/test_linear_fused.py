"""The fused linears (``linear_silu_mul``, ``linear_gated_rms_norm``, ``linear_sigmoid_gate``) on CPU: exactly the
unfused composition ``linear(step(...), weight, bias)`` (torch and OpenBLAS paths); their operand checks and those
of the Triton prologue launches. The GPU side is in tests/test_kernels_gpu.py."""

from __future__ import annotations

import pytest
import torch

from edgespec.kernels import linear as L
from edgespec.kernels.activation import silu_mul_ref
from edgespec.kernels.norm import gated_rms_norm_ref


@pytest.fixture(params=["torch", "blas"])
def cpu_path(request):
    L.configure_cpu(request.param == "blas")
    assert L.cpu_blas_active() == (request.param == "blas")
    return request.param


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 8), (40,)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_silu_mul_is_the_composition(cpu_path, dtype, lead, bias):
    gate_up = (torch.randn(*lead, 2 * 96) * 3.0).to(dtype)
    w = torch.randn(70, 96).to(dtype)
    b = torch.randn(70).to(dtype) if bias else None
    with torch.inference_mode():
        got = L.linear_silu_mul(gate_up, w, b)
        ref = L.linear(silu_mul_ref(gate_up), w, b)
    assert got.shape == (*lead, 70) and got.dtype == dtype
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 8)])
@pytest.mark.parametrize("head", [64, 96])
def test_linear_gated_rms_norm_is_the_composition(cpu_path, dtype, wdtype, lead, head):
    o = torch.randn(*lead, 3, head).to(dtype)
    z = (torch.randn(*lead, 3, head) * 2.0).to(dtype)
    nw = (torch.randn(head) * 0.2 + 1.0).to(wdtype)
    w = torch.randn(50, 3 * head).to(dtype)
    with torch.inference_mode():
        got = L.linear_gated_rms_norm(o, z, nw, 1e-6, w)
        ref = L.linear(gated_rms_norm_ref(o, z, nw, 1e-6).reshape(*lead, 3 * head), w)
    assert got.shape == (*lead, 50) and got.dtype == dtype
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 8), (40,)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_sigmoid_gate_is_the_composition(cpu_path, dtype, lead, bias):
    x = torch.randn(*lead, 128).to(dtype)
    gate = (torch.randn(*lead, 128) * 3.0).to(dtype)
    w = torch.randn(60, 128).to(dtype)
    b = torch.randn(60).to(dtype) if bias else None
    with torch.inference_mode():
        got = L.linear_sigmoid_gate(x, gate, w, b)
        ref = L.linear(x * torch.sigmoid(gate), w, b)
    assert got.shape == (*lead, 60) and got.dtype == dtype
    assert torch.equal(got, ref)


def test_fused_linears_keep_autograd():
    """With autograd on they are the torch composition, gradients included."""
    w = torch.randn(8, 16, requires_grad=True)
    L.linear_silu_mul(torch.randn(3, 32), w).sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


def test_fused_linears_reject_bad_inputs():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="linear_silu_mul"):
        L.linear_silu_mul(torch.randn(2, 31), w)                            # odd width
    with pytest.raises(ValueError, match="linear_silu_mul"):
        L.linear_silu_mul(torch.randn(2, 16), w)                            # I = 8, weight K = 16
    o = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="linear_gated_rms_norm"):
        L.linear_gated_rms_norm(o, o[..., :4], torch.ones(8), 1e-6, w)      # z shape
    with pytest.raises(ValueError, match="linear_gated_rms_norm"):
        L.linear_gated_rms_norm(o, o, torch.ones(4), 1e-6, w)               # norm weight size
    with pytest.raises(ValueError, match="linear_gated_rms_norm"):
        L.linear_gated_rms_norm(o[..., 0], o[..., 0], torch.ones(2), 1e-6, w)  # K = 4 != 16
    with pytest.raises(ValueError, match="linear_sigmoid_gate"):
        L.linear_sigmoid_gate(torch.randn(2, 16), torch.randn(1, 16), w)   # gate shape
    with pytest.raises(ValueError, match="linear_sigmoid_gate"):
        L.linear_sigmoid_gate(torch.randn(2, 8), torch.randn(2, 8), w)     # weight K


def test_prologue_launches_reject_bad_operands_before_launching():
    """The Triton GEMV / skinny GEMM check their prologue operands first (runs wherever Triton imports)."""
    pytest.importorskip("triton")
    from edgespec.kernels.triton_gemv import Prologue, gemv_triton, skinny_gemm_triton

    bf = torch.bfloat16
    w = torch.randn(8, 256, dtype=bf)
    x = torch.randn(1, 256, dtype=bf)
    nw = torch.ones(128, dtype=bf)
    norm = Prologue.GATED_RMS_NORM
    for kwargs, match in [
        (dict(prologue=Prologue.SILU_MUL), "gate"),                                     # no gate
        (dict(prologue=Prologue.SILU_MUL, gate=x.half()), "gate"),                      # gate dtype
        (dict(prologue=Prologue.SIGMOID_GATE, gate=x[:, :128]), "gate"),                # gate shape
        (dict(prologue=Prologue.SILU_MUL, gate=x, norm_weight=nw), "no norm_weight"),
        (dict(gate=x), "without a prologue"),
        (dict(prologue=norm, gate=x), "norm_weight"),                                   # no norm weight
        (dict(prologue=norm, gate=x, norm_weight=torch.ones(96, dtype=bf)), "power of two"),
        (dict(prologue=norm, gate=x, norm_weight=torch.ones(512, dtype=bf)), "power of two"),   # > NORM_HEAD_MAX
        (dict(prologue=norm, gate=x, norm_weight=torch.ones(4, 32, dtype=bf)), "norm_weight"),  # not 1-d
        (dict(prologue=norm, gate=x, norm_weight=torch.ones(128, dtype=torch.int32)), "dtype"),
        (dict(prologue=norm, gate=x, norm_weight=nw, config={"BLOCK_K": 64}), "whole norm heads"),
    ]:
        with pytest.raises(ValueError, match=match):
            gemv_triton(x, w, **kwargs)
    with pytest.raises(ValueError, match="gate"):
        skinny_gemm_triton(x.expand(4, 256), w, prologue=Prologue.SILU_MUL, gate=x)     # gate rows != x rows
    with pytest.raises(ValueError, match="unsupported dtype"):
        skinny_gemm_triton(x.double().expand(4, 256), w.double(), prologue=Prologue.SIGMOID_GATE,
                           gate=x.double().expand(4, 256))
