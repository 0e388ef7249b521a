"""lab/ncu_source_summary.py on a small Nsight Compute source-page CSV written here: the loop is found by its
backward branch, samples are split before / in / after it, and bad inputs stop the tool with a message."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

from _tools import load_tool

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "lab" / "ncu_source_summary.py"
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
          "stall_wait", "stall_barrier", "stall_long_sb (Not Issued)"]


def _write(path: Path, rows: list[list[str]]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(HEADER)
        w.writerows(rows)
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True)


def test_loop_and_hot_instructions(tmp_path: Path) -> None:
    rows = [["0x100", "LDC R1, c[0x0][0x28]", "3", "10", "0", "3", "0", "0"],           # before the loop
            ["0x110", "LDG.E R2, desc[UR4][R4.64]", "1", "80", "1", "0", "0", "0"],     # loop start
            ["0x120", "IMAD.MOV.U32 R3, RZ, RZ, R2", "40", "80", "38", "2", "0", "0"],
            ["0x130", "BAR.SYNC.DEFER_BLOCKING 0x0", "7", "80", "0", "0", "7", "0"],
            ["0x140", "@P0 BRA 0x110", "2", "80", "0", "2", "0", "0"],                  # loop end
            ["0x150", "EXIT", "5", "10", "0", "5", "0", "0"]]
    out = _run(_write(tmp_path / "src.csv", rows), "--top", "2", "--chunk", "2")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "loop: 4 instructions, each executed 80 times" in text
    assert "before loop      1 instructions      3 samples" in text
    assert "loop             4 instructions     50 samples" in text
    assert "long_sb 39" in text                                                     # "Not Issued" columns left out
    lines = text.splitlines()
    top = lines[lines.index("the 2 loop instructions with the most samples") + 1:]
    assert "IMAD.MOV.U32 R3" in top[0] and "long_sb 38" in top[0] and "BAR.SYNC" in top[1]


def test_bad_inputs(tmp_path: Path) -> None:
    missing = _run(tmp_path / "none.csv")
    assert missing.returncode == 2 and "no such file" in missing.stderr
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    wrong = _run(tmp_path / "other.csv")
    assert wrong.returncode == 2 and "SourceCounters" in wrong.stderr
    empty = _run(_write(tmp_path / "empty.csv", []))
    assert empty.returncode == 2 and "no instruction rows" in empty.stderr
    odd = _run(_write(tmp_path / "odd.csv", [["here", "EXIT", "1", "1", "0", "1", "0", "0"]]))
    assert odd.returncode == 2 and "not hexadecimal" in odd.stderr


def test_loop_is_not_a_barrier_retry_after_exit() -> None:
    """A TMA or wgmma kernel retries its barrier waits from stubs after EXIT that branch back into the loop: the span
    of such a retry is longer than the loop, but the loop (no EXIT inside) is what is found."""
    largest_backward_branch = load_tool("sass_loop").largest_backward_branch
    sass = [(0x100, "LDC R1, c[0x0][0x28]"),
            (0x110, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR11+0xa400], R49"),     # loop start: the wait
            (0x120, "@!P0 BRA 0x170"),
            (0x130, "HMMA.16816.F32 R4, R8, R12, R4"),
            (0x140, "@P1 BRA 0x110"),                                            # loop end
            (0x150, "EXIT"),
            (0x160, "BRA 0x160"),
            (0x170, "@!P0 BRA 0x170"),                                           # the retry stub
            (0x180, "BRA 0x130")]
    assert largest_backward_branch(sass) == (0x110, 0x140)
    assert largest_backward_branch(sass[5:]) == (0x130, 0x180)          # only a retry: taken, as before
    assert largest_backward_branch(sass[:2]) is None
