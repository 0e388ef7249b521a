"""NVFP4 and block-FP8 experts stacked per layer (edgespec.kernels.moe.moe_packed, edgespec.models.expert_stacks) and
their Triton product (triton_moe_quant): the stacked product against the row-by-row oracle over dequantized
experts (shared expert fused or not), stacks built from loaded checkpoints and from unmerged modules as views of
the experts' buffers, mixed formats refused by name, and on CUDA the kernels against their reference, a row
rounding the same alone and among 63 others, a captured CUDA graph equal to the eager launches under new routing,
and the served model lossless (speculative == plain, fp32) with the kernels inside its CUDA graphs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _devices import DEVICES
from quant_layouts import write_quantized
from test_moe import check_cuda_model

from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.errors import CheckpointError
from edgespec.kernels.moe.moe import group_by_expert, moe_ref, route
from edgespec.kernels.moe.moe_packed import (
    stacked_packed_expert_product,
    stacked_packed_expert_product_ref,
    stacked_packed_moe,
)
from edgespec.kernels.moe.moe_quant import route_with_shared_ref
from edgespec.kernels.moe.stacks import StackedFP8Block, StackedNVFP4
from edgespec.kernels.pointwise.activation import silu_mul_ref
from edgespec.kernels.quant.quant_ref import quantize_fp8_block, quantize_nvfp4
from edgespec.loading.checkpoint import load_target
from edgespec.loading.hf_config import parse_config
from edgespec.memory import module_bytes
from edgespec.models.expert_stacks import stack_packed_experts
from edgespec.models.moe import RoutingLog, SparseMoE
from edgespec.weights.base import PackedLinear
from edgespec.weights.fp8_block import FP8BlockWeight
from edgespec.weights.nvfp4 import NVFP4Weight

FAMILY = "qwen3_5_moe"
FORMATS = ("nvfp4", "fp8_block")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# Tile-sized tiny experts (the kernels take whole 128-input tiles): hidden 128, routed and shared width 128.
TILED = dict(hidden_size=128, head_dim=64, moe_intermediate_size=128, shared_expert_intermediate_size=128)


def random_stack(fmt: str, experts: int, hidden: int, width: int, shared: bool, seed: int = 0,
                 device: str = "cpu") -> StackedNVFP4 | StackedFP8Block:
    """``experts`` random SwiGLU experts quantized to ``fmt`` and stacked (the last one the shared expert when
    ``shared``); NVFP4 gate and up quantized apart, so each has its own global scale."""
    gen = torch.Generator().manual_seed(seed)

    def dense(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * cols ** -0.5

    cols: dict[str, list[torch.Tensor]] = {}
    for _ in range(experts):
        if fmt == "nvfp4":
            (qg, sg, gg), (qu, su, gu) = quantize_nvfp4(dense(width, hidden)), quantize_nvfp4(dense(width, hidden))
            q2, s2, g2 = quantize_nvfp4(dense(hidden, width))
            parts = {"q13": torch.cat([qg, qu]), "s13": torch.cat([sg, su]), "g13": torch.stack([gg, gu]),
                     "q2": q2, "s2": s2, "g2": g2}
        else:
            q13, s13 = quantize_fp8_block(dense(2 * width, hidden))
            q2, s2 = quantize_fp8_block(dense(hidden, width))
            parts = {"q13": q13, "s13": s13, "q2": q2, "s2": s2}
        for name, t in parts.items():
            cols.setdefault(name, []).append(t)
    cls = StackedNVFP4 if fmt == "nvfp4" else StackedFP8Block
    stack = cls(**{n: torch.stack(v).to(device) for n, v in cols.items()}, shared=shared)
    stack.check()
    return stack


def expert_fns(stack, dtype: torch.dtype):
    """Each stacked expert as a function of fp32 rows (the oracle's experts): dequantized, SwiGLU rounded to
    ``dtype`` as the product rounds it."""
    def fn(e: int):
        w13, w2 = stack.dequant(e)
        return lambda x: silu_mul_ref(x.float() @ w13.T).to(dtype).float() @ w2.T
    return [fn(e) for e in range(stack.experts)]


def routing(rows: int, experts: int, k: int, hidden: int, device, dtype, gen: torch.Generator):
    """Random rows, their top-k routing and a shared-expert gate."""
    x = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    w, e = route(torch.randn(rows, experts, generator=gen).to(device, dtype), k)
    gate = torch.sigmoid(torch.randn(rows, 1, generator=gen)).to(device, dtype)
    return x, w, e, gate


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
def test_stacked_packed_product_equals_row_by_row(device, fmt, dtype, shared):
    """The stacked NVFP4 / block-FP8 product (Triton on CUDA, fp32 accumulation) equals the row-by-row oracle over
    the dequantized experts, the shared expert (when stacked) weighted by its gate, for 1 to 64 rows. Tolerance:
    2e-5 in fp32 (exact decoded weights, only the sum order differs), 3e-2 in bf16 (x and the SwiGLU rounded to
    bf16, whose last bit may flip with the sum order)."""
    E, H, I, k = 6, 256, 128, 3
    stack = random_stack(fmt, E + shared, H, I, shared, device=device)
    fns = expert_fns(stack, dtype)
    gen = torch.Generator().manual_seed(5)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for rows in (1, 3, 16, 17, 64):
        x, w, e, gate = routing(rows, E, k, H, device, dtype, gen)
        gate = gate if shared else None
        want = moe_ref(x.float(), w.float(), e, fns)
        if shared:
            want = want + gate.float() * torch.cat([fns[E](x[t:t + 1].float()) for t in range(rows)])
        torch.testing.assert_close(stacked_packed_expert_product_ref(x, w, e, stack, gate).float(), want,
                                   rtol=tol, atol=tol)
        torch.testing.assert_close(stacked_packed_expert_product(x, w, e, stack, gate).float(), want,
                                   rtol=tol, atol=tol)


def _packed_moe(fmt: str, seed: int = 0) -> SparseMoE:
    """A tile-sized SparseMoE whose experts (and shared expert) are ``fmt`` matrices quantized one by one, then
    merged and stacked as a load does (NVFP4 gate/up of different global scales stay unmerged)."""
    moe = SparseMoE(parse_config(tiny_config(FAMILY, **TILED)))
    gen = torch.Generator().manual_seed(seed)
    cls = NVFP4Weight if fmt == "nvfp4" else FP8BlockWeight
    with torch.no_grad():
        moe.gate.weight.normal_(0.0, 0.5, generator=gen)
        moe.shared_expert_gate.weight.normal_(0.0, 0.5, generator=gen)
        for mlp in [*moe.experts, moe.shared_expert]:
            for name in ("gate_proj", "up_proj", "down_proj"):
                lin = getattr(mlp, name)
                w = torch.randn(lin.out_features, lin.in_features, generator=gen) * lin.in_features ** -0.5
                setattr(mlp, name, PackedLinear(cls.quantize(w)))
    moe.merge_projections()
    return moe


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_experts_stack_as_views(fmt):
    """Quantized experts stack with the shared expert last, their buffers views of the stacks (memory counted
    once); NVFP4 gate and up under their own global scales stay unmerged and keep both scales. The stacked
    reference equals the per-expert modules' forward (CPU, host-grouped)."""
    moe = _packed_moe(fmt)
    stack = moe.qp
    assert stack is not None and stack.format == fmt and stack.shared and moe.device_routed
    assert stack.experts == len(moe.experts) + 1 and moe.q4 is None and moe.w13 is None
    expert = moe.experts[5]
    if fmt == "nvfp4":
        assert expert.gate_up_proj is None                  # quantized apart: different global scales
        assert expert.up_proj.weight.weight.data_ptr() == stack.q13[5, 128:].data_ptr()
        assert expert.up_proj.weight.weight_scale_2.data_ptr() == stack.g13[5, 1].data_ptr()
        assert not torch.equal(stack.g13[5, 0], stack.g13[5, 1])
        assert moe.shared_expert.down_proj.weight.weight_scale_2.data_ptr() == stack.g2[-1].data_ptr()
    else:
        assert expert.gate_up_proj.weight.weight.data_ptr() == stack.q13[5].data_ptr()
        assert moe.shared_expert.down_proj.weight.weight_scale_inv.data_ptr() == stack.s2[-1].data_ptr()
    assert module_bytes(moe) == module_bytes(moe.experts) + module_bytes(moe.shared_expert) \
        + module_bytes(moe.gate) + module_bytes(moe.shared_expert_gate)
    x = torch.randn(5, 128)
    w, e = route(moe.gate(x), moe.top_k, moe.normalise)
    gate = torch.sigmoid(moe.shared_expert_gate(x))
    torch.testing.assert_close(stacked_packed_expert_product_ref(x, w, e, stack, gate), moe.forward(x),
                               rtol=1e-5, atol=1e-5)


def test_packed_experts_bad_input():
    """Experts of different formats are refused naming the matrix (gate/up and down of two formats in every
    expert are only left per expert); a broken stack names its tensor; shapes off the kernel's tiles stay per
    expert (not stacked)."""
    moe = SparseMoE(parse_config(tiny_config(FAMILY, **TILED)))
    for i, mlp in enumerate(moe.experts):
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(mlp, name)
            cls = FP8BlockWeight if (i, name) == (3, "down_proj") else NVFP4Weight
            setattr(mlp, name, PackedLinear(cls.quantize(torch.randn(lin.out_features, lin.in_features))))
    with pytest.raises(CheckpointError, match="expert 3 down_proj is fp8_block but expert 0 down_proj is nvfp4"):
        moe.stack_experts()
    for mlp in moe.experts:         # every expert's down in fp8, gate/up in nvfp4: consistent, but not one kernel's
        mlp.down_proj = PackedLinear(FP8BlockWeight.quantize(torch.randn(128, 128)))
    assert not moe.stack_experts() and moe.qp is None
    stack = random_stack("fp8_block", 3, 128, 128, shared=False)
    with pytest.raises(ValueError, match=r"s2 is \(3, 1, 2\)"):
        StackedFP8Block(**{**vars(stack), "s2": torch.ones(3, 1, 2)}).check()
    nv = random_stack("nvfp4", 3, 128, 128, shared=True)
    with pytest.raises(ValueError, match="shared expert: its gate weight"):
        stacked_packed_expert_product(torch.randn(2, 128), *route(torch.randn(2, 2), 1), nv)
    with pytest.raises(ValueError, match="hidden 128 and width 64 must be multiples of 128"):
        StackedNVFP4(nv.q13[:, :128], nv.s13[:, :128], nv.g13, nv.q2[..., :32].contiguous(),
                     nv.s2[..., :4].contiguous(), nv.g2, shared=False).check()
    small = SparseMoE(parse_config(tiny_config(FAMILY)))           # width 32: off the tiles
    for mlp in [*small.experts, small.shared_expert]:
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(mlp, name)
            setattr(mlp, name, PackedLinear(FP8BlockWeight.quantize(torch.randn(lin.out_features,
                                                                                 lin.in_features))))
    assert stack_packed_experts(small.experts, small.shared_expert) is None


@pytest.fixture(scope="module", params=["nvfp4", "fp8"])
def packed_checkpoint(request, tmp_path_factory):
    """A tile-sized tiny MoE written in a public quantized layout (ModelOpt NVFP4 or Qwen block-FP8)."""
    root = tmp_path_factory.mktemp(f"moe_{request.param}")
    dense = write_random_checkpoint(root / "dense", tiny_config(FAMILY, **TILED), seed=11)
    qdir, _ = write_quantized(dense, root / "q", root / "r", request.param, seed=2)
    return qdir


def test_loaded_packed_experts_stack(packed_checkpoint):
    """Loaded NVFP4 / block-FP8 experts are stacked per layer (MTP head included) as views, the shared expert
    last, the router and shared gate one matrix; the stacked reference equals the CPU forward over the per-expert
    modules."""
    model = load_target(packed_checkpoint, max_positions=64)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(b.qp is not None and b.qp.shared for b in blocks)
    moe = blocks[1]
    ptr = moe.experts[2].down_proj.weight.weight.data_ptr()
    assert ptr == moe.qp.q2[2].data_ptr()
    # the loaded router and shared gate are views of one matrix (the fused routing's one GEMM)
    assert moe.router_w is not None and moe.gate.weight.data_ptr() == moe.router_w.data_ptr()
    assert torch.equal(moe.router_w[-1:], moe.shared_expert_gate.weight)
    x = torch.randn(4, 128)
    w, e = route(moe.gate(x), moe.top_k, moe.normalise)
    gate = torch.sigmoid(moe.shared_expert_gate(x))
    torch.testing.assert_close(stacked_packed_expert_product_ref(x, w, e, moe.qp, gate), moe.forward(x),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_kernel_row_rounds_the_same_and_captures(device, fmt):
    """A row's output is bit-identical alone and among 63 others (bf16); the grouping launch logs the routed union;
    a CUDA graph captured once equals the eager launches when replayed under new routing; more than 64 rows are
    refused by name."""
    from edgespec.kernels.moe.triton_moe_quant import stacked_packed_expert_product_triton as product
    E, H, I, k, dt = 64, 256, 128, 8, torch.bfloat16
    stack = random_stack(fmt, E + 1, H, I, True, seed=3, device=device)
    gen = torch.Generator().manual_seed(7)
    x, w, e, gate = routing(64, E, k, H, device, dt, gen)
    log = RoutingLog(device)
    many = product(x, w, e, stack, gate, (log.sums, log.calls))
    assert log.mean_union(64) == group_by_expert(e).union and log.layer_calls(64) == 1
    for t in (0, 17, 63):      # the tensor-core path (a lone row would take the CUDA-core one by default)
        one = product(x[t:t + 1], w[t:t + 1], e[t:t + 1], stack, gate[t:t + 1], (log.sums, log.calls), path="mma")
        assert torch.equal(one[0], many[t]), t
    assert log.mean_union(1) == k
    torch.testing.assert_close(many.float(), stacked_packed_expert_product_ref(x, w, e, stack, gate).float(),
                               rtol=3e-2, atol=3e-2)
    static = [t.clone() for t in routing(16, E, k, H, device, dt, gen)]
    product(*static[:3], stack, static[3])              # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = product(*static[:3], stack, static[3])
    for _ in range(2):
        for buf, new in zip(static, routing(16, E, k, H, device, dt, gen), strict=True):
            buf.copy_(new)
        graph.replay()
        assert torch.equal(out, product(*static[:3], stack, static[3]))
    with pytest.raises(ValueError, match="1-64 rows"):
        product(torch.randn(65, H, device=device, dtype=dt), w, e, stack, gate)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_packed_model_spec_equals_plain(packed_checkpoint):
    """On CUDA the NVFP4 / block-FP8 experts (shared expert fused) run the Triton kernels inside the CUDA graphs,
    routed by the fused routing launch (one GEMM for the router and the shared gate), a decode row on the CUDA-core
    path and a verify of more rows on the tensor cores: logits close to the CPU model's, and greedy speculative
    output equal to plain in fp32 (n-gram and oracle drafts, every rollback), with the expert union in the
    telemetry."""
    cuda = torch.device("cuda")
    model = load_target(packed_checkpoint, device=cuda, max_positions=256)
    cpu_model = load_target(packed_checkpoint, max_positions=256)
    assert all(b.qp is not None and b.qp.q13.is_cuda and b.router_w is not None and b.fused_routing
               for b in model.modules() if isinstance(b, SparseMoE))
    check_cuda_model(model, cpu_model, "rtx")


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_router_and_shared_gate_stacked_as_one_matrix(fmt):
    """With NVFP4 / block-FP8 experts stacked with the shared expert, the router's rows and the shared gate's row
    are one matrix (the two RouterLinear weights views of it, no second copy), and the fused MoE entry on its
    logits equals the block's own forward (CPU: the torch references); logits of the wrong width are refused."""
    moe = _packed_moe(fmt)
    E = len(moe.experts)
    assert moe.router_w is not None and moe.router_w.shape == (E + 1, 128)
    assert moe.gate.weight.data_ptr() == moe.router_w.data_ptr()
    assert moe.shared_expert_gate.weight.data_ptr() == moe.router_w[E].data_ptr()
    x = torch.randn(3, 128)
    got = stacked_packed_moe(x, x @ moe.router_w.T, moe.top_k, moe.normalise, moe.qp)
    torch.testing.assert_close(got, moe.forward(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=rf"must be \[T, {E + 1}\]"):
        stacked_packed_moe(x, x @ moe.router_w[:E].T, moe.top_k, moe.normalise, moe.qp)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_gemv_path_equals_reference(device, fmt, dtype):
    """The CUDA-core path (1-2 rows) equals the reference at each K split it takes (1 wave: no split; 64: the
    most), gives the same bits on a second call (no atomics), gives a row the same bits alone and beside a second
    row (its splits are sized by one row's pairs), and refuses more rows than it takes, or an unknown path, by
    name."""
    from edgespec.kernels.moe import triton_moe_gemv_packed as gp
    from edgespec.kernels.moe.triton_moe_quant import stacked_packed_expert_product_triton as product
    E, H, I, k = 64, 1024, 256, 8          # 8 and 2 K tiles: both products split at 64 waves
    stack = random_stack(fmt, E + 1, H, I, True, seed=5, device=device)
    gen = torch.Generator().manual_seed(2)
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-5
    saved = dict(gp.PACKED_GEMV_TUNING)
    try:
        for waves in (1, 64):
            gp.PACKED_GEMV_TUNING.update(waves=waves, down_min_tiles=1)
            x, w, e, gate = routing(2, E, k, H, device, dtype, gen)
            e[1], w[1] = e[0], w[0]          # the second row routed as the first: slots of 2 pairs
            two = product(x, w, e, stack, gate, path="gemv")
            torch.testing.assert_close(two.float(), stacked_packed_expert_product_ref(x, w, e, stack, gate).float(),
                                       rtol=tol, atol=tol)
            assert torch.equal(two, product(x, w, e, stack, gate, path="gemv"))
            for t in (0, 1):
                one = product(x[t:t + 1], w[t:t + 1], e[t:t + 1], stack, gate[t:t + 1])      # auto: gemv
                assert torch.equal(one[0], two[t]), (waves, t)
            assert gp.packed_splits(stack, k + 1, 132) == ((2, 2) if waves == 64 else (1, 1))
    finally:
        gp.PACKED_GEMV_TUNING.update(saved)
    x, w, e, gate = routing(3, E, k, H, device, dtype, gen)
    with pytest.raises(ValueError, match="3 rows; this path takes 1-2"):
        product(x, w, e, stack, gate, path="gemv")
    with pytest.raises(ValueError, match="path 'tiles' is not one of"):
        product(x, w, e, stack, gate, path="tiles")


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_fused_moe_equals_reference_and_captures(device, fmt):
    """The fused routing launch and the packed product (CUDA-core path at 1 and 2 rows, tensor cores at 16) equal
    the torch routing and reference product; captured in a CUDA graph, each replay on new inputs (new routing)
    gives the eager call's bits, and the routing log the graph adds to counts every replay."""
    from edgespec.kernels.moe.triton_moe_quant import stacked_packed_moe_triton as moe
    E, H, I, k = 64, 256, 128, 8
    stack = random_stack(fmt, E + 1, H, I, True, seed=7, device=device)
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 2, 16):
        x = torch.randn(rows, H, generator=gen).to(device, torch.bfloat16)
        logits = torch.randn(rows, E + 1, generator=gen).to(device, torch.bfloat16)
        w, e, gate = route_with_shared_ref(logits, k, True, stack)
        torch.testing.assert_close(moe(x, logits, k, True, stack).float(),
                                   stacked_packed_expert_product_ref(x, w, e, stack, gate).float(),
                                   rtol=3e-2, atol=3e-2)
        log = RoutingLog(device)
        moe(x, logits, k, True, stack, (log.sums, log.calls))          # compile outside the capture
        torch.cuda.synchronize()
        log.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x, logits, k, True, stack, (log.sums, log.calls))
        for step in range(3):
            x.copy_(torch.randn(rows, H, generator=gen).to(torch.bfloat16))
            logits.copy_(torch.randn(rows, E + 1, generator=gen).to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, moe(x, logits, k, True, stack)), (rows, step)
        assert log.layer_calls(rows) == 3
    with pytest.raises(ValueError, match="2 logit rows for 1 rows"):
        moe(x[:1], logits[:2], k, True, stack)


def test_packed_gemv_refuses_bad_launches():
    """The CUDA-core path names what it cannot take before any launch: more rows than its ``max_rows``, and block
    widths that do not divide the 128-row FP8 scale block."""
    pytest.importorskip("triton")
    from edgespec.kernels.moe import triton_moe_gemv_packed as gp
    stack = random_stack("fp8_block", 3, 128, 128, shared=False)
    with pytest.raises(ValueError, match="fp8_block expert gemv: 3 rows; this path takes 1-2"):
        gp.packed_expert_gemv(torch.randn(3, 128), {}, stack, 2)
    saved = dict(gp.PACKED_GEMV_TUNING)
    try:
        gp.PACKED_GEMV_TUNING["up_block_n"] = 48
        with pytest.raises(ValueError, match="block widths 48/32 must divide 128"):
            gp.packed_expert_gemv(torch.randn(1, 128), {}, stack, 2)
    finally:
        gp.PACKED_GEMV_TUNING.update(saved)


# Run under TRITON_INTERPRET=1 in a child process (the variable is read when the kernels are defined). Triton's
# interpreter turns a loaded scalar used as a loop bound (the slot's pair count) into an index with int() of a
# 1-element array, which numpy 2.4 refuses: the child first makes that conversion take the array's one element.
_INTERPRETED_FP8_GEMV = textwrap.dedent("""
    import torch
    import triton.runtime.interpreter as ti
    _patch = ti._patch_lang_tensor

    def _patch_index(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    ti._patch_lang_tensor = _patch_index

    from edgespec.kernels.moe import triton_moe_gemv_packed as gp
    from edgespec.kernels.moe.moe import route
    from edgespec.kernels.moe.moe_packed import stacked_packed_expert_product_ref
    from edgespec.kernels.moe.stacks import StackedFP8Block
    from edgespec.kernels.quant.quant_ref import quantize_fp8_block
    from edgespec.kernels.moe.triton_moe_quant import stacked_packed_expert_product_triton as product

    gen = torch.Generator().manual_seed(0)
    E, H, I, k = 3, 1024, 256, 1
    parts = [quantize_fp8_block(torch.randn(2 * I, H, generator=gen) * H ** -0.5)
             + quantize_fp8_block(torch.randn(H, I, generator=gen) * I ** -0.5) for _ in range(E + 1)]
    stack = StackedFP8Block(*(torch.stack([p[i] for p in parts]) for i in range(4)), shared=True)
    stack.check()
    for waves, down_tiles in ((64, 1), (0, 1)):     # K split at its most, then nothing split
        gp.PACKED_GEMV_TUNING.update(waves=waves, down_min_tiles=down_tiles)
        x = torch.randn(2, H, generator=gen)
        w, e = route(torch.randn(2, E, generator=gen), k)
        e[1], w[1] = e[0], w[0]
        gate = torch.sigmoid(torch.randn(2, 1, generator=gen))
        two = product(x, w, e, stack, gate, path="gemv")
        torch.testing.assert_close(two, stacked_packed_expert_product_ref(x, w, e, stack, gate), rtol=2e-5,
                                   atol=2e-5)
        for t in (0, 1):
            assert torch.equal(product(x[t:t + 1], w[t:t + 1], e[t:t + 1], stack, gate[t:t + 1])[0], two[t])
        print("splits", gp.packed_splits(stack, k + 1, 132))
""")


def test_fp8_gemv_in_the_interpreter():
    """The block-FP8 CUDA-core kernels in Triton's CPU interpreter (fp32, no GPU): equal to the reference with the
    K split at its most and with nothing split, a slot holding both rows, and a row
    bit-identical alone and beside the other. (The NVFP4 kernels decode with inline PTX, which the interpreter
    does not run: their checks are the GPU tests.)"""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _INTERPRETED_FP8_GEMV], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["splits (2, 2)", "splits (1, 1)"], done.stdout
