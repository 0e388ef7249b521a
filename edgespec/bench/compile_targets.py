"""Every Triton/Gluon kernel the runtime launches, compiled for the GPUs users run, on a machine without one.

How the launches are found: the real forward runs over a model of a published shape (``edgespec.bench.shapes``)
built on the ``meta`` device (no memory), with the arch hooks' product choice for the target's compute
capability, and every ``JITFunction.run`` recorded instead of launched. So the recorded kernels and constexprs are
exactly the ones the dispatchers (``quant_config``, ``WIDE_LAUNCHES``, the attention and GDN launch tables ...)
pick for that shape, row count and SM count. Each recorded launch is then specialised as Triton would specialise
it (its own binder, for the target's backend) and compiled with ``triton.compile(..., target=GPUTarget(...))``;
``cuobjdump`` reads registers, local memory (spills) and the SASS.

Needs Triton and, for sm_110a / sm_120a, a ptxas that knows them (CUDA 13: Triton 3.9's wheel bundles one,
``ptxas-blackwell``; else :func:`ensure_ptxas` points Triton's knob at the ``nvidia-cuda-nvcc`` wheel's when that is
installed). Test-time and tool-time only: nothing here runs when serving.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch


@dataclass(frozen=True)
class Target:
    """A GPU the runtime is compiled for: ptxas target, compute capability, the SM count its launch heuristics
    size grids by, the hook set it gets, and the most shared memory one program may take."""

    name: str
    capability: tuple[int, int]
    sms: int
    arch: str
    shared_limit: int


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("sm_110a", (11, 0), 20, "thor", 232448),      # Jetson AGX Thor: 20 SMs, 227 KB per program
    Target("sm_100a", (10, 0), 148, "rtx", 232448),      # B200
    Target("sm_120a", (12, 0), 170, "rtx", 101376),      # RTX 5090: 99 KB per program
    Target("sm_90a", (9, 0), 132, "rtx", 232448),        # H100 / H200
)}
# Verify rows the runtime uses (decode, chain verify, tree budgets) and the prefill length recorded.
ROWS = (1, 16, 32, 64)
PREFILL_TOKENS = 512
# SASS opcodes of the block-scaled tensor-core MMA: tcgen05 (sm_100 / sm_110) FP4 and FP8/6/4 kinds, sm_120's
# mma.sync with scale factors.
_BLOCK_SCALED_SASS = re.compile(r"^(UTCOMMA|UTCQMMA|OMMA\.SF|QMMA\.SF)")
_MMA_SASS = re.compile(r"MMA")


@dataclass
class Launch:
    """One recorded kernel launch: the kernel, its arguments as the dispatcher passed them, where it ran."""

    fn: Any
    args: tuple
    kwargs: dict
    stage: str                       # "decode" (1 row), "verify16", ..., "prefill"

    @property
    def name(self) -> str:
        return self.fn.fn.__name__

    @property
    def hot(self) -> bool:
        """Decode and verify kernels (every cycle); prefill kernels run once per request."""
        return self.stage != "prefill"


@dataclass
class Compiled:
    """What one launch compiled to on one target."""

    launch: Launch
    target: Target
    error: str = ""
    registers: int = 0
    local: int = 0                   # local-memory bytes per thread: spills (and stack arrays)
    shared: int = 0
    mma: Counter = field(default_factory=Counter)
    loop_instructions: int = 0       # per warp, in the main loop
    loop_ops: Counter = field(default_factory=Counter)   # the main loop's opcode histogram
    weights_per_trip: int = 0        # weights one main-loop trip multiplies (packed products), 0 if not known
    block_scaled_ptx: bool = False

    @property
    def block_scaled(self) -> bool:
        """The SASS holds the block-scaled tensor-core MMA (and the PTX asked for it)."""
        return self.block_scaled_ptx and any(_BLOCK_SCALED_SASS.match(op) for op in self.mma)

    @property
    def over_shared(self) -> bool:
        return self.shared > self.target.shared_limit

    @property
    def instructions_per_weight(self) -> float:
        """Lane-instructions per weight of the main loop (warps x 32 lanes x loop instructions / weights)."""
        if not self.weights_per_trip:
            return 0.0
        warps = self.launch.kwargs.get("num_warps", 4)
        return self.loop_instructions * 32 * warps / self.weights_per_trip


def ensure_ptxas(target: Target | None = None) -> str | None:
    """The ptxas Triton runs for ``target`` (default sm_110a) when it knows the target; else Triton's knob for that
    GPU pointed at the ``nvidia-cuda-nvcc`` wheel's ptxas, when that one knows it; None when neither does."""
    from edgespec.device_checks import ptxas_targets, triton_ptxas

    target = target or TARGETS["sm_110a"]
    chosen = triton_ptxas(*target.capability)
    if chosen is None:
        return None
    if target.name in ptxas_targets(chosen.path)[1]:
        return str(chosen.path)
    wheel = _wheel_ptxas()
    if wheel is None or target.name not in ptxas_targets(wheel)[1]:
        return None
    from triton import knobs
    for name, _ in chosen.knobs:
        setattr(knobs.nvidia, name, str(wheel))
    return str(wheel)


