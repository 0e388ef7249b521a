"""Device benchmark of one model shape: decode, verify, rollback, prefill, each next to its physical limit.

Batch-1 decode reads every weight once per forward, so its floor is (weight bytes + KV bytes read) / bandwidth,
with the bandwidth measured in the same run by a large device-to-device copy (bytes read + bytes written).
Random weights of the real shape are enough: the speed does not depend on the values.
Timings use CUDA events around many graph replays after warm-up; the median of several runs is reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edgespec.arch.base import ArchHooks
from edgespec.arch.detect import select_hooks
from edgespec.bench.attn_in_place import compare_in_place, format_in_place
from edgespec.bench.modes import DEFAULT_COMPARE_HF, DEFAULT_SHAPES
from edgespec.bench.moe import ExpertBytes, expert_bytes
from edgespec.bench.shapes import SHAPES, TINY_SHAPES, config_dict, tiny_config
from edgespec.bench.timing import time_cuda
from edgespec.config import MAX_DRAFT_TOKENS
from edgespec.errors import ConfigError
from edgespec.loading.checkpoint import build_empty
from edgespec.loading.hf_config import parse_config
from edgespec.memory import peak_bytes, plan_budget
from edgespec.models.decoder import TargetModel
from edgespec.models.moe import RoutingLog, attach_routing_log
from edgespec.speculative.session import SpecSession


def measure_copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    if device.type != "cuda":
        n = nbytes // 16
        a = torch.empty(n, dtype=torch.uint8)
        b = torch.empty_like(a)
        b.copy_(a)
        t0 = time.perf_counter()
        for _ in range(5):
            b.copy_(a)
        return 2 * n * 5 / (time.perf_counter() - t0)
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = time_cuda(lambda: b.copy_(a), iters=10)
    return 2 * nbytes / (ms / 1e3)



def sm_clock_mhz(device: torch.device | None = None) -> int | None:
    """The GPU's maximum SM clock from nvidia-smi (None where it cannot be read): with the SM count, what scales a
    stage bound by its SMs from one GPU to another (``tools/thor_projection.py``)."""
    import subprocess
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits", "-i",
                               str(index)], capture_output=True, text=True, timeout=20).stdout
        return int(text.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def shape_config(shape: str) -> dict[str, Any]:
    """A :data:`SHAPES` name, or ``tiny:FAMILY`` for one of the test shapes."""
    if shape.startswith("tiny:") and shape[5:] in TINY_SHAPES:
        return tiny_config(shape[5:])
    if shape in SHAPES:
        return config_dict(**SHAPES[shape])
    raise ConfigError(f"unknown shape {shape!r}; known: {', '.join(sorted(SHAPES))}, "
                      + ", ".join(f"tiny:{f}" for f in TINY_SHAPES))


def random_model(shape: str, device: torch.device, dtype: torch.dtype, max_len: int) -> TargetModel:
    """A model of a published shape (or ``tiny:FAMILY``) with N(0, 0.02) weights, built directly on ``device``:
    merged on the meta device and allocated once in ``dtype`` (peak memory = the weights), after the memory budget
    said it fits."""
    cfg = parse_config(shape_config(shape))

    def budget(weights: int, packed: bool):
        return plan_budget(cfg, weights, device, dtype, max_len, packed=packed)

    model = build_empty(cfg, dtype, device, max_positions=max_len, merge=True, budget=budget)
    fill_random_(model, torch.Generator(device=device).manual_seed(0))
    model.merge_projections()       # merges that need real tensors (MoE experts stacked per layer)
    return model.eval()     # the layout load_target serves on CUDA


@torch.no_grad()
def fill_random_(model: TargetModel, gen: torch.Generator) -> None:
    """Random values of a served scale in every dense parameter, on the model's device (speed does not depend on
    them): norms at their neutral value, GDN decays in a stable range, matrices N(0, 0.02)."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(0.0 if model.config.zero_centred_norms else 1.0)
        elif name.endswith("A_log"):
            p.uniform_(0.0, 2.7, generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def weight_bytes_per_token(model: TargetModel) -> int:
    """Bytes of weights one forward reads: every matrix once; of the embedding only one row (unless tied, where
    the matrix is read in full as the lm_head)."""
    from edgespec.weights.base import is_packed

    total = 0
    emb = model.model.embed_tokens.weight
    # a packed table (GGUF, or a tied head under lm_head_weights) is its buffers; its rows are out_features
    table = {id(t) for t in emb.buffers()} if is_packed(emb) else {id(emb)}
    table_bytes, table_rows = (emb.nbytes, emb.out_features) if is_packed(emb) else (
        emb.numel() * emb.element_size(), emb.shape[0])
    for name, p in [*model.named_parameters(), *_packed_buffers(model)]:
        if id(p) in table or name.startswith("mtp."):
            continue
        total += p.numel() * p.element_size()
    total += table_bytes if model.lm_head is None else table_bytes // table_rows
    return total


def _packed_buffers(model: TargetModel) -> list[tuple[str, torch.Tensor]]:
    """Buffers of packed (quantized) weights: read by every forward like the dense parameters."""
    from edgespec.weights.base import PackedWeight

    return [(f"{name}.{b}", t) for name, m in model.named_modules() if isinstance(m, PackedWeight)
            for b, t in m.named_buffers(recurse=False)]


def kv_bytes_read(session: SpecSession, context: int) -> int:
    per_row = 0
    for c in session.cache.kv_layers:
        per_row += (c.k[0].numel() * c.k.element_size()) * 2
        if c.fp8:
            per_row += c.k_scale[0].numel() * 4 * 2
    state = sum(s.conv.nbytes + s.recurrent.nbytes for s in session.cache.state_layers) * 2  # read + write
    return per_row * context + state


def bench_shape(shape: str, *, device: torch.device, dtype: torch.dtype = torch.bfloat16, arch: str = "auto",
                kv_fp8: bool | None = None, context: int = 512, verify_rows: tuple[int, ...] = (2, 4, 8, 16),
                prefill_lengths: tuple[int, ...] = (512, 2048), graphs: bool = True,
                bandwidth: float | None = None, rollback: str | None = None,
                model: TargetModel | None = None) -> dict[str, Any]:
    """Measure one shape; returns a dict of figures (ms, tok/s, limits, ratios). ``rollback``: the verify's
    strategy (None: the arch default, as served). ``model``: a model of the shape built by the caller (another
    weight format; its rotary table must cover :func:`bench_max_len`), else a random bf16 one. The steps, in order:
    the model and its served session, the weight bytes a forward reads (MoE: its touched experts), decode, verify
    per row count, prefill."""
    max_len = bench_max_len(context, prefill_lengths)
    bw = bandwidth or measure_copy_bandwidth(device)
    torch.cuda.reset_peak_memory_stats(device) if device.type == "cuda" and model is None else None
    model = model if model is not None else random_model(shape, device, dtype, max_len)
    load_peak = peak_bytes(device)
    hooks = select_hooks(arch, device)
    session = SpecSession.with_defaults(model, hooks, None, kv_fp8=kv_fp8, max_len=max_len, cuda_graphs=graphs)
    wbytes, moe, routing = _forward_weight_bytes(model)
    out: dict[str, Any] = {"shape": shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                           else "cpu", "dtype": str(dtype).replace("torch.", ""), "arch": hooks.name,
                           "kv": "fp8" if session.kv_fp8 else "model", "bandwidth_GBps": bw / 1e9,
                           "weight_GB": wbytes / 1e9, "context": context, "load_peak_GB": load_peak / 1e9,
                           "budget_GB": {k: v / 1e9 for k, v in model.memory_budget.to_dict().items()
                                         if k != "device"}}
    prompt = torch.randint(0, model.config.vocab_size, (context,), device=device)
    run = _ShapeRun(model=model, hooks=hooks, session=session, prompt=prompt, device=device, arch=arch,
                    kv_fp8=kv_fp8, rollback=rollback, max_len=max_len, graphs=graphs, context=context, bw=bw)
    out.update(_time_decode(run, wbytes))
    held: list[SpecSession] = []        # the last verify session stays alive to the end (peak memory counts it)
    verify = {rows: _time_verify_rows(run, rows, out["decode_ms"], moe, routing, held) for rows in verify_rows}
    if held:
        out["rollback"] = held[0].rollback_strategy
    out["verify"] = verify
    if moe is not None:
        out["moe"] = _moe_summary(model, moe)
    out["prefill"] = _time_prefill(run, prefill_lengths)
    out["peak_memory_GB"] = peak_bytes(device) / 1e9
    return out


def bench_max_len(context: int, prefill_lengths: tuple[int, ...]) -> int:
    """Positions :func:`bench_shape` uses: the context plus room for a verify, or the longest prefill."""
    return max(context + 64, max(prefill_lengths, default=0) + 64)


@dataclass
class _ShapeRun:
    """What the steps of one :func:`bench_shape` share: the model, its served session and hooks, the prompt of
    ``context`` tokens, the settings each verify session is built with, and the copy bandwidth (bytes/s)."""

    model: TargetModel
    hooks: ArchHooks
    session: SpecSession
    prompt: torch.Tensor
    device: torch.device
    arch: str
    kv_fp8: bool | None
    rollback: str | None
    max_len: int
    graphs: bool
    context: int
    bw: float


def _forward_weight_bytes(model: TargetModel) -> tuple[int, ExpertBytes | None, RoutingLog | None]:
    """MoE byte accounting: the weight bytes a decode forward reads, the expert split and a routing log attached
    to the model (both None for a dense model). An MoE forward reads its touched experts only
    (:mod:`edgespec.bench.moe`): the decode its top-k per layer, a verify the union its rows routed to."""
    wbytes = weight_bytes_per_token(model)
    moe = expert_bytes(model, wbytes)
    routing = attach_routing_log(model) if moe is not None else None
    return (moe.decode if moe is not None else wbytes), moe, routing


def _moe_summary(model: TargetModel, moe: ExpertBytes) -> dict[str, Any]:
    """The ``moe`` figures of the report: all weights next to the dense part, one expert, layers and top-k."""
    return {"all_weights_GB": weight_bytes_per_token(model) / 1e9, "dense_GB": moe.dense / 1e9,
            "per_expert_MB": moe.per_expert / 1e6, "layers": moe.layers, "top_k": moe.top_k}


def _time_decode(run: _ShapeRun, wbytes: int) -> dict[str, float]:
    """Plain decode: one step per token at a fixed context (decode at position ``context``), next to its limit
    (weights + KV read once at the copy bandwidth)."""
    model, hooks, cache = run.model, run.hooks, run.session.cache
    cache.reset()
    hooks.prefill(model, cache, run.prompt, run.session.prefill_chunk, ())
    tok = torch.tensor([1], device=run.device)

    def decode_step() -> None:
        hooks.decode(model, cache, tok, ())
        cache.length -= 1                       # stay at the same context: O(1) truncation

    decode_ms = time_cuda(decode_step)
    limit_ms = (wbytes + kv_bytes_read(run.session, run.context)) / run.bw * 1e3
    return dict(decode_ms=decode_ms, decode_tok_s=1e3 / decode_ms, decode_limit_ms=limit_ms,
                decode_limit_tok_s=1e3 / limit_ms, decode_fraction_of_limit=limit_ms / decode_ms)


def _time_verify_rows(run: _ShapeRun, rows: int, decode_ms: float, moe: ExpertBytes | None,
                      routing: RoutingLog | None, held: list[SpecSession]) -> dict[str, Any]:
    """Verify of ``rows`` rows (its own session so the graph has exactly ``rows`` rows), with the rollback as
    served, then that rollback alone; for an MoE, next to the limit of the experts its routing touched.
    ``held`` keeps the previous row's session alive until this row's verify is timed, then holds this row's: the
    sessions live as long as in the unsplit loop, so the measured peak memory is the same."""
    model = run.model
    vs = SpecSession.with_defaults(model, select_hooks(run.arch, run.device), _FixedDraft(rows - 1), k=rows - 1,
                                   kv_fp8=run.kv_fp8, rollback=run.rollback, max_len=run.max_len,
                                   cuda_graphs=run.graphs)
    vs.cache.reset()
    vs.hooks.prefill(model, vs.cache, run.prompt, vs.prefill_chunk, ())
    toks = torch.randint(0, model.config.vocab_size, (rows,), device=run.device)

    def verify_step() -> None:
        start = vs.cache.length
        vs.hooks.verify(model, vs.cache, toks, (), vs.rollback)
        vs.cache.rollback(start)

    v_ms = time_cuda(verify_step)
    # Rollback alone, at its dearest: a checkpoint restore costs the same for any kept row (one slot copy); a
    # deferred commit advances the state by the kept rows, so it is timed keeping all of them.
    start = vs.cache.length
    vs.hooks.verify(model, vs.cache, toks, (), vs.rollback)
    deferred = vs.cache.deferred_pending
    keep = rows if deferred else 1
    held[:] = [vs]

    def rollback_step() -> None:
        vs.cache.length = start + rows
        if deferred:
            vs.cache.begin_deferred_forward(start, rows)      # host mark only: the kept inputs stay valid
        vs.cache.rollback(start + keep)

    r_ms = time_cuda(rollback_step)
    found: dict[str, Any] = {"ms": v_ms, "x_decode": v_ms / decode_ms, "rollback_ms": r_ms}
    if routing is not None:
        # Random weights route almost uniformly: this union overstates what a trained router touches.
        union = routing.mean_union(rows)
        v_limit = (moe.per_forward(union) + kv_bytes_read(vs, run.context)) / run.bw * 1e3
        found.update(expert_union=union, limit_ms=v_limit, x_limit=v_ms / v_limit)
    return found


def _time_prefill(run: _ShapeRun, lengths: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """Prefill of each of ``lengths`` random tokens from an empty cache: ms and tok/s."""
    model, hooks, cache = run.model, run.hooks, run.session.cache
    prefill = {}
    for n in lengths:
        ids = torch.randint(0, model.config.vocab_size, (n,), device=run.device)

        def prefill_step(ids: torch.Tensor = ids) -> None:
            cache.reset()
            hooks.prefill(model, cache, ids, run.session.prefill_chunk, ())

        p_ms = time_cuda(prefill_step, iters=3, warmup=1, repeats=3)
        prefill[n] = {"ms": p_ms, "tok_s": n / p_ms * 1e3}
    return prefill


class _FixedDraft:
    """Stand-in proposer used only to size verify graphs (the benchmark calls hooks.verify directly)."""

    name = "fixed"
    taps: tuple[int, ...] = ()
    default_k = 1
    max_k = MAX_DRAFT_TOKENS

    def __init__(self, k: int) -> None:
        self.default_k = k


def bench_hf(shape: str, device: torch.device, dtype: torch.dtype, context: int, tokens: int = 64) -> dict[str, Any]:
    """transformers' own decode speed on the same shape (random weights), for the peer column."""
    import transformers

    cfg_dict = shape_config(shape)
    cfg = transformers.AutoConfig.for_model(**cfg_dict)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    ids = torch.randint(0, cfg_dict.get("vocab_size", 1000), (1, context), device=device)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    per_tok = ((t2 - t1) - (t1 - t0)) / (tokens - 1)
    del model
    torch.cuda.empty_cache()
    return {"hf_decode_tok_s": 1.0 / per_tok}


THOR_BW = 273e9
CPU_SHAPE = "smollm2-135m"     # what --device cpu runs unless shapes are named


def add_sweep_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--compare-hf", default="qwen3.5-4b", help="shapes also run with transformers (comma list)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--kv", default="model,fp8", help="KV formats to run decode with (none: no decode sweep)")
    ap.add_argument("--attn-in-place", action="store_true",
                    help="also time one attention call inside a decode step at --context, FP8 vs model-dtype KV")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--rollback", default=None, help="verify rollback strategy (default: the arch default)")
    ap.add_argument("--device", default="auto", help="auto or cuda; cpu: a smoke run on the host clock, eager, fp32")
    ap.add_argument("--sweep-out", default=".", help="folder for gpu_bench.json")


def sweep_device(name: str) -> tuple[torch.device, torch.dtype]:
    """The sweep's device and dtype: CUDA in bf16 (``auto`` needs CUDA: the sweep measures GPU bandwidth and CUDA
    graphs), or ``cpu`` in fp32 for a smoke run of the same steps."""
    if name == "cpu":
        return torch.device("cpu"), torch.float32
    if name != "auto" and not name.startswith("cuda"):
        raise ConfigError(f"--device {name!r}: the shape sweep runs on auto, cuda, cuda:N or cpu")
    if not torch.cuda.is_available():
        raise ConfigError("the shape sweep measures GPU bandwidth and CUDA graphs: it needs a CUDA device "
                          "(--device cpu: a smoke run of the same steps on the host clock)")
    return torch.device("cuda" if name == "auto" else name), torch.bfloat16


def run_sweep(args: argparse.Namespace) -> int:
    """Every shape x KV format: decode / verify / rollback / prefill vs the limit; table last, JSON to a file."""
    shapes = [s for s in args.shapes.split(",") if s]
    for shape in shapes:
        shape_config(shape)         # an unknown name is an error naming it, before any work
    kvs = [] if args.kv == "none" else [k for k in args.kv.split(",") if k]
    in_place = args.attn_in_place
    if (not kvs and not in_place) or any(k not in ("model", "fp8") for k in kvs):
        raise ConfigError(f"--kv {args.kv!r}: give model and/or fp8, comma-separated (none: with --attn-in-place)")
    device, dtype = sweep_device(args.device)
    cpu = device.type == "cpu"
    if cpu and args.shapes == DEFAULT_SHAPES:
        # A smoke run: the GPU list in fp32 on a host (a 27B is 108 GB, a 4B prefill of 2048 rows minutes per call)
        # would not finish; the smallest shape exercises every step.
        shapes = [CPU_SHAPE]
        print(f"--device cpu: shape {CPU_SHAPE} (name shapes to run others; CPU figures say nothing of a GPU)")
    compare_hf = [] if cpu and args.compare_hf == DEFAULT_COMPARE_HF else args.compare_hf.split(",")
    bw = measure_copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}  copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    results = []
    for shape in shapes:
        for kv in kvs:
            try:
                r = bench_shape(shape, device=device, dtype=dtype, kv_fp8=kv == "fp8", context=args.context,
                                graphs=not args.no_graphs and device.type == "cuda", bandwidth=bw,
                                rollback=args.rollback,
                                verify_rows=(2, 4, 8, 16) if kv == "model" else (16,),
                                prefill_lengths=((128,) if cpu else (512, 2048)) if kv == "model" else ())
            except Exception as e:  # one shape failing (e.g. out of memory) must not lose the others
                traceback.print_exc()
                gc.collect()
                torch.cuda.empty_cache()
                results.append({"shape": shape, "kv": kv, "error": repr(e)})
                continue
            if kv == "model" and shape in compare_hf:
                try:
                    r.update(bench_hf(shape, device, torch.bfloat16, args.context))
                except Exception as e:
                    r["hf_error"] = repr(e)
            thor_limit_ms = r["decode_limit_ms"] * r["bandwidth_GBps"] * 1e9 / THOR_BW
            r["thor_projected_decode_tok_s_at_limit"] = 1e3 / thor_limit_ms
            results.append(r)
            b = r["budget_GB"]
            print(f"{shape} budget: weights {b['weights']:.2f} + kv {b['kv_cache']:.2f} + workspace "
                  f"{b['workspace']:.2f} = {b['total']:.2f} GB of {b['available']:.2f} GB free; measured peak "
                  f"{r['load_peak_GB']:.2f} GB after load, {r['peak_memory_GB']:.2f} GB over the run", flush=True)
            print(json.dumps(r), flush=True)
            gc.collect()                 # free this shape's weights and graphs before the next one
            torch.cuda.empty_cache()
    attn = attention_in_place_sweep(shapes, args.context, device, bw) if in_place else {}
    out = Path(args.sweep_out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_bench.json").write_text(json.dumps({"bandwidth_GBps": bw / 1e9, "results": results,
                                                    "attention_in_place": attn}, indent=2))
    if results:
        print()
        print(f"{'shape':<14} {'kv':<5} {'weights GB':>10} {'decode ms':>9} {'limit ms':>8} {'% limit':>7} "
              f"{'tok/s':>7} {'v16/dec':>7} {'rb16 ms':>7} {'HF tok/s':>8} {'Thor proj':>9} {'load pk GB':>10} "
              f"{'peak GB':>7}")
    for r in results:
        if "error" in r:
            print(f"{r['shape']:<14} {r['kv']:<5} ERROR {r['error'][:80]}")
            continue
        v16 = r["verify"].get(16, {})
        print(f"{r['shape']:<14} {r['kv']:<5} {r['weight_GB']:>10.2f} {r['decode_ms']:>9.3f} "
              f"{r['decode_limit_ms']:>8.3f} {100 * r['decode_fraction_of_limit']:>6.1f}% {r['decode_tok_s']:>7.1f} "
              f"{v16.get('x_decode', float('nan')):>7.2f} {v16.get('rollback_ms', float('nan')):>7.3f} "
              f"{r.get('hf_decode_tok_s', float('nan')):>8.1f} {r['thor_projected_decode_tok_s_at_limit']:>9.1f} "
              f"{r['load_peak_GB']:>10.2f} {r['peak_memory_GB']:>7.2f}")
    if attn:
        print(f"\none attention call inside a decode step (edgespec.bench.attn_in_place), {args.context} keys")
        for shape, r in attn.items():
            print("\n".join(format_in_place(shape, r, bw) if "error" not in r else [f"{shape:<14} ERROR {r['error']}"]))
    # One shape failing does not stop the others, but the sweep says so in its exit status: scripts and tests
    # must not read a table of ERROR rows as a measurement.
    failed = [f"{r['shape']} ({r['kv']})" for r in results if "error" in r]
    if failed:
        print(f"\n{len(failed)} of {len(results)} shape runs failed: {', '.join(failed)}")
    return 1 if failed else 0


