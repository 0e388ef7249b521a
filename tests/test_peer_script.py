"""tools/peer_llamacpp.sh refuses a narrowed run it cannot make, by name, before it builds or writes anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_direct_q4_k_m_refuses_other_quants(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "PEER_Q4KM_DIRECT": "1", "PEER_QUANTS": "Q4_K_M Q8_0",
           "PEER_MODELS": str(tmp_path / "models")}
    run = subprocess.run(["bash", "tools/peer_llamacpp.sh", "bench"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2
    assert "PEER_Q4KM_DIRECT=1 writes only Q4_K_M" in run.stderr and "'Q4_K_M Q8_0'" in run.stderr
    assert not any((tmp_path / "models").glob("*.gguf"))
