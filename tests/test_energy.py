"""Energy meters (edgespec.energy): INA3221 rails read from a fake Jetson sysfs tree, NVML on a real GPU, none on CPU;
and the joules that reach the response telemetry and /metrics."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from edgespec.energy import EnergyReading, EnergySpan, NvmlEnergy, RailEnergy, find_rails, open_meter


def fake_jetson(root: Path, rails: dict[str, tuple[float, float]], hwmon: str = "1-0040/hwmon/hwmon3") -> Path:
    """An INA3221 sysfs tree: ``rails`` maps a label to (millivolts, milliamps), channels numbered from 1."""
    folder = root / "bus/i2c/drivers/ina3221" / hwmon
    folder.mkdir(parents=True, exist_ok=True)
    for i, (label, (mv, ma)) in enumerate(rails.items(), start=1):
        (folder / f"in{i}_label").write_text(label + "\n")
        (folder / f"in{i}_input").write_text(f"{mv:.0f}\n")
        (folder / f"curr{i}_input").write_text(f"{ma:.0f}\n")
    return folder


def test_the_input_rail_is_the_whole_board(tmp_path: Path) -> None:
    fake_jetson(tmp_path, {"VDD_GPU_SOC": (5000, 2000), "VDD_CPU_CV": (5000, 1000), "VDD_IN": (19000, 2000)})
    rails = find_rails(tmp_path)
    assert [r.label for r in rails] == ["VDD_IN"]
    assert rails[0].watts() == pytest.approx(38.0)


def test_without_an_input_rail_the_rails_are_summed(tmp_path: Path) -> None:
    fake_jetson(tmp_path, {"VDD_GPU": (5000, 2000), "VDD_CPU": (5000, 1000)})
    fake_jetson(tmp_path, {"VDD_SOC": (1000, 1000)}, hwmon="1-0041/hwmon/hwmon4")
    assert sorted(r.label for r in find_rails(tmp_path)) == ["VDD_CPU", "VDD_GPU", "VDD_SOC"]
    assert sum(r.watts() for r in find_rails(tmp_path)) == pytest.approx(16.0)


def test_no_ina3221_means_no_rails(tmp_path: Path) -> None:
    assert find_rails(tmp_path) == []
    assert open_meter("cpu", tmp_path) is None          # CPU: no meter, whatever the machine has


def test_rail_energy_integrates_power_over_time(tmp_path: Path) -> None:
    folder = fake_jetson(tmp_path, {"VDD_IN": (20000, 1000)})     # 20 W
    meter = RailEnergy(find_rails(tmp_path), period_s=0.005)
    try:
        span = EnergySpan(meter)
        time.sleep(0.3)
        first = span.stop()
        assert first is not None and first.watts == pytest.approx(20.0, rel=0.02)
        assert first.joules == pytest.approx(20.0 * first.seconds, rel=0.02)
        (folder / "curr1_input").write_text("3000\n")              # the load rises to 60 W
        time.sleep(0.05)
        span = EnergySpan(meter)
        time.sleep(0.3)
        second = span.stop()
        assert second is not None and second.watts == pytest.approx(60.0, rel=0.05)
        assert second.per_token(30) == pytest.approx(second.joules / 30)
    finally:
        meter.close()


def test_reading_per_token_and_watts() -> None:
    r = EnergyReading(joules=12.0, seconds=4.0)
    assert r.watts == 3.0 and r.per_token(6) == 2.0 and r.per_token(0) is None
    assert EnergySpan(None).stop() is None


@pytest.mark.gpu
def test_nvml_counter_moves_under_load() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("pynvml")
    meter = NvmlEnergy(torch.cuda.current_device())
    try:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        span = EnergySpan(meter)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            a @ a
        torch.cuda.synchronize()
        used = span.stop()
        assert used is not None and used.joules > 0 and 20.0 < used.watts < 1500.0
    finally:
        meter.close()
