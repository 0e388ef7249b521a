"""int4 experts stacked per layer (edgespec.kernels.moe.moe_quant) and their Triton product (triton_moe_int4): the
stacked product against the row-by-row oracle over dequantized experts (shared expert fused or not), the stacks
built from a loaded AWQ checkpoint as views, bad inputs, and on CUDA the kernel against its reference, a row
rounding the same alone and among 63 others, the routing log filled by the grouping launch, the fused routing
launch against the torch routing (ties included), the CUDA-core 1-4 row path against the reference, captured ==
eager, and the served model lossless (speculative == plain, fp32) with the kernels inside its CUDA graphs."""

from __future__ import annotations

import itertools

import pytest
import torch
from _devices import DEVICES
from quant_layouts import write_quantized
from test_moe import check_cuda_model

from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.kernels.moe.moe import group_by_expert, moe_ref, route
from edgespec.kernels.moe.moe_quant import (
    route_with_shared_ref,
    stacked_int4_expert_product,
    stacked_int4_expert_product_ref,
    stacked_int4_moe,
)
from edgespec.kernels.moe.stacks import StackedInt4
from edgespec.kernels.pointwise.activation import silu_mul_ref
from edgespec.kernels.quant.quant_ref import dequant_int4, quantize_int4
from edgespec.loading.checkpoint import load_target
from edgespec.memory import module_bytes
from edgespec.models.moe import RoutingLog, SparseMoE

FAMILY = "qwen3_5_moe"
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def random_stack(experts: int, hidden: int, width: int, group: int, shared: bool, seed: int = 0,
                 device: str = "cpu") -> StackedInt4:
    """``experts`` random SwiGLU experts quantized to int4 and stacked (the last one the shared expert when
    ``shared``)."""
    gen = torch.Generator().manual_seed(seed)
    parts: dict[str, list[torch.Tensor]] = {n: [] for n in ("q13", "s13", "z13", "q2", "s2", "z2")}
    for _ in range(experts):
        for suffix, shape in (("13", (2 * width, hidden)), ("2", (hidden, width))):
            q, s, z = quantize_int4(torch.randn(*shape, generator=gen) * shape[1] ** -0.5, group)
            for name, t in zip(("q", "s", "z"), (q, s, z), strict=True):
                parts[name + suffix].append(t)
    return StackedInt4(**{n: torch.stack(v).to(device) for n, v in parts.items()}, group_size=group, shared=shared)


