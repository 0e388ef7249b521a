"""The Triton tree kernels (edgespec.kernels.verify.triton_tree_gdn, the tree mode of
edgespec.kernels.recurrent.triton_conv) against
their oracles: the torch references of edgespec.kernels.verify.tree and each root-to-leaf branch run as its own chain.

The checks take a device: on CUDA (marked ``gpu``) and on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``
in a subprocess: the interpreter is chosen when a kernel is defined, so this process's compiled kernels can't serve).
Trees: a bushy one, the 64-row chain, the 64-row star and random trees of 33 and 64 rows.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgespec.kernels.pointwise.activation import gdn_gates_ref
from edgespec.kernels.recurrent.gdn import gdn_recurrent_ref
from edgespec.kernels.verify.tree import MAX_TREE_ROWS, TreeMask, gdn_tree_ref, tree_conv_ref

ROOT = Path(__file__).resolve().parents[2]
_TRITON = importlib.util.find_spec("triton") is not None
_CUDA = _TRITON and torch.cuda.is_available()

BUSHY = [-1, 0, 1, 2, 2, 1, 0, 6, 7, 0]


def random_parents(rows: int, seed: int) -> list[int]:
    """A random tree whose every parent precedes its child (the only order the kernels need)."""
    gen = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, t, (1,), generator=gen)) for t in range(1, rows)]


TREES = {"bushy": BUSHY, "chain64": list(range(-1, MAX_TREE_ROWS - 1)), "star64": [-1] + [0] * (MAX_TREE_ROWS - 1),
         "random33": random_parents(33, 1), "random64": random_parents(64, 2)}


def branches(parents: list[int]) -> list[list[int]]:
    """Every root-to-leaf path of rows."""
    kids = {p for p in parents if p >= 0}
    out = []
    for leaf in (t for t in range(len(parents)) if t not in kids):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        out.append(path[::-1])
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def check_gdn(device: str, parents: list[int], dtype: torch.dtype, heads: tuple[int, int, int, int],
              precision: str = "ieee", seed: int = 0) -> None:
    """Triton tree GDN == reference (relative error of the norm: fp32 1e-4 as tests/kernels/test_kernels_gpu.py,
    bf16 inputs/outputs 1e-2), == each branch as its own chain, and the committed state untouched. ``heads``: (key
    heads, value heads, dk, dv)."""
    from edgespec.kernels.verify.triton_tree_gdn import gdn_tree_triton

    torch.manual_seed(seed)
    Hk, Hv, dk, dv = heads
    T = len(parents)
    q, k = (torch.randn(T, Hk, dk, device=device).to(dtype) for _ in range(2))
    v = torch.randn(T, Hv, dv, device=device).to(dtype)
    g = -torch.rand(T, Hv, device=device) * 0.5
    beta = torch.rand(T, Hv, device=device)
    state = torch.randn(Hv, dk, dv, device=device)
    before = state.clone()
    tree = TreeMask.from_parents(torch.tensor(parents), device)
    out = gdn_tree_triton(q, k, v, g, beta, state, tree.bits, dtype, precision=precision)
    assert torch.equal(state, before), "the committed state was written"
    assert out.dtype == dtype and out.shape == (T, Hv, dv)
    ref = gdn_tree_ref(q, k, v, g, beta, state, tree.ancestors)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert rel_err(out, ref) < tol, (parents, dtype, precision, rel_err(out, ref))
    for path in branches(parents):
        idx = torch.tensor(path, device=device)
        chain = gdn_recurrent_ref(q[idx], k[idx], v[idx], g[idx], beta[idx], before.clone())
        assert rel_err(out[idx], chain) < tol, (path, rel_err(out[idx], chain))


def check_conv(device: str, parents: list[int], dtype: torch.dtype, seed: int = 0) -> None:
    """Triton tree conv: each branch bit for bit what the chain conv kernel gives for it, close to the reference,
    the inputs kept as the window stores them, the gates as the reference's, the committed state untouched."""
    from edgespec.kernels.recurrent.triton_conv import causal_conv1d_triton

    torch.manual_seed(seed)
    T, C, K, H = len(parents), 80, 4, 4
    x = torch.randn(T, C, device=device).to(dtype)
    state, weight = torch.randn(C, K - 1, device=device).to(dtype), torch.randn(C, K, device=device).to(dtype)
    a, b = torch.randn(T, H, device=device).to(dtype), torch.randn(T, H, device=device).to(dtype)
    A_log, dt_bias = torch.randn(H, device=device), torch.randn(H, device=device)
    before = state.clone()
    tree = TreeMask.from_parents(torch.tensor(parents), device)
    out, x_save = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    g, beta = torch.full((T, H), float("nan"), device=device), torch.full((T, H), float("nan"), device=device)
    causal_conv1d_triton(x, state, weight, update_state=False, out=out, x_save=x_save,
                         gates=(a, b, A_log, dt_bias, g, beta), tree=(tree.parents, tree.depths))
    assert torch.equal(state, before) and torch.equal(x_save, x)
    g_ref, beta_ref = gdn_gates_ref(a, b, A_log, dt_bias)
    tol = 1e-5 if dtype == torch.float32 else 1e-2           # beta rounds to b's dtype: an ulp apart at most
    torch.testing.assert_close(g, g_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(beta, beta_ref, rtol=tol, atol=tol)
    ref = tree_conv_ref(x, state, weight, tree)
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 2e-2), rel_err(out, ref)
    for path in branches(parents):
        idx = torch.tensor(path, device=device)
        chain = causal_conv1d_triton(x[idx], before.clone(), weight)
        assert torch.equal(out[idx], chain), path


