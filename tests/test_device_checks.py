"""edgespec doctor's Thor checks: ptxas targets (on a stand-in ptxas that answers --version/--help as NVIDIA's does)
and the power mode lines; the service unit's ordering after nvpmodel."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch

from edgespec.device_checks import gpu_arch, power_status, ptxas_status, triton_ptxas

HELP = """--gpu-name <gpu name>                      (-arch)
        Specify name of NVIDIA GPU to generate code for.
        Allowed values for this option:  {archs}.
        Default value:  'sm_52'.
"""


def stand_in_ptxas(folder: Path, archs: list[str], release: str) -> Path:
    """An executable that answers --version and --help with the layout of NVIDIA's ptxas."""
    exe = folder / "ptxas"
    listed = ",".join(f"'{a}'" for a in archs)
    exe.write_text("#!/bin/sh\n"
                   f"if [ \"$1\" = --version ]; then echo 'ptxas: NVIDIA (R) Ptx optimizing assembler'; "
                   f"echo 'Cuda compilation tools, release {release}'; exit 0; fi\n"
                   f"cat <<'END'\n{HELP.format(archs=listed)}END\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_arch_names() -> None:
    assert gpu_arch(11, 0) == "sm_110a" and gpu_arch(9, 0) == "sm_90a" and gpu_arch(8, 7) == "sm_87"


def _no_ptxas_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH"):
        monkeypatch.delenv(name, raising=False)


def _triton_choice(major: int, minor: int):
    """The ptxas Triton's own backend runs for ``major.minor`` (the oracle), skipping without that backend."""
    compiler = pytest.importorskip("triton.backends.nvidia.compiler")
    if not hasattr(compiler, "get_ptxas"):
        pytest.skip("a Triton without per-GPU ptxas knobs")
    return compiler.get_ptxas(major * 10 + minor)


def test_old_ptxas_cannot_target_thor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_ptxas_variables(monkeypatch)
    old = stand_in_ptxas(tmp_path, ["sm_90", "sm_90a", "sm_100", "sm_100a"], "12.8, V12.8.93")
    line = ptxas_status(11, 0, old)
    chosen = triton_ptxas(11, 0)
    variable = chosen.variable if chosen is not None else "TRITON_PTXAS_PATH"
    assert line.startswith("PROBLEM") and "sm_110a" in line and f"point {variable} at" in line, line
    assert ptxas_status(9, 0, old).startswith("ok") and "12.8" in ptxas_status(9, 0, old)


def test_the_check_follows_the_ptxas_triton_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ptxas checked for a GPU is the one Triton's backend picks for it (Triton 3.9: its CUDA 13
    ptxas-blackwell from sm_90 on, which knows sm_110a), not the first one found."""
    _no_ptxas_variables(monkeypatch)
    for major, minor in ((11, 0), (9, 0), (8, 7)):
        tool = _triton_choice(major, minor)
        chosen = triton_ptxas(major, minor)
        assert chosen.path == Path(tool.path) and chosen.bundled
        assert f"Triton's bundled ptxas {tool.path} " in ptxas_status(major, minor)


def test_new_ptxas_via_tritons_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_ptxas_variables(monkeypatch)
    _triton_choice(11, 0)
    variable = triton_ptxas(11, 0).knobs[0][1]      # the variable of the knob Triton reads for Thor
    new = stand_in_ptxas(tmp_path, ["sm_100a", "sm_110", "sm_110a"], "13.1, V13.1.80")
    monkeypatch.setenv(variable, str(new))
    line = ptxas_status(11, 0)
    assert line.startswith(f"ok: {variable} ptxas {new} ") and "13.1" in line, line


def test_missing_ptxas_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_ptxas_variables(monkeypatch)
    assert ptxas_status(11, 0, tmp_path / "nowhere" / "ptxas").startswith("BROKEN")


def test_power_mode_lines_only_where_the_tools_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert power_status() == {}
    (tmp_path / "nvpmodel").write_text("#!/bin/sh\necho 'NV Power Mode: MAXN'\necho 0\n")
    (tmp_path / "jetson_clocks").write_text("#!/bin/sh\necho 'CPU Cluster Switching: Disabled'\n"
                                            "echo 'GPU MinFreq=1575000000 MaxFreq=1575000000 CurrentFreq=1575000000'\n"
                                            "echo 'EMC MinFreq=204000000 MaxFreq=4266000000 CurrentFreq=4266000000'\n")
    for f in ("nvpmodel", "jetson_clocks"):
        (tmp_path / f).chmod(0o755)
    status = power_status()
    assert status["power mode (nvpmodel -q)"] == "NV Power Mode: MAXN 0"
    assert status["clocks (jetson_clocks --show)"].startswith("GPU MinFreq=1575000000")


@pytest.mark.gpu
def test_this_gpu_is_checked() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    major, minor = torch.cuda.get_device_capability()
    line = ptxas_status(major, minor)
    print(line)
    assert line.startswith(("ok", "PROBLEM", "no ptxas")), line


def test_service_starts_after_the_power_mode() -> None:
    unit = (Path(__file__).resolve().parents[1] / "configs" / "edgespec-agent.service").read_text()
    after = [ln.split("=", 1)[1].split() for ln in unit.splitlines() if ln.startswith("After=")]
    assert any("nvpmodel.service" in a for a in after)
    # Ordering only: a machine without nvpmodel still starts the service.
    assert not any(ln.startswith(("Requires=", "BindsTo=")) and "nvpmodel" in ln for ln in unit.splitlines())