def _wheel_ptxas() -> Path | None:
    """The ptxas of the ``nvidia-cuda-nvcc`` wheel (CUDA 13: ``nvidia/cu13``), where it is installed."""
    try:
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for sub in ("cu13", "cuda_nvcc"):
            ptxas = Path(root) / sub / "bin" / "ptxas"
            if ptxas.is_file():
                return ptxas
    return None


def _import_kernel_modules() -> None:
    """Import every Triton/Gluon module up front: some compute module-level constants with torch, which must not
    happen under the meta device of the recording."""
    import edgespec.kernels as kernels
    for m in pkgutil.walk_packages(kernels.__path__, "edgespec.kernels."):
        if m.name.rsplit(".", 1)[-1].startswith(("triton_", "gluon_")):
            importlib.import_module(m.name)


@contextlib.contextmanager
def recording(target: Target, launches: list[Launch], stage: list[str]) -> Iterator[None]:
    """Within: tensors say they are on CUDA, the device is ``target`` (capability, SM count, PDL from SM90), and
    every Triton/Gluon launch is appended to ``launches`` (tagged with ``stage[0]``) instead of run."""
    import triton.runtime.jit as jit

    import edgespec.kernels as kernels

    _import_kernel_modules()

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs, stage[0]))

    with contextlib.ExitStack() as st:
        st.enter_context(mock.patch.object(jit.JITFunction, "run", record))
        st.enter_context(mock.patch.object(torch.Tensor, "is_cuda", property(lambda self: True)))
        st.enter_context(mock.patch("torch.cuda.is_available", lambda: True))
        st.enter_context(mock.patch("torch.cuda.get_device_capability", lambda *a, **k: target.capability))
        st.enter_context(mock.patch("torch.cuda.current_device", lambda: 0))
        for name, value in (("sm_count", lambda device: target.sms),
                            ("pdl_enabled", lambda device: target.capability >= (9, 0)),
                            ("_cuda_capability", lambda index: target.capability)):
            for module in [m for n, m in list(__import__("sys").modules.items()) if n.startswith("edgespec.")]:
                if getattr(module, name, None) is not None and module.__name__.startswith("edgespec.kernels"):
                    st.enter_context(mock.patch.object(module, name, value))
        kernels.triton_available.cache_clear()
        try:
            yield
        finally:
            kernels.triton_available.cache_clear()


