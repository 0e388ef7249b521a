"""The block-scaled products (NVFP4 and MXFP4 weights into the block-scaled MMA) on the CPU: the torch twin's
residual-series activations (``edgespec.kernels.quant.block_scaled_ref``) against the packed formats' reference
(``quant_ref``), and the Triton kernels (``edgespec.kernels.quant.triton_block_scaled``) through Triton's interpreter
(``TRITON_INTERPRET=1``, in a child process: the variable is read when the kernels are defined).

Triton 3.9's interpreter reads every ``dot_scaled`` scale byte as E8M0, where the MMA (and Triton's emulated GPU
path) reads float8e4nv scales as E4M3: the interpreted NVFP4 product runs with that one decoding step corrected
(:func:`read_e4m3_scales_as_e4m3`), so its tiles (the 17-32-row one included) are checked here against the torch
twin. Unpatched it runs on a GPU only: ``test_block_scaled_gpu`` (Triton's emulated path on Hopper, issue 45
point 4)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgespec.kernels.quant import block_scaled_ref as R
from edgespec.kernels.quant.quant_ref import dequantize_rows, pack

ROOT = Path(__file__).resolve().parents[2]
_TRITON = importlib.util.find_spec("triton") is not None


def _triton_at_least(major: int, minor: int) -> bool:
    from importlib.metadata import version
    return tuple(int(p) for p in version("triton").split(".")[:2]) >= (major, minor)


# The interpreter test reads what Triton 3.9's interpreter does (tools/setup.sh pins it); an older one (a GPU
# machine's, e.g. 3.6) cannot index a loop bound by a kernel argument in interpreted mode.
_INTERPRETER = _TRITON and _triton_at_least(3, 9)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def test_mxfp4_reference_round_trip():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.05
    p = pack("mxfp4", w)
    assert p.weight.shape == (64, 128) and p.weight_scale.shape == (64, 8) and p.weight_scale.dtype == torch.uint8
    deq = dequantize_rows(p, 0, 64, torch.float32)
    assert rel_err(deq, w) < 0.15                      # 4-bit values under a power-of-two scale per 32
    again = dequantize_rows(pack("mxfp4", deq), 0, 64, torch.float32)
    assert torch.equal(again, deq)                     # values already on the grid quantize to themselves
    with pytest.raises(ValueError, match="multiple of 32"):
        pack("mxfp4", torch.randn(4, 48))


def test_power_of_two_exponents_from_bits():
    v = torch.tensor([0.0, 1e-40, 1.0, 448.0, 448.5, 500.0, 3e38, 2688.0, 2689.0])
    for limit in (448.0, 2688.0):
        e = R.pow2_ceil_exponent(v, limit)
        scaled = v / R.exp2_int(e)
        assert (scaled <= limit).all()
        bigger = v / R.exp2_int((e - 1).clamp(min=-126))
        assert ((bigger > limit) | (v < 2.0 ** -100)).all()        # the smallest such exponent


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_residual_series_accuracy(fmt: str):
    """2 MXFP8 terms hold bf16 inputs exactly; 4 NVFP4 terms leave ~1e-4; zero and outlier rows survive."""
    torch.manual_seed(1)
    x = torch.randn(5, 512)
    x[1, :7] *= 300.0                                  # outliers in a row
    x[2] = 0.0                                         # an all-zero row
    x[3] *= 1e-6                                       # a tiny row (NVFP4's column scale keeps it)
    x = x.to(torch.bfloat16).float()
    aq = R.quantize_activations(x, fmt)
    assert aq.terms == R.TERMS[fmt] and aq.columns >= 16
    back = R.dequantize_activations(aq)
    assert back.shape == x.shape and torch.equal(back[2], x[2])
    for r in (0, 1, 3, 4):
        err = rel_err(back[r], x[r])
        assert err < (1e-6 if fmt == "mxfp4" else 1e-3), (r, err)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 70])
def test_twin_product_equals_quant_ref(fmt: str, rows: int):
    torch.manual_seed(rows)
    p = pack(fmt, torch.randn(96, 256) * 0.05)
    x = torch.randn(rows, 256).to(torch.bfloat16).float()
    out = R.block_scaled_matmul_ref(p, x)
    assert out.shape == (rows, 96)
    assert rel_err(out, p.matmul_ref(x)) < (1e-6 if fmt == "mxfp4" else 1e-3)


def test_row_blocks_and_columns():
    assert [R.block_rows("nvfp4", m) for m in (1, 4, 5, 16, 64, 65, 512)] == [4, 4, 8, 16, 64, 64, 64]
    assert [R.block_rows("mxfp4", m) for m in (1, 9, 64, 100)] == [8, 16, 64, 64]
    assert R.block_rows("nvfp4", 64, columns=64) == 16          # sm_120: accumulator in registers
    aq = R.quantize_activations(torch.randn(70, 128), "nvfp4")
    assert aq.blocks == 2 and aq.codes.shape == (2 * 4 * 64, 64) and aq.scales.shape == (512, 8)
    with pytest.raises(ValueError, match="multiple of 16"):
        R.quantize_activations(torch.randn(2, 40), "nvfp4")


# -- the Triton kernels through the interpreter ------------------------------------------------------------------
def read_e4m3_scales_as_e4m3() -> None:
    """Make the interpreter decode float8e4nv ``dot_scaled`` scales as E4M3 (Triton 3.9's reads every scale byte as
    an E8M0 exponent); integer (E8M0) scales go through its own decoding unchanged."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    e8m0 = interpreter._dot_scaled_scale_to_f32

    def scale_to_f32(handle, compute_type):
        if handle.dtype == tl.float8e4nv:
            codes = torch.from_numpy(np.ascontiguousarray(handle.data).view(np.uint8))
            return codes.view(torch.float8_e4m3fn).float().numpy()
        return e8m0(handle, compute_type)

    interpreter._dot_scaled_scale_to_f32 = scale_to_f32


