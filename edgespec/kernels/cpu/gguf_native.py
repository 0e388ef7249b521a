"""Build and call the compiled CPU path (``gguf_cpu.c`` and the per-ISA kernels of ``gguf_kernels.c``) through ctypes.

The library is compiled once with the system ``gcc`` by ``tools/setup.sh`` or on first use, into the package folder
when it is writable, else the user cache. It holds the portable driver (thread pool, layer stack) and the kernels
of every instruction set of its architecture, each object compiled with only its own ISA's flags: AVX-512, AVX2
and portable C on x86-64, NEON and portable C on AArch64. The driver picks the best set the CPU and OS support at
load time (:func:`isa`; the ``gguf_isa`` kernel option can ask for a lesser one), so the same build never
executes an instruction the machine lacks, and every set computes identical results (``gguf_kernels.c``). No
compiler: :func:`library` returns None and the GGUF formats fall back to their torch reference product (correct,
slower), saying so once.
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
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
DRIVER = HERE / "gguf_cpu.c"
KERNELS = HERE / "gguf_kernels.c"
HEADERS = ("gguf_cpu.h", "gguf_isa.h", "simd_x86.h", "simd_avx512.h", "simd_avx2.h", "simd_neon.h", "simd_scalar.h")
SOURCE = DRIVER   # the library's main source (kept for callers that name it)

# Every object: optimised, no contraction or reassociation of fp32 operations (the ISAs must agree bit for bit).
_COMMON = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-pthread"]
# Per architecture: the kernel objects, as (macro selecting the simd_*.h, that object's ISA flags).
ISA_OBJECTS: dict[str, list[tuple[str | None, list[str]]]] = {
    "x86_64": [(None, []), ("GGUF_ISA_AVX2", ["-mavx2", "-mfma", "-mf16c"]),
               ("GGUF_ISA_AVX512", ["-mavx512f", "-mavx2", "-mfma", "-mf16c"])],
    "aarch64": [(None, []), ("GGUF_ISA_NEON", [])],
}
ISA_NAMES = {"x86_64": ("avx512", "avx2", "scalar"), "aarch64": ("neon", "scalar")}

_lib: ctypes.CDLL | None = None
_tried = False


@dataclass(frozen=True)
class Toolchain:
    """A C compiler and the architecture it targets (``x86_64``, ``aarch64``)."""

    cc: str
    arch: str

    @classmethod
    def find(cls, cc: str = "gcc") -> Toolchain | None:
        """``cc`` (the system ``gcc`` unless named) when it exists and targets an architecture we have kernels
        for."""
        path = shutil.which(cc)
        if path is None:
            return None
        try:
            machine = subprocess.run([path, "-dumpmachine"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
        arch = machine.split("-")[0]
        return cls(path, arch) if arch in ISA_OBJECTS else None


def source_digest(arch: str) -> str:
    """Hash of every source, header and flag the build of ``arch`` uses: an edited source is rebuilt, never
    confused with an old build."""
    h = hashlib.sha256()
    for path in (DRIVER, KERNELS, *(HERE / name for name in HEADERS)):
        h.update(path.read_bytes())
    h.update(repr((_COMMON, ISA_OBJECTS[arch])).encode())
    return h.hexdigest()[:12]


def compile_objects(tool: Toolchain, out_dir: Path, extra: list[str] = ()) -> tuple[list[Path], str]:
    """Compile the driver and every ISA object of ``tool.arch`` into ``out_dir``: (objects, error text or "")."""
    objects = []
    units = [(DRIVER, None, [])] + [(KERNELS, macro, flags) for macro, flags in ISA_OBJECTS[tool.arch]]
    for i, (src, macro, flags) in enumerate(units):
        obj = out_dir / f"unit{i}.o"
        defines = [f"-D{macro}"] if macro else []
        proc = subprocess.run([tool.cc, *_COMMON, *extra, *flags, *defines, "-c", str(src), "-o", str(obj)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return [], proc.stderr[-2000:]
        objects.append(obj)
    return objects, ""


def _lib_name(arch: str) -> str:
    return f"_gguf_cpu_{arch}_{source_digest(arch)}.so"


def _candidates(arch: str) -> list[Path]:
    from edgespec.paths import cache_root
    return [HERE / _lib_name(arch), cache_root() / "native" / _lib_name(arch)]


def build(quiet: bool = False) -> Path | None:
    """Compile the library if no current build exists; its path, or None when it cannot be built."""
    tool = Toolchain.find()
    if tool is None:
        if not quiet:
            log.warning("no C compiler for this architecture found: GGUF weights use the slower torch reference "
                        "product")
        return None
    for path in _candidates(tool.arch):
        if path.is_file():
            return path
    for path in _candidates(tool.arch):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(fd)
        except OSError:
            continue
        with tempfile.TemporaryDirectory() as work:
            objects, err = compile_objects(tool, Path(work))
            if not err:
                proc = subprocess.run([tool.cc, "-shared", "-pthread", *map(str, objects), "-o", tmp, "-lm"],
                                      capture_output=True, text=True)
                err = proc.stderr[-2000:] if proc.returncode else ""
        if err:
            os.unlink(tmp)
            if not quiet:
                log.warning("building %s failed (GGUF weights use the torch reference product):\n%s",
                            DRIVER.name, err)
            return None
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)   # atomic: a concurrent build of the same source writes the same file
        return path
    return None


def _declare(lib: ctypes.CDLL) -> None:
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    signatures = {
        "gguf_matmul": (i, [i, p, i, i, p, i, p, i]),
        "gguf_rows": (i, [i, p, i, i, p, i, p]),
        "add_rms_norm_f32": (None, [p, p, p, f, i, i, p, p]),
        "llama_attention_f32": (i, [p, i, i, i, i, p, p, i, p, p, f, p, p, i, f, p, i]),
        "block_attention_f32": (i, [p, i, i, i, i, p, p, i, p, p, f, p, p, i, i, p, f, p, i]),
        "silu_mul_f32": (None, [p, i, i, p]),
        "gguf_stack_check": (i, [p]),
        "gguf_stack_forward": (i, [p, p, p, i, i, p, p, p, p, p, i, p, p, i]),
        "gguf_isa": (ctypes.c_char_p, []),
        "gguf_use_isa": (i, [ctypes.c_char_p]),
        "gguf_set_pinning": (None, [i]),
    }
    for name, (res, args) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def library() -> ctypes.CDLL | None:
    """The loaded library (built on first use, its ISA and pinning set from the kernel options), or None where it
    cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    from edgespec.kernels.options import active
    options = active()
    if not options.gguf_native:
        return None
    path = build()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    _declare(lib)
    if options.gguf_isa != "auto" and lib.gguf_use_isa(options.gguf_isa.encode()) != 0:
        from edgespec.errors import ConfigError
        raise ConfigError(f"gguf_isa {options.gguf_isa!r}: not available on this CPU (best here: "
                          f"{lib.gguf_isa().decode()}); give auto or a lesser one of "
                          f"{', '.join(ISA_NAMES.get(Toolchain.find().arch, ()))}")
    lib.gguf_set_pinning(int(options.gguf_pin))
    _lib = lib
    return lib


def isa() -> str | None:
    """The instruction set the compiled kernels use here (``avx512``, ``avx2``, ``neon``, ``scalar``), or None
    without the library."""
    lib = library()
    return None if lib is None else lib.gguf_isa().decode()


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
    if rc != 0:
        raise ValueError(f"ggml type {kind} with {k} inputs has no compiled product")
