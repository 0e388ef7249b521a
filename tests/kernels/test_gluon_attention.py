"""The Gluon FP8 decode program off the GPU: its launch rules, where it applies, and its compiled key loop (sm_90
SASS, compiled on the CPU by ``lab/attn_sass.py --gluon``). Needs Triton with Gluon, not a GPU. The GPU side
(against the oracle) is ``tests/kernels/test_gluon_attention_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from _tools import load_tool

pytest.importorskip("triton.experimental.gluon")

from edgespec.kernels.attention import gluon_attention_fp8 as ga  # noqa: E402

H200 = {"sm_count": 132, "smem_per_sm": 228 * 1024}


def test_default_launch_fills_one_wave_of_programs() -> None:
    """27B heads at 32k keys: one warp per program, four programs per SM (shared memory), 132 splits per KV head."""
    cfg = ga.gluon_decode_config(4, 256, 32768, **H200)
    assert (cfg["num_warps"], cfg["BLOCK_W"], cfg["num_stages"]) == (1, 32, 3)
    assert cfg["waves"] == 4 and cfg["n_splits"] == 132


def test_launch_rules_follow_head_dim_length_and_overrides() -> None:
    small = ga.gluon_decode_config(8, 128, 32768, **H200)
    assert small["waves"] > 4                        # half the shared memory per program: more of them per SM
    short = ga.gluon_decode_config(4, 256, 4096, **H200)
    assert short["n_splits"] == 4096 // (4 * 32)     # at least ~4 tiles per split
    assert ga.gluon_decode_config(4, 256, 10, **H200)["n_splits"] == 1
    forced = ga.gluon_decode_config(4, 256, 32768, overrides={"n_splits": 7, "num_warps": 2, "BLOCK_N": 64},
                                    **H200)
    assert forced["n_splits"] == 7 and forced["num_warps"] == 2
    assert "BLOCK_N" not in forced                   # a Triton-program key is not the Gluon program's


@pytest.mark.parametrize("case,ok", [
    ((1, 24, 4, 256, True, 32, torch.bfloat16), True),
    ((1, 16, 4, 256, True, 32, torch.float16), True),
    ((1, 9, 3, 64, True, 32, torch.bfloat16), True),
    ((2, 24, 4, 256, True, 32, torch.bfloat16), False),      # a verify: the Triton program
    ((1, 24, 4, 256, False, 0, torch.bfloat16), False),      # a bf16 cache
    ((1, 24, 4, 256, True, 0, torch.bfloat16), False),       # key-major V
    ((1, 24, 4, 256, True, 32, torch.float32), False),       # fp32 queries
    ((1, 36, 4, 256, True, 32, torch.bfloat16), False),      # 9 query heads per KV head: more than the mma's N
    ((1, 24, 4, 96, True, 32, torch.bfloat16), False),       # a head dim the copies do not tile
])
def test_where_the_gluon_program_applies(case, ok) -> None:
    assert ga.gluon_decode_supported(*case) is ok


def test_default_program_choice() -> None:
    """The Gluon program by default from GLUON_MIN_KEYS keys on, where it applies and the config tunes nothing of
    the Triton program's; GLUON in the config decides outright."""
    from edgespec.config import load_settings
    from edgespec.kernels.attention.triton_attention import GLUON_MIN_KEYS, use_gluon_decode
    from edgespec.kernels.options import KernelOptions
    long, short = GLUON_MIN_KEYS, GLUON_MIN_KEYS - 1
    assert use_gluon_decode({}, True, long) and not use_gluon_decode({}, True, short)
    assert not use_gluon_decode({}, False, long)                        # not applicable (a verify, a bf16 cache)
    assert not use_gluon_decode({"BLOCK_N": 64}, True, long)            # tunes the Triton program
    assert use_gluon_decode({"num_warps": 2}, True, long)              # a key both programs take
    assert use_gluon_decode({"GLUON": 1}, True, short) and not use_gluon_decode({"GLUON": 0}, True, long)
    assert use_gluon_decode({"GLUON": 1}, False, long)                 # asked for: the caller raises
    off = KernelOptions.from_settings(load_settings(environ={"EDGESPEC_GLUON": "0"}))   # back to the Triton program
    assert not use_gluon_decode({}, True, long, off) and use_gluon_decode({"GLUON": 1}, True, long, off)


def _loop(*argv: str) -> tuple[int, dict[str, int], int, int]:
    tool = load_tool("attn_sass")
    args = tool.parse_args(list(argv))
    try:
        kernel = tool.compile_kernel(args)
    except Exception as exc:  # a Triton build without the NVIDIA backend's ptxas
        pytest.skip(f"cannot compile for sm_90 here: {type(exc).__name__}: {exc}")
    usage, sass = tool.dump(kernel)
    n, hist = tool.loop_histogram(sass)
    regs, stack = (int(x) for x in tool.re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    return n, hist, regs, stack


def test_compiled_loop_is_lean() -> None:
    """Per key, the Gluon loop issues under half the Triton program's warp-instructions, half its tensor-core
    instructions (N = 8 query heads instead of a 16-row block), no single-byte gathers, no spills, and none of the
    register moves that rebuild the Triton program's query operand on every tile."""
    n_g, g, regs, stack = _loop("--gluon")
    n_t, t, _, _ = _loop()
    keys = ga.GLUON_DECODE["BLOCK_W"] * ga.GLUON_DECODE["num_warps"]
    per_key_g = n_g * ga.GLUON_DECODE["num_warps"] / keys
    per_key_t = n_t * 2 / 32                                  # the Triton decode program: 2 warps, 32-key tiles
    assert per_key_g < 0.5 * per_key_t, (per_key_g, per_key_t)
    assert g["HMMA.16816.F32"] * ga.GLUON_DECODE["num_warps"] / keys == 2       # 4 per key in the Triton program
    assert g.get("LDS.U8", 0) == 0 and stack == 0 and regs <= 200
    assert g.get("IMAD.MOV.U32", 0) < 0.25 * t["IMAD.MOV.U32"]
    assert g.get("LDGSTS.E", 0) > 0 or g.get("LDGSTS.E.BYPASS.128", 0) > 0   # tiles (and scales) by cp.async
