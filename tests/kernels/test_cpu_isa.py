"""The compiled CPU kernels give the same bits on every instruction set: AVX-512, AVX2 and portable C on this x86
machine (in-process), and NEON cross-compiled for AArch64 (Thor's CPU) and run under qemu-user, on the same
inputs; a whole greedy generation through the layer stack too, against the Python engine's tokens.

The Arm tests need ``aarch64-linux-gnu-gcc`` and ``qemu-aarch64`` (Debian's ``gcc-aarch64-linux-gnu`` and
``qemu-user``; ``tools/setup.sh`` installs them where it may). They skip without them, unless
``EDGESPEC_REQUIRE_QEMU=1`` (CI, ``.ci/run``) makes a missing toolchain a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from cpu_cases import build_harness, cases, python_greedy, run_harness, run_native, write_stack_dump

from edgespec.kernels.cpu import gguf_native

pytestmark = pytest.mark.skipif(gguf_native.library() is None, reason="the compiled kernels cannot be built here")
QEMU = "qemu-aarch64"
CROSS = "aarch64-linux-gnu-gcc"


def _missing(what: str) -> None:
    if os.environ.get("EDGESPEC_REQUIRE_QEMU") == "1":
        pytest.fail(f"{what} is required here (EDGESPEC_REQUIRE_QEMU=1): tools/setup.sh installs it")
    pytest.skip(f"{what} not installed")


@pytest.fixture()
def restore_isa():
    lib = gguf_native.library()
    chosen = lib.gguf_isa()
    yield lib
    assert lib.gguf_use_isa(chosen) == 0


def _isas_here(lib) -> list[str]:
    return [name for name in ("avx512", "avx2", "neon", "scalar") if lib.gguf_use_isa(name.encode()) == 0]


def test_every_isa_of_this_cpu_gives_the_same_bits(restore_isa) -> None:
    lib = restore_isa
    isas = _isas_here(lib)
    assert "scalar" in isas and lib.gguf_use_isa(b"no-such-isa") != 0
    all_cases = cases()
    want = None
    for name in isas:
        assert lib.gguf_use_isa(name.encode()) == 0 and lib.gguf_isa().decode() == name
        got = [run_native(c) for c in all_cases]
        if want is None:
            want = got
            continue
        for c, a, b in zip(all_cases, got, want, strict=True):
            assert a == b, f"{c.name}: {name} differs from {isas[0]}"


def test_kernel_option_names_an_isa_this_cpu_lacks() -> None:
    from edgespec.errors import ConfigError
    from edgespec.kernels.options import KernelOptions

    with pytest.raises(ConfigError, match="gguf_isa 'sse9'"):
        KernelOptions(gguf_isa="sse9")


@pytest.fixture(scope="module")
def arm_harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which(CROSS) is None:
        _missing(CROSS)
    if shutil.which(QEMU) is None:
        _missing(QEMU)
    binary = build_harness(CROSS, tmp_path_factory.mktemp("arm") / "harness", static=True)
    assert binary is not None, "cross-compiling the harness failed (printed above)"
    isa = subprocess.run([QEMU, str(binary), "isa"], capture_output=True, text=True, timeout=60)
    assert isa.stdout.strip() == "neon", isa.stderr
    return binary


@pytest.fixture(scope="module")
def x86_harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = build_harness(os.environ.get("CC", "gcc"), tmp_path_factory.mktemp("x86") / "harness", static=False)
    assert binary is not None
    return binary


def test_neon_under_qemu_gives_the_x86_bits(arm_harness: Path, tmp_path: Path) -> None:
    for case in cases(seed=1):
        got = run_harness([QEMU], arm_harness, case, tmp_path)
        assert got == run_native(case), case.name
    # the portable C build of the Arm harness agrees too
    for case in cases(seed=2)[:6]:
        assert run_harness([QEMU], arm_harness, case, tmp_path, isa="scalar") == run_native(case), case.name


def test_the_native_harness_runs_the_library(x86_harness: Path, tmp_path: Path) -> None:
    for case in cases(seed=3)[::5]:
        assert run_harness([], x86_harness, case, tmp_path) == run_native(case), case.name


def _tiny_model(tmp_path: Path, arch: str, qtype: str):
    from gguf_files import write_tiny_gguf

    from edgespec.loading.gguf_model import load_gguf_target

    return load_gguf_target(write_tiny_gguf(tmp_path / f"{arch}.gguf", qtype, arch=arch), max_positions=256)[0]


@pytest.mark.parametrize(("arch", "qtype"), [("llama", "Q4_1"), ("qwen3", "Q8_0")])
def test_greedy_tokens_equal_on_x86_and_under_qemu(arch: str, qtype: str, arm_harness: Path, x86_harness: Path,
                                                   tmp_path: Path) -> None:
    model = _tiny_model(tmp_path, arch, qtype)
    prompt, n_new, max_len = [1, 5, 260, 7, 99, 3, 42], 24, 64
    with torch.inference_mode():
        want = python_greedy(model, prompt, n_new, max_len)
    dump = write_stack_dump(model, prompt, max_len, tmp_path / "stack.bin")
    for prefix, binary in (([], x86_harness), ([QEMU], arm_harness)):
        out = tmp_path / "tokens.bin"
        proc = subprocess.run([*prefix, str(binary), "greedy", str(dump), str(out), str(n_new), "2"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.int32).tolist() == want, prefix
