"""Build and load the CUDA C++ kernels in ``edgespec/kernels/cuda/`` on first use.

A kernel source is compiled by ``nvcc`` into a shared library for the GPU's own architecture (e.g. ``sm_90`` on an
H100/H200, ``sm_110`` on Jetson Thor), cached under ``$EDGESPEC_CACHE_DIR`` (default ``~/.cache/edgespec/cuda``)
by a hash of the source, the target and the compiler version, and opened with :mod:`ctypes`: no torch extension
headers, no pybind, no ninja, so a build takes seconds. The library exposes plain ``extern "C"`` launch
functions that take device pointers and a ``cudaStream_t``.

Nothing here is required: where ``nvcc`` is missing, the build fails, or ``EDGESPEC_CUDA_KERNELS=0``, the loader
returns ``None`` once, logs why, and callers keep their Triton kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "cuda"
NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")


class CudaBuildError(RuntimeError):
    """A CUDA kernel library could not be built or opened; the message names the source and the cause."""


def cuda_kernels_enabled() -> bool:
    """False when ``EDGESPEC_CUDA_KERNELS=0``: every caller then runs its Triton kernel."""
    return os.environ.get("EDGESPEC_CUDA_KERNELS", "1") != "0"


def find_nvcc() -> str | None:
    """``nvcc`` from ``$CUDA_HOME/bin``, the ``PATH``, or ``/usr/local/cuda/bin`` (JetPack's place)."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(on_path)
    candidates.append("/usr/local/cuda/bin/nvcc")
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def cache_dir() -> Path:
    """Where built libraries are kept (``$EDGESPEC_CACHE_DIR/cuda`` or ``~/.cache/edgespec/cuda``)."""
    root = os.environ.get("EDGESPEC_CACHE_DIR") or os.path.join(Path.home(), ".cache", "edgespec")
    return Path(root) / "cuda"


def gencode(capability: tuple[int, int]) -> str:
    """nvcc target of a compute capability: real machine code for that GPU, e.g. ``(9, 0)`` -> sm_90."""
    major, minor = capability
    if major < 8:
        raise CudaBuildError(f"compute capability {major}.{minor}: the CUDA kernels need sm_80 or newer")
    return f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"


def _nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CudaBuildError(f"{nvcc} --version could not run: {exc}") from exc
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "unknown"


def build_library(name: str, capability: tuple[int, int], nvcc: str | None = None) -> Path:
    """Compile ``cuda/<name>.cu`` for ``capability`` (or reuse the cached build). Returns the library's path.
    Raises :class:`CudaBuildError` naming the cause: no source, no nvcc, or the compiler's own error text."""
    source = SOURCE_DIR / f"{name}.cu"
    if not source.is_file():
        raise CudaBuildError(f"CUDA source {source} not found")
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise CudaBuildError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    target = gencode(capability)
    key = hashlib.sha256(b"\0".join([source.read_bytes(), target.encode(), " ".join(NVCC_FLAGS).encode(),
                                     _nvcc_version(nvcc).encode()])).hexdigest()[:16]
    out = cache_dir() / f"{name}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses (several test workers) never see a partial file.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [nvcc, *NVCC_FLAGS, target, "-o", str(tmp_out), str(source)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CudaBuildError(f"{' '.join(cmd)} could not run: {exc}") from exc
        if done.returncode != 0:
            raise CudaBuildError(f"nvcc failed on {source.name} ({target}):\n{done.stderr.strip()[-2000:]}")
        os.replace(tmp_out, out)
    return out


@functools.cache
def load_library(name: str, capability: tuple[int, int]) -> ctypes.CDLL | None:
    """The built library of ``cuda/<name>.cu`` for ``capability``, or ``None`` (logged once with the reason) when
    the CUDA kernels are off or cannot be built here."""
    if not cuda_kernels_enabled():
        return None
    try:
        return ctypes.CDLL(str(build_library(name, capability)))
    except (CudaBuildError, OSError) as exc:
        log.warning("CUDA kernel %s unavailable, using the Triton kernel instead: %s", name, exc)
        return None
