"""On CUDA: the deferred GDN commit (verify keeps row inputs, accept advances the state) is exact.

The kernels: a verify with ``update_state=False`` returns the same rows and leaves the state alone; the multi-layer
advance leaves every state bit for bit where the same recurrence kernel stepping row by row leaves it; the conv
and gate kernels keep exactly the inputs the commit needs. The model: committing any number of rows of a deferred
verify gives the very state a checkpointed verify saved after that row (same graph-captured forward otherwise).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from edgespec.kernels.recurrent.conv import causal_conv1d_ref
from edgespec.kernels.recurrent.gdn import gdn_advance_ref

_READY = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _READY, reason="needs a CUDA device and Triton")]

DEV = "cuda"


def _stacked_inputs(L: int, T: int, n_k: int, n_v: int, dk: int, dv: int):
    """Per-layer conv outputs ``[L, T, q|k|v]`` (bf16), gates and states, as the state bank keeps them."""
    qkv = torch.randn(L, T, 2 * n_k * dk + n_v * dv, device=DEV).to(torch.bfloat16)
    g = -torch.rand(L, T, n_v, device=DEV) * 0.5 - 0.01
    beta = torch.rand(L, T, n_v, device=DEV) * 0.9 + 0.05
    states = torch.randn(L, n_v, dk, dv, device=DEV) * 0.3
    return qkv, g, beta, states


def _split(qkv: torch.Tensor, n_k: int, n_v: int, dk: int, dv: int):
    """q, k, v as strided head views of the stacked conv outputs."""
    kd = n_k * dk
    return (qkv[..., :kd].unflatten(-1, (n_k, dk)), qkv[..., kd:2 * kd].unflatten(-1, (n_k, dk)),
            qkv[..., 2 * kd:].unflatten(-1, (n_v, dv)))


@pytest.mark.parametrize("n_k,n_v,dk,dv", [(16, 32, 128, 128), (16, 48, 128, 128), (2, 4, 64, 32)])
@pytest.mark.parametrize("n", [1, 5, 16])
def test_advance_equals_stepping(n_k, n_v, dk, dv, n) -> None:
    from edgespec.kernels.recurrent.triton_gdn import gdn_advance_triton, gdn_recurrent_triton
    L, T = 3, 16
    qkv, g, beta, states = _stacked_inputs(L, T, n_k, n_v, dk, dv)
    q, k, v = _split(qkv, n_k, n_v, dk, dv)
    # Deferred verify: same rows as an updating verify, state untouched.
    for layer in range(L):
        kept = states[layer].clone()
        moved = states[layer].clone()
        o_def = gdn_recurrent_triton(q[layer], k[layer], v[layer], g[layer], beta[layer], kept, update_state=False)
        o_upd = gdn_recurrent_triton(q[layer], k[layer], v[layer], g[layer], beta[layer], moved)
        assert torch.equal(kept, states[layer]), "a deferred verify moved the state"
        assert torch.equal(o_def, o_upd), f"deferred rows differ: {(o_def - o_upd).abs().max().item()}"
    # The commit of n rows, all layers in one launch == n single-row steps per layer (decode), bit for bit.
    advanced = states.clone()
    gdn_advance_triton(k[:, :n], v[:, :n], g[:, :n], beta[:, :n], advanced)
    for layer in range(L):
        stepped = states[layer].clone()
        for t in range(n):
            sl = slice(t, t + 1)
            gdn_recurrent_triton(q[layer, sl], k[layer, sl], v[layer, sl], g[layer, sl], beta[layer, sl], stepped)
        assert torch.equal(advanced[layer], stepped), (layer, (advanced[layer] - stepped).abs().max().item())
    # And it follows the torch reference.
    ref = states.clone()
    gdn_advance_ref(k[:, :n], v[:, :n], g[:, :n], beta[:, :n], ref)
    assert ((advanced - ref).norm() / ref.norm()).item() < 1e-4


def test_advance_bad_input() -> None:
    from edgespec.kernels.recurrent.triton_gdn import gdn_advance_triton
    qkv, g, beta, states = _stacked_inputs(2, 4, 2, 4, 64, 32)
    _, k, v = _split(qkv, 2, 4, 64, 32)
    with pytest.raises(ValueError, match="advance shapes"):
        gdn_advance_triton(k, v, g[:, :3], beta, states)
    with pytest.raises(ValueError, match="contiguous fp32"):
        gdn_advance_triton(k, v, g, beta, states.to(torch.bfloat16))


@pytest.mark.parametrize("T", [1, 7, 16])
def test_conv_deferred_keeps_inputs(T) -> None:
    from edgespec.kernels.recurrent.triton_conv import causal_conv1d_triton
    C, K = 8192, 4
    x = torch.randn(T, C + 64, device=DEV, dtype=torch.bfloat16)[:, :C]          # a strided projection slice
    state = torch.randn(C, K - 1, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(C, K, device=DEV, dtype=torch.bfloat16)
    s_ref, s_out = state.clone(), state.clone()
    out = torch.full((16, C), float("nan"), device=DEV, dtype=torch.bfloat16)
    x_save = torch.full((16, C), float("nan"), device=DEV, dtype=torch.bfloat16)
    ref = causal_conv1d_ref(x, s_ref, w)
    got = causal_conv1d_triton(x, s_out, w, update_state=False, out=out[:T], x_save=x_save[:T])
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(s_out, state)                                              # window untouched
    assert torch.equal(x_save[:T], x) and torch.isnan(x_save[T:]).all()
    plain = causal_conv1d_triton(x, state.clone(), w)
    assert torch.equal(got, plain)                                                # same values as an update
    assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-2
    with pytest.raises(ValueError, match="x_save"):
        causal_conv1d_triton(x, s_out, w, update_state=False, x_save=x_save[:T].float())


def test_gates_into_buffers() -> None:
    from edgespec.kernels.pointwise.triton_activation import gdn_gates_triton
    a = torch.randn(5, 32, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(5, 32, device=DEV, dtype=torch.bfloat16)
    A_log = torch.randn(32, device=DEV)
    dt_bias = torch.randn(32, device=DEV)
    g_buf = torch.full((16, 32), float("nan"), device=DEV)
    b_buf = torch.full((16, 32), float("nan"), device=DEV)
    g, beta = gdn_gates_triton(a, b, A_log, dt_bias, out=(g_buf[:5], b_buf[:5]))
    g2, beta2 = gdn_gates_triton(a, b, A_log, dt_bias)
    assert torch.equal(g, g2) and torch.equal(beta, beta2) and g.data_ptr() == g_buf.data_ptr()
    with pytest.raises(ValueError, match="out must be"):
        gdn_gates_triton(a, b, A_log, dt_bias, out=(g_buf[:4], b_buf[:4]))


@pytest.mark.parametrize("arch", ["rtx", "thor"])
def test_graph_deferred_commit_equals_checkpoint(tmp_path, arch) -> None:
    """Graph-captured verify on a tiny Qwen3.5: for every number of kept rows, deferred == checkpoint state, bit
    for bit, and the verify logits are identical -- with the commit run eagerly (first use of a row count) and
    replayed from its CUDA graph (second pass)."""
    from edgespec.arch.detect import select_hooks
    from edgespec.arch.rollback import Checkpoint, Deferred
    from edgespec.bench.shapes import tiny_config, write_random_checkpoint
    from edgespec.loading.checkpoint import load_target

    cfg = tiny_config("qwen3_5", head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    model = load_target(write_random_checkpoint(tmp_path / "m", cfg, seed=4), dtype=torch.bfloat16, device=DEV,
                        max_positions=256)
    dev = torch.device(DEV)
    prompt = torch.randint(0, 320, (20,), device=DEV)
    rows = torch.randint(0, 320, (8,), device=DEV)
    hooks = {}
    caches = {}
    strategies = {"checkpoint": Checkpoint(), "deferred": Deferred()}
    for rollback, strategy in strategies.items():
        h = select_hooks(arch, dev)
        cache = h.new_cache(model, 128, False, strategy, max_rows=8)
        h.prepare(model, cache, 8, (), strategy, graphs=True, graph_prefill_max=h.defaults.graph_prefill_max)
        hooks[rollback], caches[rollback] = h, cache
    assert hooks["deferred"] is not None and caches["deferred"].states.graph_commits
    for keep in list(range(0, 9)) * 2:          # the second pass replays the commit graphs captured by the first
        logits = {}
        for rollback, h in hooks.items():
            cache = caches[rollback]
            cache.reset()
            h.prefill(model, cache, prompt, 64, ())
            logits[rollback] = h.verify(model, cache, rows, (), strategies[rollback]).logits.clone()
            strategies[rollback].rollback(model, cache, 20, rows, keep, ())
        assert torch.equal(logits["checkpoint"], logits["deferred"]), keep
        a, b = caches["checkpoint"], caches["deferred"]
        assert a.length == b.length == 20 + keep
        for sa, sb in zip(a.state_layers, b.state_layers, strict=True):
            assert torch.equal(sa.recurrent, sb.recurrent) and torch.equal(sa.conv, sb.conv), keep


@pytest.mark.parametrize("T", [1, 16, 64])
def test_conv_with_fused_gates(T) -> None:
    """The conv launch that also computes the GDN gates gives the values of the two separate kernels."""
    from edgespec.kernels.pointwise.triton_activation import gdn_gates_triton
    from edgespec.kernels.recurrent.conv import causal_conv1d_gates
    from edgespec.kernels.recurrent.triton_conv import causal_conv1d_triton
    C, K, H = 1024, 4, 48
    proj = torch.randn(T, C + 2 * H, device=DEV, dtype=torch.bfloat16)            # [mixed | b | a] as projected
    x, b, a = proj[:, :C], proj[:, C:C + H], proj[:, C + H:]
    state = torch.randn(C, K - 1, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(C, K, device=DEV, dtype=torch.bfloat16)
    A_log, dt_bias = torch.randn(H, device=DEV), torch.randn(H, device=DEV)
    s_fused, s_sep = state.clone(), state.clone()
    y, g, beta = causal_conv1d_gates(x, s_fused, w, a, b, A_log, dt_bias)
    y_ref = causal_conv1d_triton(x, s_sep, w)
    g_ref, beta_ref = gdn_gates_triton(a, b, A_log, dt_bias)
    assert torch.equal(y, y_ref) and torch.equal(s_fused, s_sep)
    assert torch.equal(g, g_ref) and torch.equal(beta, beta_ref)
    with pytest.raises(ValueError, match="do not fit"):
        causal_conv1d_gates(x, s_fused, w, a[:, :5], b, A_log, dt_bias)

