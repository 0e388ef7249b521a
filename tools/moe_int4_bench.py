#!/usr/bin/env python3
"""int4 (NVFP4, block-FP8) experts of the Qwen3.5-35B-A3B shape on a GPU: the expert kernel alone, then the
served model, each next to the byte limit of the experts its routing touched (random weights route almost
uniformly: the unions printed are the high end of what a trained router touches).

    python tools/moe_int4_bench.py layer --out layer.json [--format int4|nvfp4|fp8_block] [--mma-configs 1]
    python tools/moe_int4_bench.py model --out model.json [--tuning layer.json] [--sm-limit 16] [--lm-head int4]
                                         [--verify-rows 2,4,8,16] [--context 512] [--attention-only] [--before]
                                         [--format int4|nvfp4|fp8_block]

``layer``: one layer's routed + shared product (edgespec.kernels.moe.triton_moe_int4) captured as a CUDA graph at 1,
4, 16 and 64 rows, for each launch configuration of :data:`CONFIGS` (the first also checked against the torch
reference), next to the bytes of the experts touched over the measured copy bandwidth; the bf16 stacked product
(edgespec.kernels.moe.triton_moe) at the same rows for comparison. The configuration with the least 1-row + 16-row
time is written as ``best``. ``--format nvfp4`` / ``fp8_block``: the same sweep of their grouped kernels
(edgespec.kernels.moe.triton_moe_quant) against their torch reference, and nothing after it. For int4, the CUDA-core
path (edgespec.kernels.moe.triton_moe_gemv) for each launch of
:data:`GEMV_CONFIGS` at 1, 2 and 4 rows against the tensor-core path at the same rows: the fastest becomes
``gemv_best``, with ``max_rows`` the most rows up to which it beat the tensor cores at every row count. Last, the
whole MoE block after the residual (router GEMM, routing, grouping, product) as served without the fused routing
(torch routing, the tensor-core product) and with it: kernels per call (torch profiler, eager) and microseconds
(CUDA graph) against the block's bytes (router + touched experts + the shared one).

``model``: the shape with every linear layer int4 g128 (experts stacked, the shared expert fused in; the output
projection in ``--lm-head``'s format, as ``lm_head_weights`` serves it; ``--format nvfp4`` / ``fp8_block``: every
linear layer and the head in that format, the experts on edgespec.kernels.moe.triton_moe_quant), FP8 KV, context 512,
measured by
``edgespec.bench.gpu.bench_shape`` (decode and verify of 2-16 rows as CUDA graphs, the limit of each forward from
the experts its routing touched). ``--sm-limit N`` runs it on an N-SM green context (Thor projection:
``tools/thor_projection.py --moe``). ``--before``: then the same model again with the MoE blocks as they ran before
the fused routing and the CUDA-core path (torch routing, the tensor-core product at every row count), decode and
a 16-row verify, written under ``before``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

CONFIGS = [  # (up_block_n, down_block_n, num_warps, num_stages)
    (32, 64, 4, 3), (16, 32, 4, 3), (64, 128, 4, 3), (32, 64, 8, 3), (32, 128, 4, 4), (64, 64, 4, 2)]
# (up_block_n, down_block_n, waves, down_min_tiles, num_warps) of the CUDA-core path, the default first
GEMV_CONFIGS = [(16, 32, 4, 2, 4), (32, 64, 4, 2, 4), (64, 64, 4, 2, 4), (16, 32, 8, 1, 4), (8, 16, 4, 2, 4)]
GEMV_ROWS = (1, 2, 4)
SHAPE = "qwen3.5-35b-a3b"


def random_int4_stack(E: int, H: int, I: int, group: int, device: torch.device, gen: torch.Generator):
    """``E`` random int4 experts stacked (the last the shared one): random codes, zero point 8, scales giving
    N(0, 0.02)-sized weights (speed does not depend on the values)."""
    from edgespec.kernels.moe.stacks import StackedInt4

    def part(rows: int, cols: int):
        q = torch.randint(0, 256, (E, rows, cols // 2), dtype=torch.uint8, device=device, generator=gen)
        s = torch.full((E, rows, cols // group), 0.02 / 4.6, dtype=torch.float16, device=device)
        return q, s, torch.randint(7, 9, (E, rows, cols // group), dtype=torch.uint8, device=device, generator=gen)

    q13, s13, z13 = part(2 * I, H)
    q2, s2, z2 = part(H, I)
    return StackedInt4(q13, s13, z13, q2, s2, z2, group, shared=True)


def random_packed_stack(fmt: str, E: int, H: int, I: int, device: torch.device, gen: torch.Generator):
    """``E`` random NVFP4 or block-FP8 experts stacked (the last the shared one), codes drawn as
    ``edgespec.bench.moe.fill_random_codes_`` draws them (speed does not depend on the values)."""
    from edgespec.bench.moe import fill_random_codes_
    from edgespec.kernels.moe.stacks import StackedFP8Block, StackedNVFP4
    from edgespec.weights.fp8_block import FP8BlockWeight
    from edgespec.weights.nvfp4 import NVFP4Weight

    cls = NVFP4Weight if fmt == "nvfp4" else FP8BlockWeight
    up, down = cls(E * 2 * I, H, torch.bfloat16, device=device), cls(E * H, I, torch.bfloat16, device=device)
    holder = torch.nn.ModuleList([up, down])
    fill_random_codes_(holder, gen)
    if fmt == "fp8_block":
        return StackedFP8Block(up.weight.view(E, 2 * I, H), up.weight_scale_inv.view(E, 2 * I // 128, H // 128),
                               down.weight.view(E, H, I), down.weight_scale_inv.view(E, H // 128, I // 128), True)
    g = up.weight_scale_2.reshape(1).expand(E)
    return StackedNVFP4(up.weight.view(E, 2 * I, H // 2), up.weight_scale.view(E, 2 * I, H // 16),
                        g[:, None].expand(E, 2).contiguous(), down.weight.view(E, H, I // 2),
                        down.weight_scale.view(E, H, I // 16), g.contiguous(), True)


def packed_layer_bench(args: argparse.Namespace) -> dict:
    """``layer`` for NVFP4 or block-FP8 experts: :func:`mma_sweep` over their grouped kernels, then their CUDA-core
    path at 1-2 rows (:func:`packed_gemv_rows`)."""
    from edgespec.bench.gpu import measure_copy_bandwidth
    from edgespec.kernels.moe.moe import group_by_expert, route
    from edgespec.kernels.moe.moe_packed import stacked_packed_expert_product_ref
    from edgespec.kernels.moe.triton_moe_quant import stacked_packed_expert_product_triton

    dev = torch.device("cuda")
    E, H, I, k = 256, 2048, 512, 8
    gen = torch.Generator(device=dev).manual_seed(0)
    stack = random_packed_stack(args.format, E + 1, H, I, dev, gen)
    per_expert = sum(t[0].nbytes for t in vars(stack).values() if isinstance(t, torch.Tensor))
    bw = measure_copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}  copy {bw / 1e9:.0f} GB/s  {args.format} expert "
          f"{per_expert / 1e6:.3f} MB (bf16 {3 * H * I * 2 / 1e6:.2f} MB)", flush=True)
    inputs = {}
    for rows in args.rows:
        x = torch.randn(rows, H, device=dev, dtype=torch.bfloat16, generator=gen)
        w, e = route(torch.randn(rows, E, device=dev, generator=gen).to(torch.bfloat16), k)
        gate = torch.sigmoid(torch.randn(rows, 1, device=dev, generator=gen)).to(torch.bfloat16)
        inputs[rows] = (x, w, e, gate, group_by_expert(e).union)
    results = {"device": torch.cuda.get_device_name(dev), "bandwidth_GBps": bw / 1e9, "format": args.format,
               f"per_expert_{args.format}_MB": per_expert / 1e6}
    results.update(mma_sweep(args, stack, inputs, per_expert, bw, stacked_packed_expert_product_triton,
                             stacked_packed_expert_product_ref))
    results["gemv"] = packed_gemv_rows(stack, per_expert, bw)
    return results


def packed_gemv_rows(stack, per_expert: int, bw: float) -> dict:
    """The NVFP4 / block-FP8 CUDA-core path (edgespec.kernels.moe.triton_moe_gemv_packed, its kept launch) at 1 and 2
    rows next to the tensor-core tiles at the same rows, checked against the torch reference."""
    from edgespec.bench.timing import graph_time_us
    from edgespec.kernels.moe.moe import group_by_expert, route
    from edgespec.kernels.moe.moe_packed import stacked_packed_expert_product_ref
    from edgespec.kernels.moe.triton_moe_quant import stacked_packed_expert_product_triton

    dev, E, H = stack.q13.device, stack.experts - 1, stack.hidden
    gen = torch.Generator(device=dev).manual_seed(1)
    out = {}
    for rows in (1, 2):
        x = torch.randn(rows, H, device=dev, dtype=torch.bfloat16, generator=gen)
        w, e = route(torch.randn(rows, E, device=dev, generator=gen).to(torch.bfloat16), 8)
        gate = torch.sigmoid(torch.randn(rows, 1, device=dev, generator=gen)).to(torch.bfloat16)
        row = {"union": group_by_expert(e).union}
        ref = stacked_packed_expert_product_ref(x, w, e, stack, gate).float()
        for path in ("gemv", "mma"):
            def product(x=x, w=w, e=e, gate=gate, path=path):
                return stacked_packed_expert_product_triton(x, w, e, stack, gate, path=path)
            row[f"{path}_max_rel_diff"] = _rel_diff(product(), ref)
            row[f"{path}_us"] = graph_time_us(product)
        row["limit_us"] = _limit_us(row["union"], per_expert, bw)
        out[rows] = row
        print(f"rows {rows}: CUDA cores {row['gemv_us']:6.1f} us (rel diff {row['gemv_max_rel_diff']:.1e}), tensor "
              f"cores {row['mma_us']:6.1f} us, limit {row['limit_us']:5.1f} us", flush=True)
    return out


def layer_bench(args: argparse.Namespace) -> dict:
    from edgespec.bench.gpu import measure_copy_bandwidth
    from edgespec.kernels.moe.moe import group_by_expert, route

    if args.format != "int4":
        return packed_layer_bench(args)
    dev = torch.device("cuda")
    E, H, I, k, g = 256, 2048, 512, 8, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    stack = random_int4_stack(E + 1, H, I, g, dev, gen)
    per_expert = sum(t[0].nbytes for t in (stack.q13, stack.s13, stack.z13, stack.q2, stack.s2, stack.z2))
    bw = measure_copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}  copy {bw / 1e9:.0f} GB/s  int4 expert {per_expert / 1e6:.3f} MB",
          flush=True)
    inputs = {}
    for rows in sorted({*args.rows, *GEMV_ROWS}):
        x = torch.randn(rows, H, device=dev, dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(rows, E, device=dev, generator=gen).to(torch.bfloat16)
        w, e = route(logits, k)
        gate = torch.sigmoid(torch.randn(rows, 1, device=dev, generator=gen)).to(torch.bfloat16)
        inputs[rows] = (x, w, e, gate, group_by_expert(e).union)
    results = {"device": torch.cuda.get_device_name(dev), "bandwidth_GBps": bw / 1e9,
               "per_expert_int4_MB": per_expert / 1e6}
    results.update(mma_sweep(args, stack, {r: v for r, v in inputs.items() if r in args.rows}, per_expert, bw))
    results.update(gemv_sweep(stack, inputs, per_expert, bw))
    results["block"] = block_profile(stack, E, k, bw, per_expert, gen)
    return results


def _limit_us(union: int, per_expert: int, bw: float) -> float:
    """Microseconds to read the touched experts and the shared one at ``bw``."""
    return (union + 1) * per_expert / bw * 1e6


def mma_sweep(args: argparse.Namespace, stack, inputs: dict, per_expert: int, bw: float, kernel=None,
              reference=None) -> dict:
    """The tensor-core path (``kernel``, default the int4 one) for each of the first ``--mma-configs`` of
    :data:`CONFIGS` (the first checked against ``reference``), and the bf16 stacked product at the same rows;
    ``best``: least 1-row + 16-row time."""
    from edgespec.bench.timing import graph_time_us
    from edgespec.kernels.moe import triton_moe_int4
    from edgespec.kernels.moe.moe_quant import stacked_int4_expert_product_ref
    from edgespec.kernels.moe.triton_moe import stacked_expert_product_triton

    kernel = kernel or triton_moe_int4.stacked_int4_expert_product_triton
    reference = reference or stacked_int4_expert_product_ref

    out: dict = {"configs": []}
    for ci, (up, down, warps, stages) in enumerate(CONFIGS[:args.mma_configs]):
        triton_moe_int4.TUNING.update(up_block_n=up, down_block_n=down, num_warps=warps, num_stages=stages)
        row = {"up_block_n": up, "down_block_n": down, "num_warps": warps, "num_stages": stages, "rows": {}}
        for rows, (x, w, e, gate, union) in inputs.items():
            def product(x=x, w=w, e=e, gate=gate):
                return kernel(x, w, e, stack, gate, path="mma")
            if ci == 0:
                ref = reference(x, w, e, stack, gate).float()
                row.setdefault("max_rel_diff", {})[rows] = _rel_diff(product(), ref)
            us = graph_time_us(product)
            limit_us = _limit_us(union, per_expert, bw)
            row["rows"][rows] = {"union": union, "us": us, "limit_us": limit_us, "fraction": limit_us / us}
            print(f"mma cfg {ci} up {up:>3} down {down:>3} warps {warps} stages {stages}  rows {rows:>2} union "
                  f"{union:>3}: {us:7.1f} us, limit {limit_us:6.1f} us = {100 * limit_us / us:5.1f}%", flush=True)
        out["configs"].append(row)
    triton_moe_int4.TUNING.update({key: v for key, v in zip(("up_block_n", "down_block_n", "num_warps",
                                                              "num_stages"), CONFIGS[0], strict=True)})
    gen = torch.Generator(device=stack.q13.device).manual_seed(1)
    E, H, I = stack.experts - 1, stack.hidden, stack.width
    w13 = torch.randn(E, 2 * I, H, device=stack.q13.device, dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(E, H, I, device=stack.q13.device, dtype=torch.bfloat16, generator=gen) * 0.02
    for rows, (x, w, e, _, _) in inputs.items():
        us = graph_time_us(lambda x=x, w=w, e=e: stacked_expert_product_triton(x, w, e, w13, w2))
        out.setdefault("bf16_stacked_us", {})[rows] = us
        print(f"bf16 stacked (routed only) rows {rows:>2}: {us:7.1f} us", flush=True)
    best = min(out["configs"], key=lambda r: r["rows"][min(inputs)]["us"] + r["rows"][
        16 if 16 in inputs else max(inputs)]["us"])
    out["best"] = {key: best[key] for key in ("up_block_n", "down_block_n", "num_warps", "num_stages")}
    print("best:", json.dumps(out["best"]), flush=True)
    return out


def _rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def gemv_sweep(stack, inputs: dict, per_expert: int, bw: float) -> dict:
    """The CUDA-core path for each of :data:`GEMV_CONFIGS` at :data:`GEMV_ROWS` (the first checked against the
    reference) next to the tensor-core path at the same rows; ``gemv_best`` (least summed time) with its
    ``max_rows``: the most rows up to which it beat the tensor cores at every row count measured."""
    from edgespec.bench.timing import graph_time_us
    from edgespec.kernels.moe import triton_moe_gemv
    from edgespec.kernels.moe.moe_quant import stacked_int4_expert_product_ref
    from edgespec.kernels.moe.triton_moe_int4 import stacked_int4_expert_product_triton

    mma = {}
    for rows in GEMV_ROWS:
        x, w, e, gate, _ = inputs[rows]
        mma[rows] = graph_time_us(lambda x=x, w=w, e=e, gate=gate: stacked_int4_expert_product_triton(
            x, w, e, stack, gate, path="mma"))
    configs = []
    for ci, (up, down, waves, min_tiles, warps) in enumerate(GEMV_CONFIGS):
        cfg = {"up_block_n": up, "down_block_n": down, "waves": waves, "down_min_tiles": min_tiles,
               "num_warps": warps}
        triton_moe_gemv.GEMV_TUNING.update(cfg, max_rows=max(GEMV_ROWS))
        row = {**cfg, "rows": {}}
        for rows in GEMV_ROWS:
            x, w, e, gate, union = inputs[rows]

            def product(x=x, w=w, e=e, gate=gate):
                return stacked_int4_expert_product_triton(x, w, e, stack, gate, path="gemv")
            if ci == 0:
                ref = stacked_int4_expert_product_ref(x, w, e, stack, gate).float()
                row.setdefault("max_rel_diff", {})[rows] = _rel_diff(product(), ref)
                print(f"gemv rows {rows}: max rel diff to the reference {row['max_rel_diff'][rows]:.2e}")
            us = graph_time_us(product)
            limit_us = _limit_us(union, per_expert, bw)
            row["rows"][rows] = {"union": union, "us": us, "limit_us": limit_us, "fraction": limit_us / us,
                                 "mma_us": mma[rows]}
            print(f"gemv cfg {ci} {cfg}  rows {rows}: {us:6.1f} us (tensor cores {mma[rows]:6.1f}), limit "
                  f"{limit_us:5.1f} us = {100 * limit_us / us:5.1f}%", flush=True)
        configs.append(row)
    best = min(configs, key=lambda r: sum(v["us"] for v in r["rows"].values()))
    max_rows = 0
    for rows in GEMV_ROWS:
        if best["rows"][rows]["us"] >= mma[rows]:
            break
        max_rows = rows
    gemv_best = {key: v for key, v in best.items() if key not in ("rows", "max_rel_diff")}
    gemv_best["max_rows"] = max_rows
    triton_moe_gemv.GEMV_TUNING.update(gemv_best)
    print("gemv best:", json.dumps(gemv_best), flush=True)
    return {"gemv_configs": configs, "gemv_mma_us": mma, "gemv_best": gemv_best}


def kernels_per_call(fn, calls: int = 3) -> int:
    """CUDA kernels one eager ``fn()`` launches (torch profiler over ``calls`` calls, after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    return round(len(kernels) / calls)


def block_profile(stack, E: int, k: int, bw: float, per_expert: int, gen: torch.Generator) -> dict:
    """One MoE block after the residual, as served without the fused routing (router and shared-gate GEMMs, torch
    softmax top-k, the grouping launch, the tensor-core product) and with it (one GEMM, the fused routing launch,
    the product with the CUDA-core path where it won): kernels per call and microseconds per call at 1, 4 and 16
    rows, against the bytes of the router and the touched experts."""
    from edgespec.bench.timing import graph_time_us
    from edgespec.kernels.moe.moe import group_by_expert, route
    from edgespec.kernels.moe.moe_quant import route_with_shared_ref, stacked_int4_expert_product_ref
    from edgespec.kernels.moe.triton_moe_int4 import stacked_int4_expert_product_triton
    from edgespec.kernels.moe.triton_moe_route import stacked_int4_moe_triton
    from edgespec.kernels.quant.linear import linear

    dev, H = stack.q13.device, stack.hidden
    router_w = torch.randn(E + 1, H, device=dev, generator=gen).to(torch.bfloat16) * H ** -0.5

    def before(x):
        w, e = route(linear(x, router_w[:E]), k)
        gate = torch.sigmoid(linear(x, router_w[E:]))
        return stacked_int4_expert_product_triton(x, w, e, stack, gate, path="mma")

    def after(x):
        return stacked_int4_moe_triton(x, linear(x, router_w), k, True, stack)

    out = {}
    for rows in (1, 4, 16):
        x = torch.randn(rows, H, device=dev, generator=gen).to(torch.bfloat16)
        union = group_by_expert(route(linear(x, router_w[:E]), k)[1]).union
        limit_us = (router_w.nbytes + (union + 1) * per_expert) / bw * 1e6
        # against the reference on the same logits (the two paths' router GEMMs may round a logit apart, and a
        # bf16 near-tie then routes a row differently)
        logits = linear(x, router_w)
        w, e, gate = route_with_shared_ref(logits, k, True, stack)
        ref = stacked_int4_expert_product_ref(x, w, e, stack, gate).float()
        print(f"MoE block after rows {rows:>2}: max rel diff to the reference {_rel_diff(after(x), ref):.2e}")
        for name, fn in (("before", before), ("after", after)):
            launches = kernels_per_call(lambda fn=fn, x=x: fn(x))
            us = graph_time_us(lambda fn=fn, x=x: fn(x))
            out.setdefault(name, {})[rows] = {"launches": launches, "us": us, "limit_us": limit_us,
                                              "fraction": limit_us / us, "union": union}
            print(f"MoE block {name:<6} rows {rows:>2}: {launches:>2} kernels, {us:6.1f} us, limit {limit_us:5.1f} "
                  f"us = {100 * limit_us / us:5.1f}% (union {union})", flush=True)
    return out


def int4_model(device: torch.device, max_len: int, lm_head: str, attention_only: bool = False, fmt: str = "int4"):
    """The shape's served module tree with every linear layer int4 g128 (or ``fmt``), random codes filled on the
    device, the experts stacked (shared expert fused), the output projection in ``lm_head``'s format.
    ``attention_only``: every layer full (gated) attention instead of 3 Gated DeltaNet + 1 attention, the layout of
    the llama.cpp peer's qwen3moe GGUF (tools/peer_gguf.py --moe)."""
    from edgespec.bench.formats import meta_model, shape_config
    from edgespec.bench.gpu import fill_random_
    from edgespec.bench.moe import fill_random_codes_
    from edgespec.loading.hf_config import parse_config
    from edgespec.memory import module_bytes, plan_budget
    from edgespec.models.layers import RotaryEmbedding
    from edgespec.weights.requantize import quantize_lm_head

    cfg_dict = shape_config(SHAPE)
    if attention_only:
        cfg_dict = {**cfg_dict, "layer_types": ["full_attention"] * cfg_dict["num_hidden_layers"]}
    cfg = parse_config(cfg_dict)
    model = meta_model(cfg_dict, "fp8" if fmt == "fp8_block" else fmt, torch.bfloat16, 128)
    budget = plan_budget(cfg, module_bytes(model), device, torch.bfloat16, max_len, packed=True)
    budget.check()
    model = model.to_empty(device=device)
    model.memory_budget = budget
    model.rope = RotaryEmbedding(cfg, max_len).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    fill_random_(model, gen)
    fill_random_codes_(model, gen)
    model.merge_projections()           # stacks the experts now that they hold real tensors
    quantize_lm_head(model, lm_head)
    return model.eval()


def model_bench(args: argparse.Namespace) -> dict:
    from edgespec.bench.gpu import bench_max_len, bench_shape, sm_clock_mhz
    from edgespec.kernels import sm_count
    from edgespec.kernels.moe import triton_moe_gemv, triton_moe_int4
    from edgespec.kernels.moe.triton_moe_gemv_packed import PACKED_GEMV_TUNING
    from edgespec.models.moe import SparseMoE
    from edgespec.weights.base import PackedWeight

    limit = None
    if args.sm_limit:
        from edgespec.bench.sm_limit import limit_sms
        limit = limit_sms(args.sm_limit)        # before any other CUDA work
        print(limit.describe(), flush=True)
    if args.tuning:
        tuning = json.loads(Path(args.tuning).read_text())
        triton_moe_int4.TUNING.update(tuning["best"])
        triton_moe_gemv.GEMV_TUNING.update(tuning.get("gemv_best", {}))
    dev = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats(dev)
    lm_head = args.lm_head or {"nvfp4": "nvfp4", "fp8_block": "fp8"}.get(args.format, "int4")
    model = int4_model(dev, bench_max_len(args.context, ()), lm_head, args.attention_only, args.format)
    blocks = [b for b in model.modules() if isinstance(b, SparseMoE)]
    stacks = [b.q4 if args.format == "int4" else b.qp for b in blocks]
    assert all(st is not None for st in stacks), f"{args.format} experts not stacked"
    fused = sum(b.router_w is not None and b.fused_routing for b in blocks)
    gemv_rows = (triton_moe_gemv.GEMV_TUNING if args.format == "int4" else PACKED_GEMV_TUNING)["max_rows"]
    print(f"MoE path: routing fused into the grouping launch in {fused} of {len(blocks)} blocks; CUDA-core "
          f"expert path up to {gemv_rows} rows, tensor cores above", flush=True)
    out = bench_shape(SHAPE, device=dev, kv_fp8=True, context=args.context, verify_rows=tuple(args.verify_rows),
                      prefill_lengths=(), model=model)
    head = model.lm_head.weight
    out.update(fused_routing_blocks=fused, moe_blocks=len(blocks))
    out.update(format=args.format, group_size=128 if args.format == "int4" else None, lm_head=lm_head,
               tuning=dict(triton_moe_int4.TUNING),
               gemv_tuning=dict(triton_moe_gemv.GEMV_TUNING), packed_gemv_tuning=dict(PACKED_GEMV_TUNING),
               attention_only=args.attention_only,
               head_bytes=head.nbytes if isinstance(head, PackedWeight) else head.numel() * head.element_size(),
               sm_limit=args.sm_limit, sms=sm_count(dev), sm_clock_mhz=sm_clock_mhz(dev))
    v = out["verify"]
    print(f"{out['device']} {out['sms']} SMs, {args.format} experts: decode {out['decode_ms']:.3f} ms = "
          f"{out['decode_tok_s']:.1f} tok/s, "
          f"limit {out['decode_limit_ms']:.3f} ms ({100 * out['decode_fraction_of_limit']:.1f}%)", flush=True)
    for rows, r in v.items():
        print(f"  verify {rows:>2}: {r['ms']:.3f} ms = {r['x_decode']:.2f} decode, limit {r['limit_ms']:.3f} ms "
              f"(x{r['x_limit']:.2f}), union {r['expert_union']:.1f}", flush=True)
    if args.before:
        out["before"] = bench_before(model, args)
    return out


def bench_before(model, args: argparse.Namespace) -> dict:
    """The same model with its MoE blocks on the unfused paths (``fused_routing`` off: torch routing, the grouping
    launch, the tensor-core product at every row count): decode and a 16-row verify."""
    from edgespec.bench.gpu import bench_shape
    from edgespec.kernels.moe import triton_moe_gemv
    from edgespec.kernels.moe.triton_moe_gemv_packed import PACKED_GEMV_TUNING
    from edgespec.models.moe import SparseMoE

    blocks = [b for b in model.modules() if isinstance(b, SparseMoE)]
    saved = dict(triton_moe_gemv.GEMV_TUNING)
    saved_packed = dict(PACKED_GEMV_TUNING)
    for b in blocks:
        b.fused_routing = False
    triton_moe_gemv.GEMV_TUNING["max_rows"] = 0
    PACKED_GEMV_TUNING["max_rows"] = 0
    try:
        out = bench_shape(SHAPE, device=model.device, kv_fp8=True, context=args.context, verify_rows=(16,),
                          prefill_lengths=(), model=model)
    finally:
        for b in blocks:
            b.fused_routing = True
        triton_moe_gemv.GEMV_TUNING.update(saved)
        PACKED_GEMV_TUNING.update(saved_packed)
    r = out["verify"][16]
    print(f"  before: decode {out['decode_ms']:.3f} ms = {out['decode_tok_s']:.1f} tok/s "
          f"({100 * out['decode_fraction_of_limit']:.1f}% of limit); verify 16: {r['ms']:.3f} ms (x{r['x_limit']:.2f} "
          "limit)", flush=True)
    return {key: out[key] for key in ("decode_ms", "decode_tok_s", "decode_limit_ms", "decode_fraction_of_limit",
                                      "verify")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=("layer", "model"))
    ap.add_argument("--out", required=True, help="JSON file written")
    ap.add_argument("--rows", default="1,4,16,64", help="layer: row counts")
    ap.add_argument("--verify-rows", default="2,4,8,16", help="model: verify row counts")
    ap.add_argument("--context", type=int, default=512, help="model: the context each step runs at")
    ap.add_argument("--attention-only", action="store_true", help="model: every layer gated attention (the "
                    "llama.cpp peer's qwen3moe layout) instead of the hybrid's 3 GDN + 1 attention")
    ap.add_argument("--tuning", help="model: a layer JSON whose best launch configurations to use")
    ap.add_argument("--mma-configs", "--configs", dest="mma_configs", type=int, default=len(CONFIGS),
                    help="layer: how many of the tensor-core "
                    "launch configurations to time (the kept one first)")
    ap.add_argument("--before", action="store_true", help="model: also time the MoE blocks as they ran before "
                    "the fused routing and the CUDA-core path")
    ap.add_argument("--sm-limit", type=int, default=0, help="model: run on a green context of this many SMs")
    ap.add_argument("--lm-head", choices=("model", "int4", "nvfp4", "fp8"),
                    help="model: the output projection's format (lm_head_weights; default: --format's own)")
    ap.add_argument("--format", default="int4", choices=("int4", "nvfp4", "fp8_block"),
                    help="the experts' format (layer), every linear layer's format (model)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_int4_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    args.rows = [int(r) for r in args.rows.split(",")]
    args.verify_rows = [int(r) for r in args.verify_rows.split(",")]
    result = layer_bench(args) if args.part == "layer" else model_bench(args)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
