"""Weight-format comparison (``edgespec bench formats dense,fp8,nvfp4,int4``): the same random model shape
served in each format, with its weight bytes read per decode step, its peak memory and its measured decode speed.

Batch-1 decode reads every weight once per token, so the bytes per token set the speed limit of a
bandwidth-bound device: the table projects it at Thor's 273 GB/s next to the measured speed. The step is the
served one: the arch hooks choose each packed weight's product (the Triton kernels on CUDA; on CPU the torch
reference, whose speed is bound by the dequantization arithmetic, not by the bytes) and capture it as a CUDA graph
on a GPU.

Each format's model is built on the meta device, allocated once, and its packed layers filled by quantizing one
random dense layer at a time (so the peak is the packed weights plus one dense layer).
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from edgespec.arch.base import ArchHooks
from edgespec.arch.detect import select_hooks
from edgespec.arch.rollback import rollback_strategy
from edgespec.bench.gpu import THOR_BW, fill_random_, shape_config, time_cuda, weight_bytes_per_token
from edgespec.bench.modes import FORMATS
from edgespec.cache.model_cache import ModelCache
from edgespec.errors import ConfigError
from edgespec.loading.hf_config import parse_config
from edgespec.memory import module_bytes, peak_bytes, plan_budget
from edgespec.models.decoder import TargetModel
from edgespec.models.layers import Linear
from edgespec.weights.base import PackedLinear, PackedWeight
from edgespec.weights.fp8_block import FP8BlockWeight
from edgespec.weights.int4 import Int4Weight
from edgespec.weights.nvfp4 import NVFP4Weight
from edgespec.weights.requantize import quantize_weight


def _packed_for(fmt: str, out_f: int, in_f: int, dtype: torch.dtype, group: int) -> PackedWeight | None:
    if fmt == "fp8":
        return FP8BlockWeight(out_f, in_f, dtype, device="meta")
    if fmt == "nvfp4" and in_f % 16 == 0:
        return NVFP4Weight(out_f, in_f, dtype, device="meta")
    if fmt == "int4" and in_f % group == 0:
        return Int4Weight(out_f, in_f, dtype, group, device="meta")
    if fmt == "mxfp4" and in_f % 32 == 0:
        from edgespec.weights.mxfp4 import MXFP4Weight
        return MXFP4Weight(out_f, in_f, dtype, device="meta")
    return None


def reset_peak(device: torch.device) -> None:
    """Start a new peak measurement (CUDA allocator stats; on the CPU, the kernel's VmHWM where allowed)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def current_rss() -> int:
    """Resident bytes of this process now (``VmRSS``): the CPU peak is reported as growth over it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def meta_model(cfg_dict: dict[str, Any], fmt: str, dtype: torch.dtype, group: int = 128,
               with_mtp: bool = False) -> TargetModel:
    """The served module tree of ``cfg_dict`` in ``fmt`` on the meta device (exact sizes, nothing allocated):
    linear layers packed where the format fits them (lm_head and embeddings stay ``dtype``), projections merged."""
    cfg = parse_config(cfg_dict)
    with torch.device("meta"):
        model = TargetModel(cfg, max_positions=1, with_mtp=with_mtp)
        model.to("meta")    # the rotary tables are built on the host whatever the ambient device
        model.to(dtype)
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.data = p.data.float()
    pack_meta_linears(model, fmt, dtype, group)
    model.merge_projections()
    return model


def pack_meta_linears(root: torch.nn.Module, fmt: str, dtype: torch.dtype, group: int = 128,
                      keep: tuple[str, ...] = ("lm_head",)) -> None:
    """Replace every :class:`Linear` under ``root`` (leaf names in ``keep`` excepted) by a meta
    :class:`PackedLinear` in ``fmt`` where the format fits its shape: the served sizes, nothing allocated."""
    if fmt == "dense":
        return
    for name, module in list(root.named_modules()):
        if isinstance(module, Linear) and name.rpartition(".")[2] not in keep:
            packed = _packed_for(fmt, module.out_features, module.in_features, dtype, group)
            if packed is not None:
                parent, _, leaf = name.rpartition(".")
                setattr(root.get_submodule(parent) if parent else root, leaf, PackedLinear(packed))


def format_model(cfg_dict: dict[str, Any], fmt: str, device: torch.device, dtype: torch.dtype, max_len: int,
                 group: int = 128, seed: int = 0) -> TargetModel:
    """A random model of ``cfg_dict`` whose linear layers (lm_head and embeddings excepted) are in ``fmt``."""
    cfg = parse_config(cfg_dict)
    model = meta_model(cfg_dict, fmt, dtype, group)
    budget = plan_budget(cfg, module_bytes(model), device, dtype, max_len, packed=fmt != "dense")
    budget.check()
    model = model.to_empty(device=device)
    model.memory_budget = budget
    from edgespec.models.layers import RotaryEmbedding
    model.rope = RotaryEmbedding(cfg, max_len).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    fill_random_(model, gen)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, PackedWeight):
                dense = torch.empty(module.out_features, module.in_features, device=device).normal_(
                    0.0, 0.02, generator=gen)
                q = quantize_weight(fmt, dense, group_size=group)
                for b, t in q.named_buffers(recurse=False):
                    getattr(module, b).copy_(t)
                del dense, q
    model.merge_projections()       # merges that need real tensors (MoE experts stacked per layer)
    return model.eval()


def served_model(cfg_dict: dict[str, Any], fmt: str, device: torch.device, dtype: torch.dtype, max_len: int,
                 group: int = 128, verify_rows: int = 1, build: Callable[[int], TargetModel] | None = None
                 ) -> tuple[TargetModel, ModelCache, ArchHooks]:
    """:func:`format_model` with its cache and the arch hooks prepared as a session serves it: each packed weight
    on the product the hooks pick (Triton on CUDA) and, on CUDA, the decode step (and a ``verify_rows``-row verify
    forward with the arch's rollback strategy) captured as graphs. ``build(max_len)``: a loaded model instead of
    the random one (a GGUF file, ``edgespec.bench.gguf_file``)."""
    model = build(max_len) if build is not None else format_model(cfg_dict, fmt, device, dtype, max_len, group)
    hooks = select_hooks("auto", device)
    rollback = rollback_strategy(hooks.defaults.rollback)
    cache = hooks.new_cache(model, max_len, kv_fp8=False, rollback=rollback, max_rows=verify_rows)
    hooks.prepare(model, cache, verify_rows, (), rollback, graphs=device.type == "cuda",
                  graph_prefill_max=hooks.defaults.graph_prefill_max)
    return model, cache, hooks


def prefill_step(model: TargetModel, cache: ModelCache, hooks: ArchHooks, tokens: torch.Tensor
                 ) -> Callable[[], None]:
    """One whole-model prefill of ``tokens`` into a fresh cache with the arch's prefill chunk (what ``--format-prefill``
    times and ``tools/step_profile.py --prefill`` profiles)."""
    def run() -> None:
        cache.reset()
        hooks.prefill(model, cache, tokens, hooks.defaults.prefill_chunk, ())
    return run


def bench_format(cfg_dict: dict[str, Any], fmt: str, device: torch.device, dtype: torch.dtype, context: int,
                 group: int, iters: int, prefill: Sequence[int] = (), verify_rows: int = 16,
                 build: Callable[[int], TargetModel] | None = None) -> dict[str, Any]:
    """Bytes per token, peak memory, decode time (one step at ``context``) and verify time (one forward of
    ``verify_rows`` rows, as a speculative cycle runs it, with the rollback of all but one row) of one format, and
    the whole-model prefill rate of each length in ``prefill`` (a fresh cache each time, the arch's prefill
    chunk)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    reset_peak(device)
    base = 0 if device.type == "cuda" else current_rss()
    max_len = max([context + verify_rows, *prefill]) + 8
    model, cache, hooks = served_model(cfg_dict, fmt, device, dtype, max_len, group, verify_rows, build)
    kernels = sum(1 for m in model.modules() if isinstance(m, PackedWeight) and m.kernel is not None)
    prompt = torch.randint(0, model.config.vocab_size, (context,), device=device)
    model.prefill(prompt, cache, chunk=min(context, 256))
    tok = torch.tensor([1], device=device)

    def step() -> None:
        hooks.decode(model, cache, tok, ())
        cache.length -= 1

    ms = time_cuda(step, iters=iters, warmup=2, repeats=3)
    rollback = rollback_strategy(hooks.defaults.rollback)       # the one served_model prepared the hooks with
    rows = torch.randint(0, model.config.vocab_size, (verify_rows,), device=device)

    def verify() -> None:
        start = cache.length
        hooks.verify(model, cache, rows, (), rollback)
        rollback.rollback(model, cache, start, rows, 1, ())
        cache.length = start

    energy = decode_energy(step, device)
    verify_ms = time_cuda(verify, iters=iters, warmup=2, repeats=3) if verify_rows > 1 else ms
    prefill_tok_s = {}
    for n in prefill:
        run_prefill = prefill_step(model, cache, hooks, torch.randint(0, model.config.vocab_size, (n,), device=device))
        prefill_tok_s[n] = n * 1e3 / time_cuda(run_prefill, iters=3, warmup=2, repeats=5)
    wbytes = weight_bytes_per_token(model)
    packed = sum(1 for m in model.modules() if isinstance(m, PackedLinear))
    out = {"format": fmt, "packed_layers": packed, "fast_kernels": kernels, "weight_bytes_per_token": wbytes,
           "decode_ms": ms, "verify_rows": verify_rows, "verify_ms": verify_ms,
           "decode_tok_s": 1e3 / ms, "prefill_tok_s": prefill_tok_s,
           "thor_limit_tok_s": THOR_BW / wbytes, "peak_bytes": peak_bytes(device) - base,
           "budget": model.memory_budget.to_dict(), **energy}
    return out


def decode_energy(step: Callable[[], None], device: torch.device, seconds: float = 3.0) -> dict[str, Any]:
    """Joules per decoded token and average watts over ``seconds`` of back-to-back decode steps, from the device's
    energy meter (edgespec.energy); empty on CPU or where the device has none."""
    from edgespec.energy import open_meter, run_metered

    meter = open_meter(device)
    if meter is None:
        return {}
    try:
        reading, steps = run_metered(step, meter, seconds, torch.cuda.synchronize if device.type == "cuda" else None)
    finally:
        meter.close()
    return {"energy_meter": meter.name, "joules_per_token": reading.joules / steps, "avg_watts": reading.watts,
            "energy_steps": steps}


def run_format_bench(args: argparse.Namespace) -> int:
    """Entry of ``edgespec bench formats``: one row per format, same shape, table last."""
    formats = [f for f in args.formats.split(",") if f]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ConfigError(f"--formats: unknown {', '.join(bad)}; choose from {', '.join(FORMATS)}")
    cfg_dict = shape_config(args.format_shape)
    device = torch.device(args.device if getattr(args, "device", None) not in (None, "auto")
                          else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    import os
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"weight formats on {args.format_shape}, device={device}, dtype={str(dtype)[6:]}, context="
          f"{args.context}, torch threads={torch.get_num_threads()}, load average {load:.2f}; packed layers run "
          f"the product the arch hooks choose (column 'fast': layers on a fast kernel, the rest on the torch "
          f"reference)", flush=True)
    try:
        prefill = [int(n) for n in str(getattr(args, "format_prefill", "") or "").split(",") if n]
    except ValueError:
        raise ConfigError(f"--format-prefill {args.format_prefill!r}: expected a comma list of prompt lengths, "
                          "e.g. 512,2048") from None
    if any(n < 1 for n in prefill):
        raise ConfigError(f"--format-prefill {args.format_prefill!r}: prompt lengths must be 1 or more")
    verify_rows = getattr(args, "format_verify_rows", 16)
    if not 1 <= verify_rows <= 64:
        raise ConfigError(f"--format-verify-rows {verify_rows}: rows of one verify forward must be 1..64")
    rows = []
    for fmt in formats:
        r = bench_format(cfg_dict, fmt, device, dtype, args.context, args.group_size, args.format_iters,
                         prefill, verify_rows)
        rows.append(r)
        print(json.dumps(r), flush=True)
    print()
    peak = "peak MB" if device.type == "cuda" else "RSS+ MB"     # CPU: peak resident growth during build + run
    verify = f"verify{verify_rows} ms"
    print(f"{'format':<7} {'packed':>6} {'fast':>5} {'weights/token MB':>16} {peak:>9} {'decode ms':>9} {'tok/s':>8} "
          f"{verify:>11} {'v/decode':>8} {'Thor limit tok/s':>16}" + "".join(f" {f'pp{n} tok/s':>12}" for n in prefill))
    for r in rows:
        print(f"{r['format']:<7} {r['packed_layers']:>6} {r['fast_kernels']:>5} "
              f"{r['weight_bytes_per_token'] / 1e6:>16.2f} "
              f"{r['peak_bytes'] / 1e6:>9.1f} {r['decode_ms']:>9.2f} {r['decode_tok_s']:>8.1f} "
              f"{r['verify_ms']:>11.2f} {r['verify_ms'] / r['decode_ms']:>8.2f} "
              f"{r['thor_limit_tok_s']:>16.1f}" + "".join(f" {r['prefill_tok_s'][n]:>12.0f}" for n in prefill))
    for r in rows:
        if "joules_per_token" in r:
            print(f"{r['format']}: decode energy {r['joules_per_token']:.4f} J/token at {r['avg_watts']:.1f} W average "
                  f"({r['energy_meter']}, {r['energy_steps']} decode steps)")
    if getattr(args, "out", None):
        Path(args.out).write_text(json.dumps({"shape": args.format_shape, "device": str(device),
                                              "load_average": load, "rows": rows}, indent=2))
    return 0
