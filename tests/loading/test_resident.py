"""edgespec.loading.resident: which library mappings are dropped, and that torch runs on after the drop."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edgespec.loading.resident import text_mappings

SMAPS = """\
7f0000000000-7f0000200000 r--p 00000000 fd:00 1 /x/torch/lib/libtorch_cpu.so
Rss:                 100 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0000200000-7f0000600000 r-xp 00200000 fd:00 1 /x/torch/lib/libtorch_cpu.so
Rss:                4000 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0000600000-7f0000800000 r-xp 00000000 fd:00 2 /x/torch/lib/libtorch_python.so
Rss:                  12 kB
Private_Dirty:         4 kB
Anonymous:             4 kB
7f0000800000-7f0000900000 r-xp 00000000 fd:00 3 /x/other/libfoo.so
Rss:                  12 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0000900000-7f0000a00000 rw-p 00000000 00:00 0
Rss:                  12 kB
Private_Dirty:        12 kB
Anonymous:            12 kB
"""


def test_only_unwritten_text_of_the_named_libraries(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    # libtorch_cpu's text only: not its read-only data, not libtorch_python's text with a written page, not
    # another library, not anonymous memory
    assert text_mappings(smaps=str(smaps)) == [(0x7f0000200000, 0x7f0000600000)]
    assert text_mappings(smaps=str(tmp_path / "missing")) == []


SCRIPT = textwrap.dedent("""
    import json, torch
    from edgespec.loading.resident import drop_library_text, text_mappings, trim_heap
    a, b = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)), torch.randn(64, 64)
    want = (a @ b).softmax(-1)
    def text_rss():
        rss, current = 0, False
        for line in open("/proc/self/smaps"):
            if "-" in line.split()[0] and ":" not in line.split()[0]:
                current = line.split()[1] == "r-xp" and "libtorch_cpu.so" in line
            elif current and line.startswith("Rss:"):
                rss += int(line.split()[1])
        return rss
    before = text_rss()
    dropped = drop_library_text()
    after = text_rss()
    got = (a @ b).softmax(-1)          # the code runs again from the page cache
    print(json.dumps({"before": before, "after": after, "dropped": dropped, "equal": bool(torch.equal(got, want)),
                      "mappings": len(text_mappings()), "trim": trim_heap()}))
""")


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="no /proc/self/smaps here")
def test_drop_unmaps_torch_text_and_torch_runs_on() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["equal"] and r["mappings"] >= 1 and r["dropped"] > 0
    assert r["after"] < r["before"], r


MAP_SCRIPT = textwrap.dedent("""
    import json, sys, numpy as np
    from edgespec.loading.resident import map_only, small_pages
    mm = np.memmap(sys.argv[1], dtype=np.uint8, mode="c")
    base, MiB = mm.ctypes.data, 1 << 20
    small = small_pages(base, mm.size)
    int(mm[::4096].sum())                      # every page mapped, as after a load that read the whole file
    def rss():
        hit = False
        for line in open("/proc/self/smaps"):
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:
                hit = line.rstrip().endswith(sys.argv[1])
            elif hit and head[0] == "Rss:":
                return int(head[1]) * 1024
    before = rss()
    used = [(base + 1 * MiB, base + 3 * MiB + 100), (base + 6 * MiB, base + 8 * MiB)]
    dropped = map_only(base, mm.size, used)
    after = rss()
    ok = bool((mm[1 * MiB:3 * MiB + 100] == 7).all() and (mm[6 * MiB:8 * MiB] == 7).all() and (mm == 7).all())
    print(json.dumps({"small": small, "before": before, "after": after, "dropped": dropped, "ok": ok}))
""")


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="no /proc/self/smaps here")
def test_map_only_unmaps_the_gaps_and_keeps_the_bytes(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes([7]) * (8 << 20))
    out = subprocess.run([sys.executable, "-c", MAP_SCRIPT, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ok"], r                                      # unmapped pages read back from the file
    if not r["small"]:
        pytest.skip("the kernel does not take MADV_NOHUGEPAGE here")
    gap = (1 << 20) + (3 << 20) - 4096                     # [0, 1) MiB, the pages of [3 MiB + 100, 6 MiB)
    assert r["dropped"] == gap
    assert r["before"] - r["after"] >= gap - (64 << 10), r
