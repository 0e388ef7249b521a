"""The systemd unit's sandbox: exposure score <= 4.0 by ``systemd-analyze security`` and the GPU still reachable."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "configs" / "edgespec-agent.service"


def _directives() -> list[tuple[str, str]]:
    out = []
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.append((key, value))
    return out


def test_gpu_devices_stay_reachable() -> None:
    d = _directives()
    keys = dict(d)
    assert keys.get("PrivateDevices", "no") == "no", "PrivateDevices=yes hides /dev/nvidia*"
    assert keys["DevicePolicy"] == "closed"
    allowed = [v.split()[0] for k, v in d if k == "DeviceAllow"]
    for node in ("char-nvidia-frontend", "char-nvidia-uvm", "/dev/nvmap", "/dev/nvhost-ctrl-gpu"):
        assert node in allowed, node
    assert "video" in keys["SupplementaryGroups"].split()
    # CUDA and Triton JIT-compile kernels into executable memory.
    assert keys.get("MemoryDenyWriteExecute", "no") == "no"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_exposure_score_at_most_4() -> None:
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", str(UNIT)], capture_output=True,
                       text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) <= 4.0, r.stdout
