"""The README's demo command (`edgespec generate --drafter ngram`, the demo GGUF on the CPU) peaks at 400 MiB
resident at most: measured on a fresh process, its whole life (imports, load, prefill, decode)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MiB = 1 << 20
LIMIT = 400 * MiB
# tools/demo.sh's prompt and flags
PROMPT = ("Output a compact JSON action list for a robot to pick up the red cube, place it on the tray, then report "
          "success. Use fields action, target, destination, and safety_check.")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="os.wait4's ru_maxrss in KiB is Linux's")
def test_demo_generate_peaks_under_400_mib(demo_gguf: Path, tmp_path: Path) -> None:
    from edgespec.kernels import gguf_native

    if gguf_native.library() is None:
        pytest.skip("the GGUF C products cannot be built here (the torch reference path is not the demo's)")
    code = "import sys; from edgespec.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["generate", "--drafter", "ngram", "--max-tokens", "160", PROMPT]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGESPEC_")}   # the demo's defaults
    env["EDGESPEC_CACHE_DIR"] = os.environ.get("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)     # this child's own peak, not every child's of pytest
        proc.returncode = os.waitstatus_to_exitcode(status)
    stderr = (tmp_path / "err").read_text()
    assert proc.returncode == 0, stderr
    assert "drafter=ngram" in stderr and '"action"' in (tmp_path / "out").read_text()
    peak = usage.ru_maxrss * 1024
    assert peak <= LIMIT, f"the demo peaked at {peak / MiB:.0f} MiB resident (limit {LIMIT / MiB:.0f})"