def interpreted_checks() -> None:
    """Run with TRITON_INTERPRET=1: the quantizer makes the twin's codes bit for bit (both formats, padding rows and
    row blocks included); the MXFP4 product equals quant_ref within the packed products' bf16 tolerance, K split
    or not, with a bias; the NVFP4 product (fp32 rows) equals the torch twin up to fp32 summation order."""
    from edgespec.kernels.quant import triton_block_scaled as T
    torch.manual_seed(0)
    for fmt in ("nvfp4", "mxfp4"):
        for rows in (1, 5, 70):
            x = torch.randn(rows, 256).to(torch.bfloat16)
            x[0, :3] *= 200.0
            a, b = R.quantize_activations(x, fmt), T.quantize_activations_triton(x, fmt)
            for name in ("codes", "scales", "col_scale"):
                u, v = getattr(a, name), getattr(b, name)
                assert torch.equal(u.view(torch.uint8) if u.element_size() == 1 else u,
                                   v.view(torch.uint8) if v.element_size() == 1 else v), (fmt, rows, name)
        print("ok quantizer", fmt)
    p = pack("mxfp4", torch.randn(200, 512) * 0.05)
    bias = torch.randn(200).to(torch.bfloat16)
    for rows, cfg in ((1, {"SPLIT_K": 2}), (16, {"SPLIT_K": 1}), (33, {"SPLIT_K": 4})):
        x = torch.randn(rows, 512).to(torch.bfloat16)
        out = T.block_scaled_matmul(p, x, bias, config=cfg, capability=(11, 0))
        ref = p.matmul_ref(x.float(), bias.float())
        assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2, (rows, rel_err(out, ref))
    print("ok product mxfp4")
    read_e4m3_scales_as_e4m3()
    p = pack("nvfp4", torch.randn(200, 256) * 0.05)
    # row blocks of 4 (decode, K split) and 32 (the 128-column, 4-warp tile of 17-32 rows)
    for rows, cfg in ((1, {"SPLIT_K": 2}), (32, {"SPLIT_K": 1})):
        x = torch.randn(rows, 256)
        x[0, :3] *= 200.0
        out = T.block_scaled_matmul(p, x, bias.float(), config=cfg, capability=(11, 0))
        twin = R.block_scaled_matmul_ref(p, x, bias.float())
        assert rel_err(out, twin) < 1e-5, (rows, rel_err(out, twin))        # fp32 summation order only
        assert rel_err(out, p.matmul_ref(x, bias.float())) < 1e-3, rows
    print("ok product nvfp4")


@pytest.mark.skipif(not _INTERPRETER, reason="needs Triton >= 3.9's CPU interpreter (tools/setup.sh pins it)")
@pytest.mark.timeout(300)
def test_block_scaled_kernels_interpreted_on_cpu():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "kernels")]))
    run = subprocess.run([sys.executable, "-c", "import test_block_scaled as t; t.interpreted_checks()"], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.count("ok ") == 4, run.stdout


@pytest.mark.skipif(not _TRITON, reason="needs Triton")
def test_launch_warps_follow_the_row_block_columns():
    """4 warps up to 128 MMA columns (NVFP4's 17-32-row tile: 4 terms x 32 rows), 8 for 256 columns (the epilogue's
    fp32 accumulator would spill at 4) and for an emulated product; K split only for decode and verify."""
    from edgespec.kernels.quant import triton_block_scaled as T
    columns = {m: R.TERMS["nvfp4"] * R.block_rows("nvfp4", m) for m in (1, 16, 32, 64)}
    assert columns == {1: 16, 16: 64, 32: 128, 64: 256}
    warps = {m: T.block_scaled_config(5120, 17408, m, 20, c)["num_warps"] for m, c in columns.items()}
    assert warps == {1: 4, 16: 4, 32: 4, 64: 8}
    assert T.block_scaled_config(5120, 17408, 32, 20, 128, emulate=True)["num_warps"] == 8
    assert T.block_scaled_config(5120, 17408, 512, 20, 256)["SPLIT_K"] == 1