def expert_fns(stack: StackedInt4, dtype: torch.dtype):
    """Each stacked expert as a function of fp32 rows (the oracle's experts): dequantized, SwiGLU rounded to
    ``dtype`` as the product rounds it."""
    g = stack.group_size

    def fn(e: int):
        w13 = dequant_int4(stack.q13[e], stack.s13[e], stack.z13[e], g, torch.float32)
        w2 = dequant_int4(stack.q2[e], stack.s2[e], stack.z2[e], g, torch.float32)
        return lambda x: silu_mul_ref(x.float() @ w13.T).to(dtype).float() @ w2.T
    return [fn(e) for e in range(stack.experts)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
def test_stacked_int4_product_equals_row_by_row(device, dtype, shared):
    """The stacked int4 product (Triton on CUDA) equals the row-by-row oracle over the dequantized experts, the
    shared expert (when stacked) weighted by its gate, for 1 to 64 rows and 1 or 2 row blocks."""
    E, H, I, k, g = 12, 128, 64, 3, 32
    stack = random_stack(E + shared, H, I, g, shared, device=device)
    fns = expert_fns(stack, dtype)
    gen = torch.Generator().manual_seed(5)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for rows in (1, 3, 16, 17, 64):
        x = torch.randn(rows, H, generator=gen).to(device, dtype)
        w, e = route(torch.randn(rows, E, generator=gen).to(device, dtype), k)
        gate = torch.sigmoid(torch.randn(rows, 1, generator=gen)).to(device, dtype) if shared else None
        want = moe_ref(x.float(), w.float(), e, fns)
        if shared:
            want = want + gate.float() * torch.cat([fns[E](x[t:t + 1].float()) for t in range(rows)])
        torch.testing.assert_close(stacked_int4_expert_product_ref(x, w, e, stack, gate).float(), want,
                                   rtol=tol, atol=tol)
        torch.testing.assert_close(stacked_int4_expert_product(x, w, e, stack, gate).float(), want,
                                   rtol=tol, atol=tol)


def test_stacked_int4_bad_input():
    stack = random_stack(4, 64, 32, 32, shared=True)
    stack.check()
    x, (w, e) = torch.randn(2, 64), route(torch.randn(2, 3), 2)
    with pytest.raises(ValueError, match="shared expert: its gate weight"):
        stacked_int4_expert_product(x, w, e, stack)
    bad = StackedInt4(**{**vars(stack), "s2": stack.s2[:, :-1]})
    with pytest.raises(ValueError, match=r"s2 is \(4, 63, 1\)"):
        bad.check()
    with pytest.raises(ValueError, match="group size 48 must divide hidden 64"):
        StackedInt4(**{**vars(stack), "group_size": 48}).check()


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    """An AWQ (group 32) tiny MoE whose shared expert has the routed width (so it is stacked too); head dim 64
    (the Triton attention's)."""
    root = tmp_path_factory.mktemp("moe_int4")
    dense = write_random_checkpoint(root / "dense", tiny_config(FAMILY, head_dim=64,
                                                                shared_expert_intermediate_size=32), seed=11)
    qdir, _ = write_quantized(dense, root / "q", root / "r", "awq", group=32, seed=2)
    return qdir


def test_int4_experts_load_as_views_of_the_stacks(int4_checkpoint):
    """Loaded int4 experts are stacked per layer with the shared expert last; each expert's buffers are views of
    the stacks (no second copy), and the CPU forward (grouped per expert) is unchanged by stacking."""
    model = load_target(int4_checkpoint, max_positions=64)
    moe = model.model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and moe.q4 is not None and moe.q4.shared and moe.device_routed
    assert moe.q4.experts == len(moe.experts) + 1
    assert moe.experts[5].gate_up_proj.weight.qweight.data_ptr() == moe.q4.q13[5].data_ptr()
    assert moe.shared_expert.down_proj.weight.zeros.data_ptr() == moe.q4.z2[-1].data_ptr()
    assert module_bytes(moe) == module_bytes(moe.experts) + module_bytes(moe.shared_expert) \
        + module_bytes(moe.gate) + module_bytes(moe.shared_expert_gate)
    x = torch.randn(5, 64)
    w, e = route(moe.gate(x), moe.top_k, moe.normalise)
    gate = torch.sigmoid(moe.shared_expert_gate(x))
    want = moe.forward(x)           # CPU: per-expert products over the views
    got = stacked_int4_expert_product_ref(x, w, e, moe.q4, gate)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_kernel_row_rounds_the_same_at_any_row_count(device, dtype):
    """A row's output is bit-identical alone and among 63 others (the grouping and row blocks never change
    its arithmetic): what makes verify rows equal decode steps. The grouping launch logs the routed union."""
    from edgespec.kernels.moe.triton_moe_int4 import stacked_int4_expert_product_triton
    E, H, I, k = 64, 256, 128, 8
    stack = random_stack(E + 1, H, I, 128, True, seed=3, device=device)
    x = torch.randn(64, H, device=device, dtype=dtype)
    w, e = route(torch.randn(64, E, device=device, dtype=dtype), k)
    gate = torch.sigmoid(torch.randn(64, 1, device=device, dtype=dtype))
    log = RoutingLog(device)
    many = stacked_int4_expert_product_triton(x, w, e, stack, gate, (log.sums, log.calls))
    assert log.mean_union(64) == group_by_expert(e).union and log.layer_calls(64) == 1
    for t in (0, 17, 63):      # the tensor-core path (a lone row would take the CUDA-core one by default)
        one = stacked_int4_expert_product_triton(x[t:t + 1], w[t:t + 1], e[t:t + 1], stack, gate[t:t + 1],
                                                 (log.sums, log.calls), path="mma")
        assert torch.equal(one[0], many[t]), t
    assert log.mean_union(1) == k
    torch.testing.assert_close(many.float(), stacked_int4_expert_product_ref(x, w, e, stack, gate).float(),
                               rtol=3e-2 if dtype == torch.bfloat16 else 2e-5, atol=3e-2 if dtype ==
                               torch.bfloat16 else 2e-5)
    with pytest.raises(ValueError, match="1-64 rows"):
        stacked_int4_expert_product_triton(torch.randn(65, H, device=device, dtype=dtype), w, e, stack, gate)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_int4_model_spec_equals_plain(int4_checkpoint):
    """On CUDA the int4 experts (shared expert fused) run the Triton kernels inside the CUDA graphs, routed by
    the fused routing launch (one GEMM for the router and the shared gate), a decode row on the CUDA-core path
    and a verify of 6 rows on the tensor cores: logits close to the CPU model's, and greedy speculative output
    equal to plain in fp32 (n-gram and oracle drafts, every rollback), with the expert union in the telemetry."""
    from edgespec.kernels.moe.triton_moe_gemv import GEMV_TUNING
    cuda = torch.device("cuda")
    model = load_target(int4_checkpoint, device=cuda, max_positions=256)
    cpu_model = load_target(int4_checkpoint, max_positions=256)
    blocks = [b for b in model.modules() if isinstance(b, SparseMoE)]
    assert all(b.q4 is not None and b.q4.q13.is_cuda and b.router_w is not None and b.fused_routing
               for b in blocks)
    assert GEMV_TUNING["max_rows"] >= 1
    check_cuda_model(model, cpu_model, "rtx")


def test_router_and_shared_gate_stacked_as_one_matrix(int4_checkpoint):
    """With the shared expert stacked, the router's rows and the shared gate's row are one matrix (the two
    RouterLinear weights are views of it, no second copy), and the fused MoE entry on its logits equals the
    block's own forward (CPU: the torch references)."""
    model = load_target(int4_checkpoint, max_positions=64)
    moe = model.model.layers[1].mlp
    E = len(moe.experts)
    assert moe.router_w is not None and moe.router_w.shape == (E + 1, 64)
    assert moe.gate.weight.data_ptr() == moe.router_w.data_ptr()
    assert moe.shared_expert_gate.weight.data_ptr() == moe.router_w[E].data_ptr()
    x = torch.randn(3, 64)
    got = stacked_int4_moe(x, x @ moe.router_w.T, moe.top_k, moe.normalise, moe.q4)
    torch.testing.assert_close(got, moe.forward(x), rtol=1e-5, atol=1e-5)


def test_route_ties_go_to_the_lower_expert():
    """route() breaks ties by the lower expert id (torch.topk leaves their order open) and otherwise picks what
    torch.topk picks; the routing with the shared gate refuses logits of the wrong width by name."""
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0, 1.0], [0.0] * 6, [3.0, 1.0, 3.0, 3.0, 0.0, 3.0]])
    w, e = route(logits, 4)
    assert e.tolist() == [[1, 2, 4, 0], [0, 1, 2, 3], [0, 2, 3, 5]]
    torch.testing.assert_close(w.sum(-1), torch.ones(3))
    free = torch.randn(40, 32, generator=torch.Generator().manual_seed(4))
    assert torch.equal(route(free, 8)[1], torch.topk(torch.softmax(free, -1), 8).indices)
    stack = random_stack(7, 64, 32, 32, shared=True)
    with pytest.raises(ValueError, match=r"logits \(2, 6\) must be \[T, 7\] \(6 experts \+ the shared gate"):
        route_with_shared_ref(torch.randn(2, 6), 2, True, stack)