def attention_in_place_sweep(shapes: list[str], context: int, device: torch.device, bw: float) -> dict[str, Any]:
    """:func:`edgespec.bench.attn_in_place.compare_in_place` for each shape (a fresh random model each)."""
    found: dict[str, Any] = {}
    for shape in shapes:
        try:
            model = random_model(shape, device, torch.bfloat16, context + 64)
            found[shape] = compare_in_place(model, context)
            del model
            print("\n".join(format_in_place(shape, found[shape], bw)), flush=True)
        except Exception as e:  # one shape failing (e.g. out of memory) must not lose the others
            traceback.print_exc()
            found[shape] = {"error": repr(e)}
        gc.collect()
        torch.cuda.empty_cache()
    return found


def linear_shape_counts(shape: str) -> Counter:
    """``(N, K) -> uses per decode step`` of a :data:`SHAPES` model as served (projections merged, lm_head
    included; built on the meta device, so it costs no memory): the matrix mix the GEMV and packed-product benches
    time."""
    cfg = parse_config(shape_config(shape))
    with torch.device("meta"):
        model = TargetModel(cfg, max_positions=16).merge_projections()
    counts: Counter = Counter()
    for name, p in model.named_parameters():
        if p.dim() == 2 and not name.startswith("mtp.") and "embed_tokens" not in name:
            counts[tuple(p.shape)] += 1
    if model.lm_head is None:
        counts[tuple(model.model.embed_tokens.weight.shape)] += 1
    return counts
