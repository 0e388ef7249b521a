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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is read from Linux's /proc/self/status")
def test_demo_generate_peaks_under_400_mib(demo_gguf: Path, tmp_path: Path) -> None:
    from edgespec.kernels.cpu import gguf_native

    if gguf_native.library() is None:
        pytest.skip("the GGUF C products cannot be built here (the torch reference path is not the demo's)")
    # The child reports its own high-water mark (VmHWM of the process image exec made): ru_maxrss from wait4 would
    # carry the forking pytest process's peak over into the child's.
    code = ("import atexit, sys\n"
            "def hwm():\n"
            "    line = next(x for x in open('/proc/self/status') if x.startswith('VmHWM:'))\n"
            "    print('VMHWM_KIB', line.split()[1], file=sys.stderr)\n"
            "atexit.register(hwm)\n"
            "from edgespec.cli import main; sys.exit(main(sys.argv[1:]))")
    args = ["generate", "--drafter", "ngram", "--max-tokens", "160", PROMPT]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGESPEC_")}   # the demo's defaults
    env["EDGESPEC_CACHE_DIR"] = os.environ.get("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=out, stderr=err, env=env)
        proc.wait()
    stderr = (tmp_path / "err").read_text()
    assert proc.returncode == 0, stderr
    assert "drafter=ngram" in stderr and '"action"' in (tmp_path / "out").read_text()
    peak = int(stderr.rsplit("VMHWM_KIB", 1)[1].split()[0]) * 1024
    assert peak <= LIMIT, f"the demo peaked at {peak / MiB:.0f} MiB resident (limit {LIMIT / MiB:.0f})"
