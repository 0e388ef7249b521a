"""What one attention call costs a decode step, measured inside the step: FP8 KV against bf16 (model-dtype) KV.

Why in place. ``lab/attn_overhead_probe.py`` times one attention call alone after an L2 flush; that figure
carries costs no decode step pays (after the write flush, the dirty lines the flush left in L2 are written back
during the call) and misses the overlap a step gives (programmatic dependent launch starts the call's programs
while the kernel before it drains, and the merge's successor likewise). Here the call is timed with its real
neighbours:

- a decode step as served (the arch hooks, CUDA graphs on CUDA) at ``context`` keys, its KV caches filled with
  random rows (no prefill: the values do not change the time);
- the same step captured with every attention call left out (``cached_attention`` returns a buffer of the output's
  shape: no split, no merge launch), everything else unchanged;
- both timed interleaved (as served, left out, as served, ...) ``repeat`` times; the difference of the two step
  times over the attention layers is the cost of one call in place.

``edgespec bench shapes qwen3.5-27b --kv none --attn-in-place --context 32768`` prints it (``gpu.run_sweep``).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from edgespec.arch.detect import select_hooks
from edgespec.bench.timing import time_cuda
from edgespec.kernels import attention_bytes
from edgespec.models.decoder import TargetModel
from edgespec.speculative.session import SpecSession

# Where the model's attention layers look the attention function up (models/layers.py imports it by name).
ATTENTION_SITE = "edgespec.models.layers.cached_attention"


def fill_kv(session: SpecSession, context: int, seed: int = 1) -> None:
    """Random rows in every KV cache of ``session`` (FP8: e4m3 values and per-row scales); length ``context``."""
    cache = session.cache
    if context + 1 > cache.max_len:
        raise ValueError(f"context {context} leaves no room for the decoded row in a {cache.max_len}-row cache")
    for i, c in enumerate(cache.kv_layers):
        gen = torch.Generator(device=c.k.device).manual_seed(seed + i)
        for t in (c.k, c.v):
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device).to(t.dtype))
        if c.fp8:
            c.k_scale.uniform_(0.005, 0.02, generator=gen)
            c.v_scale.uniform_(0.005, 0.02, generator=gen)
    cache.length = context


@contextlib.contextmanager
def attention_left_out() -> Iterator[list[int]]:
    """While active, every attention call of the model returns a zero buffer of its output's shape and launches
    nothing. Yields a one-element list counting the calls it stood in for (tests check it)."""
    calls = [0]
    bufs: dict[tuple, torch.Tensor] = {}

    def stand_in(q: torch.Tensor, cache: Any, start: int, scale: float,
                 pos_t: torch.Tensor | None = None) -> torch.Tensor:
        calls[0] += 1
        key = (tuple(q.shape), q.dtype, q.device)
        if key not in bufs:          # made on the first (eager) call, so a captured graph holds no fill kernel
            bufs[key] = torch.zeros_like(q)
        return bufs[key]

    with mock.patch(ATTENTION_SITE, stand_in):
        yield calls


def decode_step(model: TargetModel, kv_fp8: bool, context: int, *, arch: str = "auto",
                leave_out_attention: bool = False) -> tuple[SpecSession, Callable[[], Any]]:
    """A session decoding at ``context`` keys, and its one-token step as a callable (the cache stays at
    ``context``). With ``leave_out_attention`` the step (and its CUDA graph, captured here) has no attention."""
    device = model.device
    hooks = select_hooks(arch, device)
    left_out = attention_left_out if leave_out_attention else contextlib.nullcontext
    with left_out():
        session = SpecSession.with_defaults(model, hooks, None, kv_fp8=kv_fp8, max_len=context + 64,
                                            cuda_graphs=device.type == "cuda")
    fill_kv(session, context)
    tok = torch.tensor([1], device=device)
    cache = session.cache

    def step() -> Any:
        with left_out():              # eager steps (CPU) look the function up on every call
            out = hooks.decode(model, cache, tok, ())
        cache.length -= 1
        return out

    return session, step


def attention_in_place(model: TargetModel, kv_fp8: bool, context: int, *, repeat: int = 5, iters: int = 50,
                       arch: str = "auto") -> dict[str, Any]:
    """One KV format: step time as served and without attention (medians over ``repeat`` interleaved timings),
    and the per-call attention cost of each repeat in microseconds."""
    served_session, served = decode_step(model, kv_fp8, context, arch=arch)
    bare_session, bare = decode_step(model, kv_fp8, context, arch=arch, leave_out_attention=True)
    layers = len(served_session.cache.kv_layers)
    if layers == 0:
        raise ValueError("the model has no attention layer with a KV cache")
    kv0 = served_session.cache.kv_layers[0]
    full, none, per_call = [], [], []
    for _ in range(repeat):
        full.append(time_cuda(served, iters=iters))
        none.append(time_cuda(bare, iters=iters))
        per_call.append((full[-1] - none[-1]) / layers * 1e3)
    n_q = model.config.num_attention_heads
    return {"kv": "fp8" if served_session.kv_fp8 else "model", "context": context, "layers": layers,
            "step_ms": statistics.median(full), "step_without_attention_ms": statistics.median(none),
            "attention_us": statistics.median(per_call), "attention_us_each": per_call,
            "bytes_per_call": attention_bytes(1, n_q, kv0.k.shape[1], kv0.k.shape[2], context, kv0.fp8)}


def compare_in_place(model: TargetModel, context: int, *, repeat: int = 5, iters: int = 50,
                     arch: str = "auto") -> dict[str, Any]:
    """Both KV formats and the model-dtype / FP8 ratio of the per-call cost (median over repeats, with the range;
    repeat i of one format is paired with repeat i of the other)."""
    model_kv = attention_in_place(model, False, context, repeat=repeat, iters=iters, arch=arch)
    fp8_kv = attention_in_place(model, True, context, repeat=repeat, iters=iters, arch=arch)
    ratios = [m / f for m, f in zip(model_kv["attention_us_each"], fp8_kv["attention_us_each"], strict=True)]
    return {"model": model_kv, "fp8": fp8_kv, "ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios)}


def format_in_place(shape: str, r: dict[str, Any], bandwidth: float) -> list[str]:
    """Printable lines of :func:`compare_in_place`'s result, each call next to bytes / copy bandwidth."""
    lines = []
    for name in ("model", "fp8"):
        x = r[name]
        each = x["attention_us_each"]
        lines.append(f"{shape:<14} {name:<5} step {x['step_ms']:8.3f} ms, without attention "
                     f"{x['step_without_attention_ms']:8.3f} ms; {x['layers']} layers -> {x['attention_us']:6.1f} us "
                     f"per call [{min(each):.1f} - {max(each):.1f}]; limit {x['bytes_per_call'] / 1e6:.1f} MB / "
                     f"copy bandwidth = {x['bytes_per_call'] / bandwidth * 1e6:.1f} us")
    lines.append(f"{shape:<14} model-dtype / FP8 per attention call in place at {r['fp8']['context']} keys: "
                 f"{r['ratio']:.2f} [{r['ratio_min']:.2f} - {r['ratio_max']:.2f}]")
    return lines