def _route_case(T: int, E: int, ties: bool, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Router logits ``[T, E + 1]`` (the shared gate logit last); ``ties``: a few distinct values only, so rows
    hold equal logits across the top-k boundary."""
    if ties:
        return torch.randint(0, 3, (T, E + 1), generator=gen).to(dtype)
    return torch.randn(T, E + 1, generator=gen).to(dtype)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_routing_equals_reference(device, dtype):
    """The fused routing launch picks the reference's experts exactly, in its order (ties included: lower id
    first), with its weights and shared gate within fp rounding, normalised or not, for 1 to 64 rows; its
    grouping equals the grouping launch's on the same routing; the block product equals the reference."""
    from edgespec.kernels.moe.triton_moe_int4 import group_pairs
    from edgespec.kernels.moe.triton_moe_route import route_group_pairs, stacked_int4_moe_triton
    E, H, I, k = 64, 256, 128, 8
    stack = random_stack(E + 1, H, I, 128, True, seed=3, device=device)
    gen = torch.Generator().manual_seed(9)
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-5
    for T, ties, normalise in itertools.product((1, 3, 4, 16, 64), (False, True), (True, False)):
        logits = _route_case(T, E, ties, gen, dtype).to(device)
        w_ref, e_ref, gate_ref = route_with_shared_ref(logits, k, normalise, stack)
        w, e, gate, grp = route_group_pairs(logits, k, normalise, stack)
        assert torch.equal(e.long(), e_ref), (T, ties, normalise)
        torch.testing.assert_close(w, w_ref, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
        torch.testing.assert_close(gate, gate_ref, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
        want = group_pairs(e_ref, w, stack, gate, None)
        for name in ("pair_row", "pair_dst", "slot_count", "pair_w"):
            assert torch.equal(grp[name], want[name]), name
        used = want["slot_count"] > 0           # the first and expert of unused slots are never written
        for name in ("slot_first", "slot_expert"):
            assert torch.equal(grp[name][used], want[name][used]), name
        x = torch.randn(T, H, generator=gen).to(device, dtype)
        torch.testing.assert_close(stacked_int4_moe_triton(x, logits, k, normalise, stack).float(),
                                   stacked_int4_expert_product_ref(x, w_ref, e_ref, stack, gate_ref).float(),
                                   rtol=tol, atol=tol)
    with pytest.raises(ValueError, match=r"must be \[T, 65\]"):
        route_group_pairs(torch.randn(2, E, device=device), k, True, stack)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_path_equals_reference(device, dtype):
    """The CUDA-core path (1-4 rows) equals the reference at every row count and tile split it takes, gives the
    same bits on a second call (no atomics), and refuses more rows than it takes by name."""
    from edgespec.kernels.moe import triton_moe_gemv
    from edgespec.kernels.moe.triton_moe_int4 import stacked_int4_expert_product_triton
    E, H, I, k = 64, 512, 256, 8
    stack = random_stack(E + 1, H, I, 64, True, seed=5, device=device)
    gen = torch.Generator().manual_seed(2)
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-5
    saved = dict(triton_moe_gemv.GEMV_TUNING)
    try:
        for waves, rows in itertools.product((1, 64), (1, 2, 3, 4)):     # 64 waves: K split to the most
            # max_rows 4: the kernel takes 1-4 rows; the served default sends it only what it won (1-2)
            triton_moe_gemv.GEMV_TUNING.update(waves=waves, down_min_tiles=1, max_rows=4)
            x = torch.randn(rows, H, generator=gen).to(device, dtype)
            w, e = route(torch.randn(rows, E, generator=gen).to(device, dtype), k)
            if rows > 1:            # the last row routed as the first: slots of 2+ pairs
                e[-1], w[-1] = e[0], w[0]
            gate = torch.sigmoid(torch.randn(rows, 1, generator=gen)).to(device, dtype)
            got = stacked_int4_expert_product_triton(x, w, e, stack, gate, path="gemv")
            torch.testing.assert_close(got.float(), stacked_int4_expert_product_ref(x, w, e, stack, gate).float(),
                                       rtol=tol, atol=tol)
            assert torch.equal(got, stacked_int4_expert_product_triton(x, w, e, stack, gate, path="gemv"))
        x = torch.randn(5, H, device=device, dtype=dtype)
        w, e = route(torch.randn(5, E, device=device, dtype=dtype), k)
        with pytest.raises(ValueError, match="5 rows; this path takes 1-4"):
            stacked_int4_expert_product_triton(x, w, e, stack, gate[:1].expand(5, 1).contiguous(), path="gemv")
    finally:
        triton_moe_gemv.GEMV_TUNING.update(saved)
    with pytest.raises(ValueError, match="path 'tiles' is not one of"):
        stacked_int4_expert_product_triton(x, w, e, stack, gate[:1].expand(5, 1).contiguous(), path="tiles")


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_fused_moe_captured_equals_eager(device):
    """The fused routing launch and the product (CUDA-core path at 1 and 4 rows, tensor cores at 16) captured in
    a CUDA graph: each replay on new inputs (new routing) gives the eager call's bits, and the routing log the
    graph adds to counts every replay."""
    from edgespec.kernels.moe.triton_moe_route import stacked_int4_moe_triton
    E, H, I, k = 64, 256, 128, 8
    stack = random_stack(E + 1, H, I, 128, True, seed=7, device=device)
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 4, 16):
        x = torch.randn(rows, H, generator=gen).to(device, torch.bfloat16)
        logits = torch.randn(rows, E + 1, generator=gen).to(device, torch.bfloat16)
        log = RoutingLog(device)
        stacked_int4_moe_triton(x, logits, k, True, stack, (log.sums, log.calls))      # compile outside capture
        torch.cuda.synchronize()
        log.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = stacked_int4_moe_triton(x, logits, k, True, stack, (log.sums, log.calls))
        for step in range(3):
            x.copy_(torch.randn(rows, H, generator=gen).to(torch.bfloat16))
            logits.copy_(torch.randn(rows, E + 1, generator=gen).to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, stacked_int4_moe_triton(x, logits, k, True, stack)), (rows, step)
        assert log.layer_calls(rows) == 3
