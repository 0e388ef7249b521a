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
    results, failed = ct.compile_shape("qwen3.5-4b", fmt, ct.TARGETS["sm_110a"], rows=(1, 16, 32, 64), prefill=0,
                                       kernels=("_block_scaled_kernel", "_quant_act_kernel"))
    assert not failed and not ct.problems(results), ct.problems(results) or failed
    products = [r for r in results if r.launch.name == "_block_scaled_kernel"]
    assert {r.launch.stage for r in products} == {"decode", "verify16", "verify32", "verify64"}
    for r in products:
        assert r.block_scaled, (r.launch.stage, dict(r.mma))
        assert ("UTCOMMA" if fmt == "nvfp4" else "UTCQMMA") in "".join(r.mma)
        direct = dict(zip(r.launch.fn.arg_names, r.launch.args, strict=False)) | r.launch.kwargs
        if direct["DIRECT"]:
            # the K loop: copies and MMAs, no weight decoded on the CUDA cores (a few byte moves per tile for the
            # scales; a per-weight decode costs 2+ lane-instructions per weight: the Hopper pair tiles)
            decode = sum(r.loop_ops[op] for op in DECODE_OPS) * 32 * direct.get("num_warps", 4) / r.weights_per_trip
            assert decode < 0.25, dict(r.loop_ops)
            # every row count's tile in line with the others (the 17-32-row one once read 9.4: a wait's retry
            # span taken for the loop, the loop itself at 8 warps)
            assert r.instructions_per_weight < 2.5, (r.launch.stage, r.instructions_per_weight)


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


def test_loop_body_is_not_a_retry_spanning_a_peeled_trip_and_the_epilogue():
    """A tcgen05 kernel whose compiler peeled the first K trip off the loop: the retry of that trip's barrier wait
    sits after EXIT and branches back before the loop, so its span holds MMAs (the peeled trip's and the loop's)
    and the epilogue, more instructions than the loop. The loop is found, not that span."""
    from edgespec.kernels.launch.sass import loop_body
    sass = [(0x100, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2"),                 # peeled trip: the wait
            (0x110, "@!P0 BRA 0x1f0"),
            (0x120, "UTCOMMA.4X gdesc[UR4], gdesc[UR8], tmem[UR7], tmem[UR12], idesc[UR13], tmem[UR18], !UPT"),
            (0x130, "LDGSTS.E.BYPASS.128 [R5], desc[UR6][R8.64]"),                   # loop start
            (0x140, "UTCOMMA.4X gdesc[UR4], gdesc[UR8], tmem[UR7], tmem[UR12], idesc[UR13], tmem[UR18], UPT"),
            (0x150, "BRA.U UP0, 0x130"),                                             # loop end
            (0x160, "FMUL R1, R2, R3"),                                              # epilogue
            (0x170, "F2FP.BF16.F32.PACK_AB R1, R2, R1"),
            (0x180, "STG.E [R4.64], R1"),
            (0x190, "FADD R1, R2, R3"),
            (0x1a0, "SHFL.BFLY PT, R2, R1, 0x1, 0x1f"),
            (0x1b0, "STS.128 [R3], R4"),
            (0x1c0, "BAR.SYNC.DEFER_BLOCKING 0x0"),
            (0x1d0, "EXIT"),
            (0x1e0, "BRA 0x1e0"),
            (0x1f0, "@!P0 BRA 0x1f0"),                                               # the retry stub
            (0x200, "BRA 0x100")]
    assert loop_body(sass) == [sass[3][1], sass[4][1], sass[5][1]]
    assert loop_body(sass[:3] + sass[6:]) == [t for _, t in sass[:3] + sass[6:]]  # only the retry: taken


@pytest.mark.timeout(300)
def test_thor_projection_reads_the_compile_tool_json(ct, tmp_path):
    """``tools/compile_targets.py --json`` as written gives ``tools/thor_projection.py --sass`` the sm_110a counts
    of NVFP4's block-scaled product against int4's (a Qwen3.5-4B decode)."""
    from _tools import load_tool
    out = tmp_path / "sass.json"
    assert load_tool("compile_targets").main(
        ["--targets", "sm_110a", "--shapes", "qwen3.5-4b", "--formats", "nvfp4,int4", "--kernels",
         "_block_scaled_kernel,_int4_gemv_h2_kernel", "--rows", "1", "--prefill", "0", "--json", str(out)]) == 0
    counts = load_tool("thor_projection").sass_counts(str(out))
    (lo, hi), (int4_lo, _) = counts["nvfp4"]["decode"], counts["int4"]["decode"]
    assert 0 < lo <= hi < int4_lo            # the block-scaled loop issues fewer per weight than int4's GEMV