# -- on the CPU, through Triton's interpreter -----------------------------------------------------------------
def interpreted_checks() -> None:
    """The checks at small head shapes on CPU tensors (run by the test below with ``TRITON_INTERPRET=1``)."""
    for name, parents in TREES.items():
        check_gdn("cpu", parents, torch.float32, (2, 4, 16, 32))
        check_conv("cpu", parents, torch.float32)
        check_conv("cpu", parents, torch.bfloat16)
        print("ok", name)
    check_gdn("cpu", TREES["random64"], torch.bfloat16, (2, 4, 32, 32))


@pytest.mark.skipif(not _TRITON, reason="needs Triton (its CPU interpreter)")
def test_tree_kernels_interpreted_on_cpu():
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "kernels")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    run = subprocess.run([sys.executable, "-c", "import test_tree_triton as t; t.interpreted_checks()"], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok ") == len(TREES)


# -- compiled for Hopper on the CPU (the interpreter runs code the compiler refuses, e.g. a reassigned constexpr) --
def _signature(kernel, pointers: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    """Every argument of ``kernel``: pointer types as given, the constexprs, fp32 scalars named ``*scale``, else i32."""
    return {n: pointers.get(n) or ("constexpr" if n in constexprs else "fp32" if n.endswith("scale") else "i32")
            for n in kernel.arg_names}


@pytest.mark.skipif(not _TRITON, reason="needs Triton")
def test_tree_kernels_compile_for_sm90():
    """The launches a 27B tree verify makes (and the chain conv beside the tree mode) compile to a Hopper cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from edgespec.kernels.recurrent.triton_conv import _causal_conv1d_kernel
    from edgespec.kernels.verify.triton_tree_gdn import _gdn_tree_kernel

    target = GPUTarget("cuda", 90, 32)
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")} | {"g_ptr": "*fp32", "b_ptr": "*fp32",
                                                                          "bits_ptr": "*i64", "s_ptr": "*fp32"}
    for t_pad, precision in ((16, "ieee"), (64, "ieee"), (64, "tf32x3")):
        consts = dict(RATIO=3, DK=128, DV=128, T_PAD=t_pad, LOG_T=t_pad.bit_length() - 1, BLOCK_V=32, PART_V=64,
                      PRECISION=precision)
        src = ASTSource(fn=_gdn_tree_kernel, signature=_signature(_gdn_tree_kernel, ptrs, consts), constexprs=consts)
        assert triton.compile(src, target=target, options={"num_warps": 8}).asm["cubin"]
    ptrs = {n: "*bf16" for n in _causal_conv1d_kernel.arg_names if n.endswith("_ptr")}
    ptrs |= {n: "*fp32" for n in ("alog_ptr", "dtb_ptr", "g_ptr", "beta_ptr")} | {"par_ptr": "*i64", "dep_ptr": "*i64"}
    for tree, block_t in ((True, 16), (False, 16), (False, 4)):
        consts = dict(K=4, KM1_P2=4, BLOCK_T=block_t, BLOCK_C=128, SAVE_SLOTS=not tree, UPDATE_STATE=not tree,
                      SAVE_X=tree, FUSE_GATES=tree, GATE_BLOCK=2048, TREE=tree, PDL=True)
        src = ASTSource(fn=_causal_conv1d_kernel, signature=_signature(_causal_conv1d_kernel, ptrs, consts),
                        constexprs=consts)
        assert triton.compile(src, target=target, options={"num_warps": 4}).asm["cubin"]


# -- bad inputs: refused by name before any launch ------------------------------------------------------------
@pytest.mark.skipif(not _TRITON, reason="needs Triton")
def test_tree_gdn_triton_refuses_bad_inputs():
    from edgespec.kernels.verify.triton_tree_gdn import gdn_tree_triton

    T, Hk, Hv, d = 5, 1, 2, 16
    q = k = torch.randn(T, Hk, d)
    v, g, beta, state = torch.randn(T, Hv, d), -torch.rand(T, Hv), torch.rand(T, Hv), torch.randn(Hv, d, d)
    bits = TreeMask.from_parents(torch.tensor([-1, 0, 1, 1, 0]), "cpu").bits
    with pytest.raises(ValueError, match="ancestor bits"):
        gdn_tree_triton(q, k, v, g, beta, state, bits[:4])
    with pytest.raises(ValueError, match="ancestor bits"):
        gdn_tree_triton(q, k, v, g, beta, state, bits.int())
    with pytest.raises(ValueError, match="precision 'tf32'"):
        gdn_tree_triton(q, k, v, g, beta, state, bits, precision="tf32")
    with pytest.raises(ValueError, match="1 to 64 rows"):
        big = torch.randn(65, Hk, d)
        gdn_tree_triton(big, big, torch.randn(65, Hv, d), -torch.rand(65, Hv), torch.rand(65, Hv), state,
                        torch.zeros(65, dtype=torch.int64))
    with pytest.raises(ValueError, match="do not divide dv"):
        gdn_tree_triton(q, k, v, g, beta, state, bits, parts=2)


@pytest.mark.skipif(not _TRITON, reason="needs Triton")
def test_tree_conv_triton_refuses_bad_inputs():
    from edgespec.kernels.recurrent.triton_conv import causal_conv1d_triton

    T, C, K = 3, 8, 4
    x, state, weight = torch.randn(T, C), torch.randn(C, K - 1), torch.randn(C, K)
    tree = TreeMask.from_parents(torch.tensor([-1, 0, 0]), "cpu")
    with pytest.raises(ValueError, match="reads the committed state only"):
        causal_conv1d_triton(x, state, weight, tree=(tree.parents, tree.depths))
    with pytest.raises(ValueError, match="depths must be a contiguous int64"):
        causal_conv1d_triton(x, state, weight, update_state=False, tree=(tree.parents, tree.depths.int()))


# -- on CUDA ------------------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not _CUDA, reason="needs CUDA and Triton")
QWEN35_27B_HEADS = (16, 48, 128, 128)


# Every tree in fp32 with IEEE products, then bf16 and the tf32x3 products on one tree each: each new launch costs a
# compile of ~half a minute (the 64-row kernel spills), so the matrix stays small.
GDN_CASES = [(tree, torch.float32, "ieee") for tree in TREES] + [("random64", torch.bfloat16, "ieee"),
                                                                 ("random64", torch.float32, "tf32x3")]


@pytest.mark.parametrize("tree, dtype, precision", GDN_CASES, ids=[f"{t}-{str(d)[6:]}-{p}" for t, d, p in GDN_CASES])
@pytest.mark.gpu
@needs_cuda
def test_tree_gdn_triton_on_cuda(tree, dtype, precision):
    check_gdn("cuda", TREES[tree], dtype, QWEN35_27B_HEADS, precision)


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.gpu
@needs_cuda
def test_tree_conv_triton_on_cuda(tree, dtype):
    check_conv("cuda", TREES[tree], dtype)


@pytest.mark.gpu
@needs_cuda
def test_tree_kernels_capture_in_a_cuda_graph():
    """Both launches replay from a CUDA graph with the same results (no host sync, no value-dependent shape)."""
    from edgespec.kernels.recurrent.triton_conv import causal_conv1d_triton
    from edgespec.kernels.verify.triton_tree_gdn import gdn_tree_triton

    torch.manual_seed(9)
    parents, (Hk, Hv, dk, dv) = TREES["random33"], QWEN35_27B_HEADS
    T, C = len(parents), 256
    dev = "cuda"
    tree = TreeMask.from_parents(torch.tensor(parents), dev)
    q, k = torch.randn(T, Hk, dk, device=dev), torch.randn(T, Hk, dk, device=dev)
    v, g, beta = torch.randn(T, Hv, dv, device=dev), -torch.rand(T, Hv, device=dev), torch.rand(T, Hv, device=dev)
    state = torch.randn(Hv, dk, dv, device=dev)
    x, conv_state, weight = (torch.randn(T, C, device=dev), torch.randn(C, 3, device=dev),
                             torch.randn(C, 4, device=dev))
    conv_out = torch.empty_like(x)

    def body() -> torch.Tensor:
        causal_conv1d_triton(x, conv_state, weight, update_state=False, out=conv_out, tree=(tree.parents,
                                                                                             tree.depths))
        return gdn_tree_triton(q, k, v, g, beta, state, tree.bits)

    eager, eager_conv = body(), conv_out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = body()
    conv_out.zero_()
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager) and torch.equal(conv_out, eager_conv)