def record_shape(shape: str, fmt: str, target: Target, rows: Sequence[int] = ROWS,
                 prefill: int = PREFILL_TOKENS) -> tuple[list[Launch], list[str]]:
    """The launches of one decode/verify forward per row count in ``rows`` and one prefill of ``prefill`` tokens
    (0: none) of ``shape`` with ``fmt`` weights, as ``target``'s hooks run them; and the stages that could not be
    recorded (a forward that needs a value from the device: ``stage: why``)."""
    from edgespec.arch.detect import hooks_class
    from edgespec.arch.rollback import rollback_strategy
    from edgespec.bench.formats import meta_model
    from edgespec.bench.gpu import shape_config
    from edgespec.models.layers import RotaryEmbedding
    from edgespec.weights.base import PackedWeight

    launches: list[Launch] = []
    failed: list[str] = []
    stage = ["load"]
    hooks = hooks_class(target.arch)()
    with recording(target, launches, stage), torch.device("meta"):
        model = meta_model(shape_config(shape), fmt, torch.bfloat16)
        model.rope = RotaryEmbedding(model.config, 4096).to("meta")    # its tables are built on the host
        for sub in model.modules():
            if isinstance(sub, PackedWeight):
                sub.kernel = hooks.weight_kernel(sub, target.capability)
        rollback = rollback_strategy(hooks.defaults.rollback)
        cache = hooks.new_cache(model, 4096, kv_fp8=hooks.defaults.kv_fp8, rollback=rollback, max_rows=max(rows))
        for n in rows:
            stage[0] = "decode" if n == 1 else f"verify{n}"
            try:
                cache.reset()
                mode = rollback.verify_mode(cache)
                model.forward(torch.zeros(n, dtype=torch.long), cache, taps=(), chunked=False, mode=mode)
            except Exception as exc:  # a forward that reads a device value (.item()) on the meta device
                failed.append(f"{stage[0]}: {type(exc).__name__}: {str(exc)[:120]}")
        if prefill:
            stage[0] = "prefill"
            try:
                cache.reset()
                hooks.prefill(model, cache, torch.zeros(prefill, dtype=torch.long), hooks.defaults.prefill_chunk, ())
            except Exception as exc:
                failed.append(f"prefill: {type(exc).__name__}: {str(exc)[:120]}")
    return launches, failed


def _specialise(launch: Launch, target: Target):
    """(source, options) of ``launch`` specialised as Triton's launcher would for ``target``."""
    import triton.runtime.jit as jit
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    backend = make_backend(GPUTarget("cuda", target.capability[0] * 10 + target.capability[1], 32))
    kwargs = dict(launch.kwargs)
    kwargs.setdefault("debug", False)
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    fn = launch.fn
    binder = jit.create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    try:
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
        source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    except ImportError:
        source = ASTSource
    return source(fn, signature, constexprs, attrs), options, backend


def launch_key(launch: Launch, target: Target) -> tuple:
    """What makes two launches one compiled kernel: the kernel and its specialisation (types, constexprs, alignment
    and options)."""
    src, options, _ = _specialise(launch, target)
    return (launch.fn, src.hash(), str(sorted(options.__dict__.items())))


def weights_per_trip(launch: Launch) -> int:
    """Weights one main-loop trip of a packed product multiplies: ``BLOCK_N`` rows times the K tile (the int4
    group, else the kernel's K tile); 0 for other kernels."""
    names = launch.fn.arg_names
    values = dict(zip(names, launch.args, strict=False)) | launch.kwargs
    if "BLOCK_N" not in values or not any(k in names for k in ("q_ptr", "w_ptr")):
        return 0
    tile = values.get("GROUP") or values.get("TILE") or values.get("BLOCK_K") or 128
    return int(values["BLOCK_N"]) * int(tile)


def compile_launch(launch: Launch, target: Target) -> Compiled:
    """Compile ``launch`` for ``target`` and read what it became (errors are kept, not raised)."""
    import triton

    from edgespec.kernels.launch.sass import dump_cubin, instructions, loop_body, opcode, resource_usage
    out = Compiled(launch, target, weights_per_trip=weights_per_trip(launch))
    try:
        src, options, _ = _specialise(launch, target)
        kernel = triton.compile(src, target=_gpu_target(target), options=options.__dict__)
        usage, sass = dump_cubin(kernel.asm["cubin"])
    except Exception as exc:
        out.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        return out
    res = resource_usage(usage)
    out.registers, out.local = res["registers"], res["local"] + res["stack"]
    out.shared = max(int(kernel.metadata.shared), res["static_shared"])
    listed = instructions(sass)
    out.mma = Counter(op for op in (opcode(t) for _, t in listed) if _MMA_SASS.search(op))
    body = loop_body(listed)
    out.loop_instructions = len(body)
    out.loop_ops = Counter(opcode(t) for t in body)
    out.block_scaled_ptx = "block_scale" in kernel.asm.get("ptx", "")
    return out


