"""The GGUF K-quant GEMV's arithmetic on the CPU: ``lab/kquant_gemv_interp.py`` runs the kernel in Triton's
interpreter against the CPU decode of the same bytes (one-hot rows bit for bit, fp32 rows within 2e-6, a row's bits
at 1..4 rows, bf16/fp16 rows as their fp32 widening). A fresh process, since the interpreter must be chosen before
Triton compiles anything; skipped where Triton is not installed (the CPU-only setup)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter)")
def test_kquant_gemv_in_the_interpreter_matches_the_cpu_decode() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "lab" / "kquant_gemv_interp.py")], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": ok") == 3, run.stdout
