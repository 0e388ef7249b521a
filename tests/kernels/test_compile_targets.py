"""Every kernel the runtime launches compiles for the GPUs users run (``edgespec.bench.compile_targets``), checked
on the CPU: a representative set for Thor (sm_110a) and Hopper (sm_90a), time-boxed to about two minutes. Fails on
a compile error, a spill in a decode/verify kernel, shared memory over the target's limit, or a block-scaled
product whose SASS lacks the block-scaled tensor-core MMA. Needs Triton and a CUDA 13 ptxas (the
``nvidia-cuda-nvcc`` wheel, installed by tools/setup.sh); skipped without them. The full table:
``python tools/compile_targets.py``."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


@pytest.fixture(scope="module")
def ct():
    from edgespec.bench import compile_targets as ct
    if ct.ensure_ptxas(ct.TARGETS["sm_110a"]) is None:
        pytest.skip("no ptxas that knows sm_110a (Triton 3.9, or pip install nvidia-cuda-nvcc)")
    return ct


# SASS of a per-weight decode on the CUDA cores (nibble extraction, conversions, 16-bit pair arithmetic)
DECODE_OPS = ("LOP3.LUT", "PRMT", "F2FP", "HFMA2", "HADD2", "HMUL2", "I2F", "SHF.R.U32.HI")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_block_scaled_products_hold_the_block_scaled_mma(ct, fmt):
    results, failed = ct.compile_shape("qwen3.5-4b", fmt, ct.TARGETS["sm_110a"], rows=(1, 16, 64), prefill=0,
                                       kernels=("_block_scaled_kernel", "_quant_act_kernel"))
    assert not failed and not ct.problems(results), ct.problems(results) or failed
    products = [r for r in results if r.launch.name == "_block_scaled_kernel"]
    assert {r.launch.stage for r in products} == {"decode", "verify16", "verify64"}
    for r in products:
        assert r.block_scaled, (r.launch.stage, dict(r.mma))
        assert ("UTCOMMA" if fmt == "nvfp4" else "UTCQMMA") in "".join(r.mma)
        direct = dict(zip(r.launch.fn.arg_names, r.launch.args, strict=False)) | r.launch.kwargs
        if direct["DIRECT"]:
            # the K loop: copies and MMAs, no weight decoded on the CUDA cores (a few byte moves per tile for the
            # scales; a per-weight decode costs 2+ lane-instructions per weight: the Hopper pair tiles)
            decode = sum(r.loop_ops[op] for op in DECODE_OPS) * 32 * direct.get("num_warps", 4) / r.weights_per_trip
            assert decode < 0.25, dict(r.loop_ops)
            assert r.instructions_per_weight < 3.0


@pytest.mark.timeout(300)
def test_thor_decode_and_verify_kernels_compile_without_spills(ct):
    """Every kernel of a Qwen3.5-4B int4 decode and 16-row verify on Thor (the Hopper-shaped int4 products, FP8
    attention, GDN, norms): compiled for sm_110a, no spill, shared memory within the limit."""
    results, failed = ct.compile_shape("qwen3.5-4b", "int4", ct.TARGETS["sm_110a"], rows=(1, 16), prefill=0)
    assert not failed, failed
    names = {r.launch.name for r in results}
    assert {"_attn_split_kernel", "_gdn_recurrent_kernel", "_rms_norm_kernel"} <= names, names
    assert any(n.startswith("_int4") for n in names), names
    assert not ct.problems(results), ct.problems(results)


@pytest.mark.timeout(300)
def test_hopper_verify_products_compile(ct):
    results, failed = ct.compile_shape("qwen3.5-27b", "fp8", ct.TARGETS["sm_90a"], rows=(16, 64), prefill=0,
                                       kernels=("_fp8_block_kernel", "_fp8_t_kernel", "_split_sum_kernel"))
    assert results and not failed and not ct.problems(results), ct.problems(results) or failed