def _gpu_target(target: Target):
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", target.capability[0] * 10 + target.capability[1], 32)


def unique_launches(launches: Sequence[Launch], target: Target) -> list[Launch]:
    """One launch per compiled kernel (the first stage that launched it; a hot stage wins over prefill)."""
    seen: dict[tuple, Launch] = {}
    for launch in sorted(launches, key=lambda la: not la.hot):
        seen.setdefault(launch_key(launch, target), launch)
    return list(seen.values())


def describe(launch: Launch) -> str:
    """The constexprs that tell launches of one kernel apart (tile sizes, modes), and warps/stages."""
    names = launch.fn.arg_names
    values = dict(zip(names, launch.args, strict=False)) | launch.kwargs
    consts = [p.name for p in launch.fn.params if p.is_constexpr]
    shown = [f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in values.items()
             if k in consts and isinstance(v, (int, bool, str)) and k.isupper()]
    extra = [f"w{values.get('num_warps', 4)}s{values.get('num_stages', 3)}"]
    return " ".join(shown + extra)


def problems(results: Sequence[Compiled]) -> list[str]:
    """What fails the CI check: a compile error, a spill in a hot kernel, shared memory over the target's limit,
    a block-scaled product whose sm_100a/sm_110a SASS lacks the block-scaled MMA."""
    out = []
    for r in results:
        where = f"{r.target.name} {r.launch.name} ({r.launch.stage}: {describe(r.launch)})"
        if r.error:
            out.append(f"{where}: compile error: {r.error}")
        elif r.local and r.launch.hot:
            out.append(f"{where}: {r.local} B of local memory per thread (spills) in a hot kernel")
        elif r.over_shared:
            out.append(f"{where}: shared memory {r.shared} B over the limit {r.target.shared_limit} B")
        elif r.launch.name == "_block_scaled_kernel" and r.target.capability[0] in (10, 11) and not r.block_scaled:
            out.append(f"{where}: no block-scaled tensor-core MMA in the SASS ({dict(r.mma)})")
    return out


def report_lines(results: Sequence[Compiled]) -> list[str]:
    """One line per compiled kernel: target, kernel, stage, launch, registers, spills, shared memory against the
    limit, the MMA instruction, block-scaled or not, lane-instructions per weight of the main loop."""
    lines = [f"{'target':8} {'kernel':28} {'stage':9} {'regs':>4} {'spill B':>7} {'shared KB':>12}  "
             f"{'MMA (SASS)':30} {'instr/weight':>12}  launch"]
    shown = set()
    for r in results:
        key = (r.target.name, r.launch.name, r.launch.stage, describe(r.launch))
        if key in shown:         # launches that differ only in an argument's alignment read the same here
            continue
        shown.add(key)
        if r.error:
            lines.append(f"{r.target.name:8} {r.launch.name:28} {r.launch.stage:9} COMPILE ERROR: {r.error}")
            continue
        mma = ",".join(op for op, _ in r.mma.most_common(2)) or "-"
        if r.launch.name == "_block_scaled_kernel":
            mma = ("block-scaled " if r.block_scaled else "EMULATED ") + mma
        ipw = f"{r.instructions_per_weight:.2f}" if r.weights_per_trip else "-"
        lines.append(f"{r.target.name:8} {r.launch.name:28} {r.launch.stage:9} {r.registers:4d} {r.local:7d} "
                     f"{r.shared / 1024:5.1f}/{r.target.shared_limit / 1024:5.0f}  {mma[:30]:30} {ipw:>12}  "
                     f"{describe(r.launch)}")
    return lines


def compile_shape(shape: str, fmt: str, target: Target, rows: Sequence[int] = ROWS, prefill: int = PREFILL_TOKENS,
                  kernels: Sequence[str] = ()) -> tuple[list[Compiled], list[str]]:
    """Record ``shape`` in ``fmt`` on ``target`` and compile every distinct launch (only those of ``kernels`` when
    given); returns the results and the stages that could not be recorded."""
    launches, failed = record_shape(shape, fmt, target, rows, prefill)
    chosen = [la for la in launches if not kernels or la.name in kernels]
    return [compile_launch(la, target) for la in unique_launches(chosen, target)], failed
