"""Checks ``edgespec doctor`` runs for a Jetson Thor (and any CUDA machine): can Triton's ptxas target this GPU, and
which power mode and clocks is the board in.

Thor's GPU is ``sm_110a`` (CUDA 13; ``sm_101`` before). The ptxas bundled with Triton wheels may predate it and
fails every kernel compile with ``ptxas fatal: Value 'sm_110a' is not defined for option 'gpu-name'``. NVIDIA's
newer ptxas (CUDA 13.1 or later, e.g. ``/usr/local/cuda/bin/ptxas`` from JetPack) knows it. Which ptxas Triton runs
for a GPU is Triton's choice (``triton.knobs.nvidia``; Triton 3.9: ``ptxas_blackwell``, variable
``TRITON_PTXAS_BLACKWELL_PATH``, a CUDA 13 one it bundles, for sm_90 and later; ``ptxas``, ``TRITON_PTXAS_PATH``,
below), so the check asks Triton rather than reading those variables itself.

The power mode (``nvpmodel -q``) and clocks (``jetson_clocks --show``) decide decode speed and energy on a Jetson:
the service should start after they are set (``configs/edgespec-agent.service`` orders itself after
``nvpmodel.service``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PTXAS_HINT = ("point {variable} at a ptxas that knows it (CUDA 13.1+ for Thor's sm_110a), e.g. "
              "`export {variable}=/usr/local/cuda/bin/ptxas` (in /etc/edgespec/agent.env for the service)")


def gpu_arch(major: int, minor: int) -> str:
    """The ptxas target of a compute capability: ``sm_XY``, with the ``a`` (arch-specific features: wgmma,
    tcgen05) Triton compiles for from 9.0 on."""
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


@dataclass(frozen=True)
class TritonPtxas:
    """The ptxas Triton runs for one GPU: its path, the knobs of ``triton.knobs.nvidia`` that resolve to it (as
    (attribute, environment variable)), and whether it is the one Triton's wheel bundles."""

    path: Path
    knobs: tuple[tuple[str, str], ...]
    bundled: bool

    @property
    def source(self) -> str:
        """Where it comes from, for a report line: "Triton's bundled" or the variable that named it."""
        return "Triton's bundled" if self.bundled else " / ".join(var for _, var in self.knobs)

    @property
    def variable(self) -> str:
        """The variable that would name another ptxas for this GPU."""
        return " or ".join(var for _, var in self.knobs) or "TRITON_PTXAS_PATH"


def _ptxas_knobs() -> dict[str, Any]:
    """The ptxas knobs of ``triton.knobs.nvidia`` (attribute -> descriptor); empty where Triton has none."""
    try:
        from triton import knobs
    except ImportError:
        return {}
    return {name: k for name, k in knobs.nvidia.knob_descriptors.items()
            if isinstance(k, knobs.env_nvidia_tool) and k.binary.startswith("ptxas")}


def triton_ptxas(major: int, minor: int) -> TritonPtxas | None:
    """The ptxas Triton runs for compute capability ``major.minor``, as Triton's NVIDIA backend picks it
    (``get_ptxas``); None without that backend (no Triton, or one older than its knobs). Raises RuntimeError when
    Triton finds no ptxas that runs."""
    try:
        from triton import knobs
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return None
    try:
        tool = get_ptxas(major * 10 + minor)
    except TypeError:       # a Triton with one ptxas for every GPU
        tool = get_ptxas()
    named, bundled = [], False
    for name, knob in _ptxas_knobs().items():
        try:
            resolved = getattr(knobs.nvidia, name).path
        except RuntimeError:       # that knob finds no ptxas at all
            continue
        if resolved == tool.path:
            named.append((name, knob.key))
            bundled = bundled or resolved == knob.default_path
    return TritonPtxas(Path(tool.path), tuple(named), bundled)


def ptxas_targets(ptxas: Path) -> tuple[str, set[str]]:
    """(version line, the ``--gpu-name`` values) of a ptxas binary, read from ``--version`` and ``--help``.
    Raises OSError or subprocess.SubprocessError when it does not run."""
    version = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True, timeout=30, check=True)
    helptext = subprocess.run([str(ptxas), "--help"], capture_output=True, text=True, timeout=30, check=True)
    line = next((ln for ln in version.stdout.splitlines() if "release" in ln), version.stdout.strip()[-80:])
    return line.strip(), set(re.findall(r"'(sm_\w+)'", helptext.stdout))


def ptxas_status(major: int, minor: int, ptxas: Path | None = None) -> str:
    """One line: whether the ptxas Triton runs for compute capability ``major.minor`` (or ``ptxas``, given) can
    compile for it, and if not, what to do."""
    arch = gpu_arch(major, minor)
    try:
        triton_runs = triton_ptxas(major, minor)
    except RuntimeError as exc:
        return f"BROKEN: Triton finds no ptxas that runs ({exc}); {PTXAS_HINT.format(variable='TRITON_PTXAS_PATH')}"
    hint = PTXAS_HINT.format(variable=triton_runs.variable if triton_runs else "TRITON_PTXAS_PATH")
    if ptxas is None and triton_runs is None:
        return (f"no ptxas found (Triton's NVIDIA backend not installed): GPU kernels fall back to torch; {arch} "
                "not checked")
    source, ptxas = ("given", ptxas) if ptxas is not None else (triton_runs.source, triton_runs.path)
    try:
        version, targets = ptxas_targets(ptxas)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"BROKEN: {source} ptxas {ptxas} does not run ({exc}); {hint}"
    if arch in targets:
        return f"ok: {source} ptxas {ptxas} ({version}) targets {arch}"
    return f"PROBLEM: {source} ptxas {ptxas} ({version}) cannot target {arch}; {hint}"


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
