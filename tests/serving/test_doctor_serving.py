"""``edgespec doctor`` reports the demo model's conversion and whether the serving stack imports."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgespec import doctor


def test_doctor_reports_demo_and_serving(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))     # an empty cache: nothing converted there
    status = doctor.demo_model_status()
    assert status.startswith(("not converted", "unavailable")), status
    serving = doctor.serving_status()
    assert serving.startswith("ok (") and "llguidance" in serving and "prometheus-client" in serving
    info = doctor.report()
    assert {"demo model", "serving stack"} <= set(info)


def test_doctor_sees_a_converted_demo(demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(demo_model_dir.parent))
    assert doctor.demo_model_status().startswith("converted at")
