#!/usr/bin/env python3
"""int4 (NVFP4, block-FP8) experts of the Qwen3.5-35B-A3B shape on a GPU: the expert kernel alone, then the
served model, each next to the byte limit of the experts its routing touched (random weights route almost
uniformly: the unions printed are the high end of what a trained router touches).

    python tools/moe_int4_bench.py layer --out layer.json [--format int4|nvfp4|fp8_block] [--configs 1]
    python tools/moe_int4_bench.py model --out model.json [--tuning layer.json] [--sm-limit 16] [--lm-head int4]
                                         [--verify-rows 2,4,8,16] [--context 512] [--attention-only]
                                         [--format int4|nvfp4|fp8_block]

``layer``: one layer's routed + shared product (edgespec.kernels.triton_moe_int4; ``--format nvfp4`` /
``fp8_block``: edgespec.kernels.triton_moe_quant) captured as a CUDA graph at 1, 4, 16 and 64 rows, for each
launch configuration of :data:`CONFIGS` (the first ``--configs``; the first also checked against the torch
reference), next to the bytes of the experts touched over the measured copy bandwidth; the bf16 stacked product
(edgespec.kernels.triton_moe) at the same rows for comparison. The configuration with the least 1-row + 16-row
time is written as ``best``.

``model``: the shape with every linear layer int4 g128 (experts stacked, the shared expert fused in; the output
projection in ``--lm-head``'s format, as ``lm_head_weights`` serves it; ``--format nvfp4`` / ``fp8_block``: every
linear layer and the head in that format, the experts on edgespec.kernels.triton_moe_quant), FP8 KV, context 512,
measured by ``edgespec.bench.gpu.bench_shape`` (decode and verify of 2-16 rows as CUDA graphs, the limit of each
forward from the experts its routing touched). ``--sm-limit N`` runs it on an N-SM green context (Thor
projection: ``tools/thor_projection.py --moe``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

CONFIGS = [  # (up_block_n, down_block_n, num_warps, num_stages)
    (32, 64, 4, 3), (16, 32, 4, 3), (64, 128, 4, 3), (32, 64, 8, 3), (32, 128, 4, 4), (64, 64, 4, 2)]
SHAPE = "qwen3.5-35b-a3b"


def random_int4_stack(E: int, H: int, I: int, group: int, device: torch.device, gen: torch.Generator):
    """``E`` random int4 experts stacked (the last the shared one): random codes, zero point 8, scales giving
    N(0, 0.02)-sized weights (speed does not depend on the values)."""
    from edgespec.kernels.moe_quant import StackedInt4

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
    from edgespec.kernels.moe_packed import StackedFP8Block, StackedNVFP4
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


def layer_bench(args: argparse.Namespace) -> dict:
    from edgespec.bench.gpu import measure_copy_bandwidth
    from edgespec.bench.timing import graph_time_us
    from edgespec.kernels import triton_moe_int4
    from edgespec.kernels.moe import group_by_expert, route
    from edgespec.kernels.moe_packed import stacked_packed_expert_product_ref
    from edgespec.kernels.moe_quant import stacked_int4_expert_product_ref
    from edgespec.kernels.triton_moe import stacked_expert_product_triton
    from edgespec.kernels.triton_moe_quant import stacked_packed_expert_product_triton

    dev = torch.device("cuda")
    E, H, I, k, g = 256, 2048, 512, 8, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    if args.format == "int4":
        stack = random_int4_stack(E + 1, H, I, g, dev, gen)
        kernel, reference = triton_moe_int4.stacked_int4_expert_product_triton, stacked_int4_expert_product_ref
    else:
        stack = random_packed_stack(args.format, E + 1, H, I, dev, gen)
        kernel, reference = stacked_packed_expert_product_triton, stacked_packed_expert_product_ref
    per_expert = sum(t[0].nbytes for t in vars(stack).values() if isinstance(t, torch.Tensor))
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    bw = measure_copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}  copy {bw / 1e9:.0f} GB/s  {args.format} expert "
          f"{per_expert / 1e6:.3f} MB "
          f"(bf16 {(w13[0].nbytes + w2[0].nbytes) / 1e6:.2f} MB)", flush=True)
    inputs = {}
    for rows in args.rows:
        x = torch.randn(rows, H, device=dev, dtype=torch.bfloat16, generator=gen)
        w, e = route(torch.randn(rows, E, device=dev, generator=gen).to(torch.bfloat16), k)
        gate = torch.sigmoid(torch.randn(rows, 1, device=dev, generator=gen)).to(torch.bfloat16)
        inputs[rows] = (x, w, e, gate, group_by_expert(e).union)
    results = {"device": torch.cuda.get_device_name(dev), "bandwidth_GBps": bw / 1e9, "format": args.format,
               f"per_expert_{args.format}_MB": per_expert / 1e6, "configs": []}
    for ci, (up, down, warps, stages) in enumerate(CONFIGS[:args.configs]):
        triton_moe_int4.TUNING.update(up_block_n=up, down_block_n=down, num_warps=warps, num_stages=stages)
        row = {"up_block_n": up, "down_block_n": down, "num_warps": warps, "num_stages": stages, "rows": {}}
        for rows, (x, w, e, gate, union) in inputs.items():
            def product(x=x, w=w, e=e, gate=gate):
                return kernel(x, w, e, stack, gate)
            if ci == 0:
                ref = reference(x, w, e, stack, gate).float()
                err = ((product().float() - ref).abs().max() / ref.abs().max()).item()
                row.setdefault("max_rel_diff", {})[rows] = err
            us = graph_time_us(product)
            limit_us = (union + 1) * per_expert / bw * 1e6          # touched experts + the shared one
            row["rows"][rows] = {"union": union, "us": us, "limit_us": limit_us, "fraction": limit_us / us}
            print(f"cfg {ci} up {up:>3} down {down:>3} warps {warps} stages {stages}  rows {rows:>2} union "
                  f"{union:>3}: {us:7.1f} us, limit {limit_us:6.1f} us = {100 * limit_us / us:5.1f}%", flush=True)
        results["configs"].append(row)
    for rows, (x, w, e, _, _) in inputs.items():
        us = graph_time_us(lambda x=x, w=w, e=e: stacked_expert_product_triton(x, w, e, w13, w2))
        results.setdefault("bf16_stacked_us", {})[rows] = us
        print(f"bf16 stacked (routed only) rows {rows:>2}: {us:7.1f} us", flush=True)
    best = min(results["configs"], key=lambda r: r["rows"][min(args.rows)]["us"] + r["rows"][
        16 if 16 in args.rows else max(args.rows)]["us"])
    results["best"] = {key: best[key] for key in ("up_block_n", "down_block_n", "num_warps", "num_stages")}
    print("best:", json.dumps(results["best"]), flush=True)
    return results


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
    from edgespec.kernels import sm_count, triton_moe_int4
    from edgespec.models.moe import SparseMoE
    from edgespec.weights.base import PackedWeight

    limit = None
    if args.sm_limit:
        from edgespec.bench.sm_limit import limit_sms
        limit = limit_sms(args.sm_limit)        # before any other CUDA work
        print(limit.describe(), flush=True)
    if args.tuning:
        triton_moe_int4.TUNING.update(json.loads(Path(args.tuning).read_text())["best"])
    dev = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats(dev)
    lm_head = args.lm_head or {"nvfp4": "nvfp4", "fp8_block": "fp8"}.get(args.format, "int4")
    model = int4_model(dev, bench_max_len(args.context, ()), lm_head, args.attention_only, args.format)
    stacks = [b.q4 if args.format == "int4" else b.qp for b in model.modules() if isinstance(b, SparseMoE)]
    assert all(s is not None for s in stacks), f"{args.format} experts not stacked"
    out = bench_shape(SHAPE, device=dev, kv_fp8=True, context=args.context, verify_rows=tuple(args.verify_rows),
                      prefill_lengths=(), model=model)
    head = model.lm_head.weight
    out.update(format=args.format, group_size=128 if args.format == "int4" else None, lm_head=lm_head,
               tuning=dict(triton_moe_int4.TUNING),
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
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=("layer", "model"))
    ap.add_argument("--out", required=True, help="JSON file written")
    ap.add_argument("--rows", default="1,4,16,64", help="layer: row counts")
    ap.add_argument("--configs", type=int, default=len(CONFIGS), help="layer: the first N launch configurations")
    ap.add_argument("--verify-rows", default="2,4,8,16", help="model: verify row counts")
    ap.add_argument("--context", type=int, default=512, help="model: the context each step runs at")
    ap.add_argument("--attention-only", action="store_true", help="model: every layer gated attention (the "
                    "llama.cpp peer's qwen3moe layout) instead of the hybrid's 3 GDN + 1 attention")
    ap.add_argument("--tuning", help="model: a layer JSON whose best launch configuration to use")
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
