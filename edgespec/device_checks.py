"""Checks ``edgespec doctor`` runs for a Jetson Thor (and any CUDA machine): can Triton's ptxas target this GPU, and
which power mode and clocks is the board in.

Thor's GPU is ``sm_110a`` (CUDA 13; ``sm_101`` before). The ptxas bundled with Triton wheels may predate it and
fails every kernel compile with ``ptxas fatal: Value 'sm_110a' is not defined for option 'gpu-name'``. NVIDIA's
newer ptxas (CUDA 13.1 or later, e.g. ``/usr/local/cuda/bin/ptxas`` from JetPack) knows it; Triton uses it when
``TRITON_PTXAS_PATH`` names it.

The power mode (``nvpmodel -q``) and clocks (``jetson_clocks --show``) decide decode speed and energy on a Jetson:
the service should start after they are set (``configs/edgespec-agent.service`` orders itself after
``nvpmodel.service``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

PTXAS_HINT = ("point TRITON_PTXAS_PATH at a ptxas that knows it (CUDA 13.1+ for Thor's sm_110a), e.g. "
              "`export TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas` (in /etc/edgespec/agent.env for the service)")


def gpu_arch(major: int, minor: int) -> str:
    """The ptxas target of a compute capability: ``sm_XY``, with the ``a`` (arch-specific features: wgmma,
    tcgen05) Triton compiles for from 9.0 on."""
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def triton_ptxas() -> Path | None:
    """The ptxas Triton will run: ``TRITON_PTXAS_PATH`` when set, else the one its wheel bundles."""
    env = os.environ.get("TRITON_PTXAS_PATH")
    if env:
        return Path(env)
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return bundled if bundled.exists() else None


def ptxas_targets(ptxas: Path) -> tuple[str, set[str]]:
    """(version line, the ``--gpu-name`` values) of a ptxas binary, read from ``--version`` and ``--help``.
    Raises OSError or subprocess.SubprocessError when it does not run."""
    version = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True, timeout=30, check=True)
    helptext = subprocess.run([str(ptxas), "--help"], capture_output=True, text=True, timeout=30, check=True)
    line = next((ln for ln in version.stdout.splitlines() if "release" in ln), version.stdout.strip()[-80:])
    return line.strip(), set(re.findall(r"'(sm_\w+)'", helptext.stdout))


def ptxas_status(major: int, minor: int, ptxas: Path | None = None) -> str:
    """One line: whether the ptxas Triton uses can compile for compute capability ``major.minor``, and if not, what
    to do."""
    arch = gpu_arch(major, minor)
    ptxas = ptxas if ptxas is not None else triton_ptxas()
    if ptxas is None:
        return f"no ptxas found (Triton not installed): GPU kernels fall back to torch; {arch} not checked"
    source = "TRITON_PTXAS_PATH" if os.environ.get("TRITON_PTXAS_PATH") else "Triton's bundled"
    try:
        version, targets = ptxas_targets(ptxas)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"BROKEN: {source} ptxas {ptxas} does not run ({exc}); {PTXAS_HINT}"
    if arch in targets:
        return f"ok: {source} ptxas {ptxas} ({version}) targets {arch}"
    return f"PROBLEM: {source} ptxas {ptxas} ({version}) cannot target {arch}; {PTXAS_HINT}"


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cmd[0]} failed: {exc}"
    text = (r.stdout or r.stderr).strip()
    return text if r.returncode == 0 else f"{cmd[0]} exited {r.returncode}: {text[:200]}"


def power_status() -> dict[str, str]:
    """Power mode and clocks where ``nvpmodel`` / ``jetson_clocks`` exist (a Jetson); empty elsewhere."""
    out = {}
    mode = _run(["nvpmodel", "-q"])
    if mode is not None:
        out["power mode (nvpmodel -q)"] = " ".join(mode.split())
    clocks = _run(["jetson_clocks", "--show"])
    if clocks is not None:
        gpu = [ln.strip() for ln in clocks.splitlines() if ln.strip().upper().startswith(("GPU", "EMC"))]
        out["clocks (jetson_clocks --show)"] = "; ".join(gpu) if gpu else " ".join(clocks.split())[:300]
    return out
