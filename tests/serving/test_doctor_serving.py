"""``edgespec doctor`` reports where the demo model comes from, the CPU's products and whether the serving stack
imports."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgespec import doctor
from edgespec.kernels.cpu.gguf_native import Toolchain


def test_doctor_reports_demo_and_serving(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))     # an empty cache: nothing converted there
    status = doctor.demo_model_status()
    assert status.startswith("ready: ") and "served packed" in status and "not converted yet" in status, status
    products = doctor.cpu_products_line()
    assert ("compiled CPU products" in products) == (Toolchain.find() is not None), products
    serving = doctor.serving_status()
    assert serving.startswith("ok (") and "llguidance" in serving and "prometheus-client" in serving
    info = doctor.report()
    assert {"demo model", "serving stack"} <= set(info)


def test_doctor_sees_a_converted_demo(demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(demo_model_dir.parent))
    assert "(gguf_weights: fp32) converted at" in doctor.demo_model_status()
