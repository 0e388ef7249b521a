"""Build and call the compiled GGUF block products and CPU step helpers (``gguf_cpu.c``) through ctypes.

The library is compiled once with the system ``gcc`` (``-O3 -march=native -pthread``: this machine's vector
units, and a small thread pool of its own) by ``tools/setup.sh`` or on first use, into the package
folder when it is writable, else the user cache. No compiler or a CPU without AVX2/FMA/F16C: :func:`library`
returns None and the GGUF formats fall back to their torch reference product (correct, slower), saying so once.
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

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gguf_cpu.c")
_FLAGS = ["-O3", "-march=native", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-pthread", "-shared", "-fPIC"]

_lib: ctypes.CDLL | None = None
_tried = False


def _lib_name() -> str:
    # The source's hash in the name: an edited source is rebuilt, never confused with an old build.
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:12]
    return f"_gguf_cpu_{digest}.so"


def _candidates() -> list[Path]:
    from edgespec.paths import cache_root
    return [SOURCE.parent / _lib_name(), cache_root() / "native" / _lib_name()]


def build(quiet: bool = False) -> Path | None:
    """Compile the library if no current build exists; its path, or None when it cannot be built."""
    for path in _candidates():
        if path.is_file():
            return path
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        if not quiet:
            log.warning("no C compiler found: GGUF weights use the slower torch reference product")
        return None
    for path in _candidates():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(fd)
        except OSError:
            continue
        proc = subprocess.run([cc, *_FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            if not quiet:
                log.warning("building %s failed (GGUF weights use the torch reference product):\n%s",
                            SOURCE.name, proc.stderr[-2000:])
            return None
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)   # atomic: a concurrent build of the same source writes the same file
        return path
    return None


def library() -> ctypes.CDLL | None:
    """The loaded library (built on first use), or None where it cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    from edgespec.kernels.options import active
    if not active().gguf_native:
        return None
    path = build()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.gguf_matmul.restype = ctypes.c_int
    lib.gguf_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.add_rms_norm_f32.restype = None
    lib.add_rms_norm_f32.argtypes = [p, p, p, f, i, i, p, p]
    lib.llama_attention_f32.restype = None
    lib.llama_attention_f32.argtypes = [p, i, i, i, i, p, p, i, p, p, i, f, p, p]
    lib.silu_mul_f32.restype = None
    lib.silu_mul_f32.argtypes = [p, i, i, p]
    _lib = lib
    return lib


def threads() -> int:
    """Threads of one product: the ``gguf_threads`` kernel option (``EDGESPEC_GGUF_THREADS``), else every core
    this process may use."""
    from edgespec.kernels.options import active
    explicit = active().gguf_threads
    return explicit if explicit is not None else _cores()


@functools.cache
def _cores() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def matmul(kind: int, blocks: torch.Tensor, n: int, k: int, x: torch.Tensor, out: torch.Tensor,
           nthreads: int) -> None:
    """``out [M, n] = x [M, k] @ W^T`` with ``W`` the ggml-type-``kind`` rows in ``blocks`` (contiguous fp32
    ``x`` and ``out``)."""
    lib = library()
    assert lib is not None
    rc = lib.gguf_matmul(kind, blocks.data_ptr(), n, k, x.data_ptr(), x.shape[0], out.data_ptr(), nthreads)
    if rc == -2:
        raise MemoryError("GGUF product: no memory for the block sums")
    if rc != 0:
        raise ValueError(f"ggml type {kind} has no compiled product")
