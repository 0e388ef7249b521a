"""Energy meters: joules spent by the device while a request or a benchmark runs (a robot runs on a battery).

* :class:`NvmlEnergy` -- discrete NVIDIA GPUs: NVML's total-energy counter (millijoules since the driver loaded,
  ``nvmlDeviceGetTotalEnergyConsumption``, Volta and later) through ``nvidia-ml-py`` (imported only here, optional).
* :class:`RailEnergy` -- Jetson (Orin, Thor): the INA3221 power monitors in sysfs
  (``/sys/bus/i2c/drivers/ina3221/*/hwmon/hwmon*/in{N}_label``, ``in{N}_input`` in mV, ``curr{N}_input`` in mA).
  They give power, not energy, so a thread samples them every ``period_s`` and integrates. The module's input rail
  (``VDD_IN`` or ``VIN*``) is the whole board's draw; without one, the rails found are summed.
* none on CPU: :func:`open_meter` returns None and every figure that needs one is left out.

:class:`EnergySpan` reads a meter at the start and end of a piece of work; ``joules / tokens`` and ``joules /
seconds`` (average watts) are what ``edgespec bench``, the response telemetry and ``/metrics`` report.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Labels of the rail that carries the whole module's input power (the others are parts of it).
INPUT_RAILS = ("VDD_IN", "VIN_SYS_5V0", "VIN")


class EnergyMeter(ABC):
    """A monotonic energy counter: :meth:`joules` since an arbitrary origin."""

    name: str = "meter"

    @abstractmethod
    def joules(self) -> float:
        """Energy since this meter's origin, in joules."""

    def close(self) -> None:
        """Release what the meter holds (a sampling thread, the NVML handle)."""


class NvmlEnergy(EnergyMeter):
    """NVML's total-energy counter of GPU ``index`` (discrete GPUs)."""

    name = "nvml"

    def __init__(self, index: int = 0) -> None:
        import pynvml  # nvidia-ml-py: optional, only where a meter is asked for

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self._origin = self._millijoules()    # raises NVMLError_NotSupported on GPUs without the counter

    def _millijoules(self) -> int:
        return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))

    def joules(self) -> float:
        return (self._millijoules() - self._origin) / 1000.0

    def close(self) -> None:
        self._nvml.nvmlShutdown()


@dataclass(frozen=True)
class Rail:
    """One INA3221 channel: its label and the sysfs files of its voltage (mV) and current (mA)."""

    label: str
    volts_file: Path
    amps_file: Path

    def watts(self) -> float:
        millivolts = float(self.volts_file.read_text())
        milliamps = float(self.amps_file.read_text())
        return millivolts * milliamps / 1e6


def find_rails(sys_root: Path | str = "/sys") -> list[Rail]:
    """The INA3221 rails under ``sys_root`` worth reading: the module input rail alone when there is one (it already
    holds the others), else every labelled channel. Empty when there is no INA3221 (not a Jetson)."""
    base = Path(sys_root) / "bus/i2c/drivers/ina3221"
    rails = []
    for hwmon in sorted(base.glob("*/hwmon/hwmon*")):
        for label_file in sorted(hwmon.glob("in*_label")):
            channel = label_file.name[2:-len("_label")]
            volts, amps = hwmon / f"in{channel}_input", hwmon / f"curr{channel}_input"
            if volts.is_file() and amps.is_file():
                rails.append(Rail(label_file.read_text().strip(), volts, amps))
    inputs = [r for r in rails if r.label.upper() in INPUT_RAILS]
    return inputs[:1] if inputs else rails


class RailEnergy(EnergyMeter):
    """Energy integrated from INA3221 power readings (Jetson); a daemon thread samples every ``period_s``."""

    name = "ina3221"

    def __init__(self, rails: list[Rail], period_s: float = 0.02) -> None:
        if not rails:
            raise ValueError("RailEnergy needs at least one rail")
        self.rails = rails
        self.period_s = period_s
        self._lock = threading.Lock()
        self._joules = 0.0
        self._last_t = time.perf_counter()
        self._last_w = self._watts()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="edgespec-energy", daemon=True)
        self._thread.start()

    def _watts(self) -> float:
        return sum(r.watts() for r in self.rails)

    def _sample(self) -> float:
        """Integrate up to now (trapezoids between samples) and return the total."""
        with self._lock:
            now, watts = time.perf_counter(), self._watts()
            self._joules += 0.5 * (watts + self._last_w) * (now - self._last_t)
            self._last_t, self._last_w = now, watts
            return self._joules

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._sample()
            except OSError:   # a rail that vanished (driver unloaded): keep the total so far
                return

    def joules(self) -> float:
        return self._sample()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)


def open_meter(device: torch.device | str, sys_root: Path | str = "/sys") -> EnergyMeter | None:
    """The meter for ``device``: INA3221 rails on a Jetson, NVML on a discrete CUDA GPU, None on CPU or where
    neither is available (no nvidia-ml-py, a GPU without the energy counter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    rails = find_rails(sys_root)
    if rails:
        return RailEnergy(rails)
    try:
        return NvmlEnergy(device.index if device.index is not None else torch.cuda.current_device())
    except Exception:  # ImportError (nvidia-ml-py absent), NVMLError (no driver, counter not supported)
        return None


@dataclass
class EnergyReading:
    """Energy spent over ``seconds``: ``watts`` on average, ``per_token`` for ``tokens`` generated."""

    joules: float
    seconds: float

    @property
    def watts(self) -> float:
        return self.joules / self.seconds if self.seconds > 0 else 0.0

    def per_token(self, tokens: int) -> float | None:
        return self.joules / tokens if tokens > 0 else None


class EnergySpan:
    """Reads ``meter`` at construction; :meth:`stop` returns the energy since (None without a meter)."""

    def __init__(self, meter: EnergyMeter | None) -> None:
        self.meter = meter
        self._j0 = meter.joules() if meter is not None else 0.0
        self._t0 = time.perf_counter()

    def stop(self) -> EnergyReading | None:
        if self.meter is None:
            return None
        return EnergyReading(self.meter.joules() - self._j0, time.perf_counter() - self._t0)


def run_metered(fn: Callable[[], object], meter: EnergyMeter, seconds: float,
                sync: Callable[[], None] | None = None) -> tuple[EnergyReading, int]:
    """Call ``fn`` back to back for at least ``seconds`` (meters update every few tens of ms: a window of seconds
    keeps their step small against it) and return the energy spent and the number of calls. ``sync`` waits for the
    device before each reading."""
    if sync is not None:
        sync()
    span = EnergySpan(meter)
    t0, calls = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
        if calls % 16 == 0 and sync is not None:
            sync()
    if sync is not None:
        sync()
    reading = span.stop()
    assert reading is not None
    return reading, calls
