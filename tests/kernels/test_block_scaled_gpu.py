"""The block-scaled products (``edgespec.kernels.quant.triton_block_scaled``: NVFP4 and MXFP4 weights into
``tl.dot_scaled``) on CUDA, against ``quant_ref`` and the torch twin (``block_scaled_ref``); on Hopper
``tl.dot_scaled`` runs through Triton's emulated path (upcast to bf16, then an ordinary MMA), which computes what the
Blackwell MMA computes, so these are the products' correctness tests on an H100/H200 (issue 45, point 4).

* products: the decode (1 row), verify (2, 16, 17, 32, 33, 64 rows: each row-block width and its edges) and prefill
  (200 rows: several 64-row blocks, the last ragged) tiles, on Qwen3.5-27B and 4B layer shapes (each in_features
  with its narrowest and widest out_features), fp32 rows (bf16 values) against the twin (1e-5: fp32 summation order)
  and quant_ref (NVFP4 1e-3, the 4-term series; MXFP4 1e-5, exact series), bf16 rows against quant_ref (1e-2, the
  packed products' bf16 tolerance);
* served: a tiny random qwen3_5 model quantized to NVFP4/MXFP4 on Thor's hook set (its products chosen as for
  compute capability 11.0, run here) gives greedy speculative output == plain output in fp32, tolerance-free, with
  the block-scaled product in every packed layer of decode, verify and prefill.

A format whose scales the installed Triton cannot lower on this device is skipped, with the Triton version and the
missing capability in the reason, as found by trying it (``block_scaled_probe``: Triton 3.6 has no E4M3 scales on
sm_90, so NVFP4 skips there). A probe that runs but gives wrong numbers fails. Without CUDA only the probe's two
CPU checks run (it compiles for sm_90a; a dead probe child reads as not lowered).
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from test_quant_kernels_gpu import poison, rel_err  # the packed products' GPU checks: NaN-poisoned outputs

_TRITON = importlib.util.find_spec("triton") is not None
_READY = torch.cuda.is_available() and _TRITON
needs_gpu = pytest.mark.skipif(not _READY, reason="needs a CUDA device and Triton")

DEV = "cuda"
FORMATS = ("nvfp4", "mxfp4")
MODELS = ("qwen3.5-27b", "qwen3.5-4b")
DECODE_ROWS, VERIFY_ROWS, PREFILL_ROWS = 1, (2, 16, 17, 32, 33, 64), 200
ROWS = (DECODE_ROWS, *VERIFY_ROWS, PREFILL_ROWS)
BIAS_ROWS = (17, PREFILL_ROWS)               # a bias on one verify and the prefill (both epilogues: K split or not)
TWIN_TOL = 1e-5
REF_TOL = {"nvfp4": 1e-3, "mxfp4": 1e-5}
BF16_TOL = 1e-2
# Thor's compute capability: the served test's hooks choose the products as on Thor.
THOR = (11, 0)


@functools.cache
def layer_shapes(shape: str) -> tuple[tuple[int, int], ...]:
    """(out, in) of the packed layers of ``shape`` as served (its module tree on the meta device): for each
    in_features the narrowest and the widest out_features (ragged weight tiles and the widest grid)."""
    from edgespec.bench.formats import meta_model
    from edgespec.bench.gpu import shape_config
    from edgespec.weights.base import PackedWeight
    model = meta_model(shape_config(shape), "nvfp4", torch.bfloat16)
    by_k: dict[int, set[int]] = {}
    for p in model.modules():
        if isinstance(p, PackedWeight):
            by_k.setdefault(p.in_features, set()).add(p.out_features)
    return tuple(sorted({(n, k) for k, ns in by_k.items() for n in (min(ns), max(ns))}, key=lambda s: s[::-1]))


@functools.cache
def _probe():
    from block_scaled_probe import run_probe
    return run_probe()


def require_lowered(fmt: str) -> None:
    """Skip ``fmt`` where this Triton cannot lower its scale format here; fail where it runs but is wrong."""
    from block_scaled_probe import PROBE_TOL
    result = _probe()[fmt]
    if not result.lowered:
        pytest.skip(result.skip_reason())
    assert result.rel_err < PROBE_TOL, f"tl.dot_scaled ({fmt} operands) runs but is wrong: rel err {result.rel_err}"


def _compile_targets_runs() -> bool:
    """Whether ``edgespec.bench.compile_targets`` can specialise launches for the installed Triton (it binds them
    as Triton 3.9's launcher does, whose compilation knobs older versions lack)."""
    if not _TRITON:
        return False
    from triton import knobs
    return hasattr(knobs.compilation, "fpsan_homomorphic_casts")


@pytest.mark.skipif(not _compile_targets_runs(), reason="needs a Triton that compile_targets specialises for (3.9)")
def test_probe_compiles_for_hopper_on_the_cpu():
    """The probe compiles for sm_90a (the emulated MMA) in every format this Triton claims
    (``dot_scaled_available``: both on CI's 3.9): a probe failing for its own reasons would skip a format on the GPU
    that does lower there."""
    from block_scaled_probe import launch_probe, probe_operands

    from edgespec.bench.compile_targets import TARGETS, compile_launch, recording
    from edgespec.kernels.quant.triton_block_scaled import dot_scaled_available
    target = TARGETS["sm_90a"]
    claimed = [f for f in FORMATS if f == "mxfp4" or dot_scaled_available()]
    assert "mxfp4" in claimed
    for fmt in claimed:
        launches: list = []
        with recording(target, launches, ["probe"]):
            launch_probe(probe_operands(fmt, "cpu"))
        (launch,) = launches
        compiled = compile_launch(launch, target)
        assert not compiled.error, (fmt, compiled.error)
        assert sum(compiled.mma.values()) > 0, (fmt, compiled.mma)


def test_probe_reads_a_dead_child_as_not_lowered():
    """A child that aborted while probing NVFP4 (after MXFP4's line) leaves MXFP4's result and marks NVFP4 not
    lowered, naming the exit status and stderr's last line; a format after the dead one is left to probe again; a
    child dead before any kernel launched is an error, not a skip."""
    from block_scaled_probe import parse_child
    out = '{"launching": "mxfp4"}\n{"fmt": "mxfp4", "rel_err": 0.0}\n{"launching": "nvfp4"}\n'
    died = "python: BuiltinAttributes.cpp:1030: Assertion failed.\n"
    results = parse_child(out, died, -6, ["mxfp4", "nvfp4"])
    assert results["mxfp4"].lowered and results["mxfp4"].rel_err == 0.0
    assert not results["nvfp4"].lowered
    assert "status -6" in results["nvfp4"].error and "Assertion failed" in results["nvfp4"].error
    assert results["nvfp4"].skip_reason().startswith("Triton ")
    assert set(parse_child('{"launching": "nvfp4"}\n', died, -6, ["nvfp4", "mxfp4"])) == {"nvfp4"}
    with pytest.raises(RuntimeError, match="could not start"):      # died before the kernel: no Triton answer
        parse_child("", "AssertionError: Torch not compiled with CUDA enabled\n", 1, ["nvfp4"])


@pytest.fixture
def _no_tf32(monkeypatch):
    """quant_ref's fp32 matmul in fp32, not TF32, whatever another test set."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", MODELS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.usefixtures("_no_tf32")
def test_products_equal_quant_ref_every_tile(fmt: str, shape: str) -> None:
    from edgespec.kernels.quant.block_scaled_ref import block_scaled_matmul_ref
    from edgespec.kernels.quant.quant_ref import pack
    from edgespec.kernels.quant.triton_block_scaled import block_scaled_matmul
    require_lowered(fmt)
    for n, k in layer_shapes(shape):
        torch.manual_seed(n + k)
        p = pack(fmt, torch.randn(n, k, device=DEV) * 0.02)
        bias = torch.randn(n, device=DEV)
        for rows in ROWS:
            b = bias if rows in BIAS_ROWS else None
            x = torch.randn(rows, k, device=DEV).to(torch.bfloat16)
            x[0, :3] *= 100.0                                       # an outlier row
            poison()
            out = block_scaled_matmul(p, x.float(), b)
            assert out.shape == (rows, n) and out.dtype == torch.float32
            case = (fmt, n, k, rows)
            assert rel_err(out, block_scaled_matmul_ref(p, x.float(), b)) < TWIN_TOL, case
            assert rel_err(out, p.matmul_ref(x.float(), b)) < REF_TOL[fmt], case
            poison()
            out16 = block_scaled_matmul(p, x, None if b is None else b.to(torch.bfloat16))
            assert out16.dtype == torch.bfloat16, case
            assert rel_err(out16, p.matmul_ref(x, None if b is None else b.to(torch.bfloat16))) < BF16_TOL, case


def _thor_choosing_as_on_thor():
    from edgespec.arch.thor import ThorHooks

    class ThorAsOnThor(ThorHooks):
        """Thor's hook set with its products chosen for Thor's compute capability while running on this GPU
        (the block-scaled MMA emulated); rollbacks counted."""

        def __init__(self) -> None:
            super().__init__()
            self.rollbacks = 0

        def weight_kernel(self, packed, capability=None):
            return super().weight_kernel(packed, THOR if capability is None else capability)

        def rollback(self, *args, **kwargs):
            self.rollbacks += 1
            return super().rollback(*args, **kwargs)

    return ThorAsOnThor


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_served_tiny_model_spec_equals_plain_on_block_scaled_products(tmp_path, monkeypatch, fmt: str) -> None:
    from test_spec_lossless import OracleProposer

    from edgespec.bench.shapes import tiny_config, write_random_checkpoint
    from edgespec.drafters.quantize import quantize_linears
    from edgespec.kernels.quant import triton_block_scaled as T
    from edgespec.loading.checkpoint import load_target
    from edgespec.speculative.acceptance import StrictGreedy
    from edgespec.speculative.session import SpecSession
    from edgespec.weights.base import PackedWeight
    require_lowered(fmt)
    # every projection's in_features a multiple of the 128-wide K tile (GDN out_proj: 4 value heads of 32)
    cfg = tiny_config("qwen3_5", hidden_size=128, intermediate_size=256, head_dim=64, linear_value_head_dim=32)
    model = load_target(write_random_checkpoint(tmp_path / "m", cfg, seed=5), dtype=torch.float32, device=DEV,
                        max_positions=512)
    assert quantize_linears(model, fmt, torch.float32) > 0
    rows: list[int] = []
    real = T.block_scaled_matmul

    def counted(packed, x, *args, **kwargs):
        rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(packed, x, *args, **kwargs)

    monkeypatch.setattr(T, "block_scaled_matmul", counted)
    hooks_cls = _thor_choosing_as_on_thor()
    prompt = list(range(3, 24))
    plain = SpecSession.with_defaults(model, hooks_cls(), None, max_len=256).generate(
        prompt, max_tokens=24, policy=StrictGreedy()).token_ids
    packed = [p for p in model.modules() if isinstance(p, PackedWeight)]
    assert packed and all(p.kernel is T.block_scaled_kernel for p in packed), \
        {p.kernel for p in packed}                       # Thor's choice: the block-scaled product everywhere
    hooks, k = hooks_cls(), 5
    session = SpecSession.with_defaults(model, hooks, OracleProposer(plain, model.config.vocab_size, seed=3), k=k,
                                        max_len=256)
    out = session.generate(prompt, max_tokens=24, policy=StrictGreedy())
    assert out.token_ids == plain                        # fp32: exact, no tolerance
    assert hooks.rollbacks > 0 and out.telemetry.draft_tokens > 0
    # decode (1 row), the (k + 1)-row verify and the prompt's prefill all ran on the block-scaled product
    assert {1, k + 1} <= set(rows) and max(rows) > k + 1, sorted(set(rows))
