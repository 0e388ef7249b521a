"""The FP8 decode attention's compiled key loop (sm_90 SASS, compiled off the GPU by lab/attn_sass.py): the
key-blocked V must keep the p.V operand free of single-byte shared-memory gathers. Needs Triton (the ``gpu`` extra),
not a GPU; skipped where Triton is not installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _tools import load_tool

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def _loop(v_block: int) -> tuple[int, dict[str, int]]:
    tool = load_tool("attn_sass")
    args = tool.parse_args(["--v-block", str(v_block)])          # the FP8 decode launch (FP8_LAUNCH["decode"])
    try:
        kernel = tool.compile_kernel(args)
    except Exception as exc:  # a Triton build without the NVIDIA backend's ptxas
        pytest.skip(f"cannot compile for sm_90 here: {type(exc).__name__}: {exc}")
    return tool.loop_histogram(tool.dump(kernel)[1])


def test_blocked_v_has_no_byte_gathers():
    n_blocked, blocked = _loop(32)
    n_rows, rows = _loop(0)
    assert rows.get("LDS.U8", 0) > 0                       # the key-major V: the operand gathered byte by byte
    assert blocked.get("LDS.U8", 0) == 0 and blocked.get("LDG.E.U8", 0) == 0
    assert blocked.get("LDGSTS.E.BYPASS.128", 0) > 0       # K and V tiles copied as 16-byte vectors
    assert n_blocked < 0.8 * n_rows


def test_tool_runs_as_a_script():
    out = subprocess.run([sys.executable, str(ROOT / "lab" / "attn_sass.py"), "--top", "3"], capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0 and "ptxas" in out.stderr:
        pytest.skip("no ptxas for sm_90 here")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "instructions per warp per 32-key tile" in out.stdout
