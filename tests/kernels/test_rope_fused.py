"""The fused attention prologue (q/k norm, RoPE, KV write) on CPU: the reference is the old unfused path, bitwise.

:func:`edgespec.kernels.attention.rope.qk_norm_rope_write` replaced a sequence of torch ops in ``Attention.forward``;
the CPU path must compute exactly what that sequence computed (the golden tests against transformers rely on it).
``_old_forward`` below is the attention forward as it was before the fusion. The Triton kernel itself is tested
in ``tests/kernels/test_kernels_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from edgespec.cache.kv import KVCache
from edgespec.kernels.attention.attention import cached_attention
from edgespec.kernels.attention.rope import qk_norm_rope_write, qk_norm_rope_write_ref, rope_ref
from edgespec.models.config import ModelConfig
from edgespec.models.layers import Attention, RotaryEmbedding


def _old_forward(attn: Attention, x: torch.Tensor, cache: KVCache, start: int, rope: RotaryEmbedding,
                 pos_t: torch.Tensor | None = None, cs: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
    """``Attention.forward`` before the fusion, verbatim (split, chunk, norm modules, RotaryEmbedding, write)."""
    T = x.shape[0]
    if attn.qkv_proj is not None:
        q_out = attn.n_heads * attn.hd * (2 if attn.gated else 1)
        q, k, v = attn.qkv_proj(x).split([q_out, attn.n_kv * attn.hd, attn.n_kv * attn.hd], dim=-1)
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    gate = None
    if attn.gated:
        q, gate = q.view(T, attn.n_heads, 2 * attn.hd).chunk(2, dim=-1)
        gate = gate.reshape(T, attn.n_heads * attn.hd)
    q = q.reshape(T, attn.n_heads, attn.hd)
    k = k.reshape(T, attn.n_kv, attn.hd)
    v = v.reshape(T, attn.n_kv, attn.hd)
    if attn.q_norm is not None:
        q = attn.q_norm(q)
        k = attn.k_norm(k)
    if cs is None:
        cs = rope.angles(start, T, pos_t, q.dtype)
    q = rope(q, cs)
    k = rope(k, cs)
    cache.write(start, k, v, pos_t)
    out = cached_attention(q, cache, start, attn.scale, pos_t).reshape(T, attn.n_heads * attn.hd)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return attn.o_proj(out)


def _config(family: str, partial: float, hd: int = 32) -> ModelConfig:
    return ModelConfig(family=family, model_type=family, vocab_size=64, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=hd,
                       rope_theta=1e6, partial_rotary_factor=partial, max_position_embeddings=128)


def _random_layer(cfg: ModelConfig, dtype: torch.dtype, merged: bool) -> Attention:
    """An attention layer with random weights, norm weights included (a ``w`` vs ``1 + w`` slip must show)."""
    attn = Attention(cfg)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else 0.1))
    if merged:
        attn.merge_projections()
    return attn.to(dtype).eval()


def _caches(max_len: int, cfg: ModelConfig, dtype: torch.dtype, fp8: bool) -> tuple[KVCache, KVCache]:
    """Two identical caches holding random history."""
    a = KVCache(max_len, cfg.num_key_value_heads, cfg.head_dim, dtype, "cpu", fp8=fp8)
    b = KVCache(max_len, cfg.num_key_value_heads, cfg.head_dim, dtype, "cpu", fp8=fp8)
    k = torch.randn(max_len, cfg.num_key_value_heads, cfg.head_dim).to(dtype)
    v = torch.randn(max_len, cfg.num_key_value_heads, cfg.head_dim).to(dtype)
    a.write(0, k, v)
    b.write(0, k, v)
    return a, b


def _assert_same_cache(a: KVCache, b: KVCache) -> None:
    for name in ("k", "v", "k_scale", "v_scale") if a.fp8 else ("k", "v"):
        x, y = getattr(a, name), getattr(b, name)
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), name


@pytest.mark.parametrize("family,partial", [("llama", 1.0), ("qwen3", 1.0), ("qwen3", 0.5), ("qwen3_5", 0.25),
                                            ("qwen3_5", 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("graph_pos", [False, True])
@pytest.mark.parametrize("merged", [True, False])
def test_attention_forward_unchanged(family, partial, dtype, fp8, graph_pos, merged) -> None:
    """The new ``Attention.forward`` (through the dispatcher) equals the old one bitwise: output and cache,
    decode and verify rows, int start and device-tensor start, angles given or computed in the layer."""
    cfg = _config(family, partial)
    attn = _random_layer(cfg, dtype, merged)
    rope = RotaryEmbedding(cfg, 128)
    max_len = 64
    from edgespec.kernels.cpu import gguf_native
    compiled = (family == "llama" and dtype == torch.float32 and not fp8 and not graph_pos
                and gguf_native.library() is not None)
    # fp32 Qwen3 on CPU runs its q/k norms through the compiled norm (edgespec.kernels.pointwise.norm): float rounding
    # only
    compiled_norm = family == "qwen3" and dtype == torch.float32 and gguf_native.library() is not None
    with torch.inference_mode():
        for T, start, pass_cs in ((5, 0, True), (1, 5, False), (4, 6, True), (1, 10, True)):
            new_cache, old_cache = _caches(max_len, cfg, dtype, fp8)
            x = torch.randn(T, cfg.hidden_size).to(dtype)
            pos_t = torch.tensor([start]) if graph_pos else None
            cs = rope.angles(start, T, pos_t, dtype) if pass_cs else None
            new = attn(x, new_cache, start, rope, pos_t, cs)
            old = _old_forward(attn, x, old_cache, start, rope, pos_t, cs)
            if compiled:
                # fp32 Llama on CPU runs the compiled attention (edgespec.kernels.cpu.cpu_step): float rounding only
                torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(new_cache.k, old_cache.k, rtol=1e-6, atol=1e-6)
                assert torch.equal(new_cache.v, old_cache.v)
                continue
            if compiled_norm:
                torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-5)
                for name in ("k", "v", "k_scale", "v_scale") if fp8 else ("k", "v"):
                    x, y = getattr(new_cache, name), getattr(old_cache, name)
                    if x.dtype == torch.float8_e4m3fn:     # one code step apart at most where rounding differs
                        x, y = x.float(), y.float()
                        assert ((x - y).abs() <= 0.07 * y.abs().clamp(min=2 ** -6)).all(), name
                    else:
                        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
                continue
            assert torch.equal(new, old), (T, start)
            _assert_same_cache(new_cache, old_cache)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("norm", ["none", "standard", "zero_centred"])
@pytest.mark.parametrize("rot", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dispatcher_is_reference_on_cpu(gated, norm, rot, dtype) -> None:
    """On CPU the dispatcher runs the reference: same q, same gate view, same cache (FP8 scales included)."""
    T, n_q, n_kv, hd, start = 3, 4, 2, 64, 7
    q_out = n_q * hd * (2 if gated else 1)
    qkv = (torch.randn(T, q_out + 2 * n_kv * hd) * 2).to(dtype)
    zc = norm == "zero_centred"
    qw = kw = None
    if norm != "none":
        qw, kw = (torch.randn(hd) * 0.3 + (0.0 if zc else 1.0)).to(dtype), (torch.randn(hd) * 0.3).to(dtype)
    ang = torch.randn(T, 1, rot)
    cs = (ang.cos().to(dtype), ang.sin().to(dtype))
    for fp8 in (False, True):
        a = KVCache(16, n_kv, hd, dtype, "cpu", fp8=fp8)
        b = KVCache(16, n_kv, hd, dtype, "cpu", fp8=fp8)
        q1, g1 = qk_norm_rope_write(qkv, a, start, cs, n_q, n_kv, hd, gated, qw, kw, 1e-6, zc)
        q2, g2 = qk_norm_rope_write_ref(qkv, b, start, cs, n_q, n_kv, hd, gated, qw, kw, 1e-6, zc)
        assert q1.shape == (T, n_q, hd) and torch.equal(q1, q2)
        assert (g1 is None) == (not gated)
        if gated:
            assert torch.equal(g1, qkv[:, :q_out].view(T, n_q, 2 * hd)[..., hd:])
        _assert_same_cache(a, b)


@pytest.mark.parametrize("partial", [0.25, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_ref_is_rotary_embedding(partial, dtype) -> None:
    """``rope_ref`` (the reference's rotate-half) equals ``RotaryEmbedding.forward`` bitwise, on strided q too."""
    cfg = _config("qwen3_5", partial, hd=64)
    rope = RotaryEmbedding(cfg, 128)
    x = torch.randn(5, 4, 128).to(dtype)[..., :64]              # the gated q view: strided rows
    cs = rope.angles(9, 5, None, dtype)
    assert torch.equal(rope_ref(x, *cs), rope(x, cs))


def test_triton_wrapper_rejects_bad_inputs_on_cpu() -> None:
    """The wrapper's argument checks run before any launch, so they are testable without a GPU."""
    pytest.importorskip("triton")
    from edgespec.kernels.attention.triton_rope import qk_norm_rope_write_triton
    T, n_q, n_kv, hd = 2, 4, 2, 64
    qkv = torch.randn(T, 2 * n_q * hd + 2 * n_kv * hd, dtype=torch.bfloat16)
    cs = (torch.ones(T, 1, 16, dtype=torch.bfloat16), torch.zeros(T, 1, 16, dtype=torch.bfloat16))
    cache = KVCache(8, n_kv, hd, torch.bfloat16, "cpu", fp8=True)
    with pytest.raises(ValueError, match="last dim"):
        qk_norm_rope_write_triton(qkv, cache, 0, cs, n_q, n_kv, hd, False)
    with pytest.raises(ValueError, match="activation dtype"):
        qk_norm_rope_write_triton(qkv, cache, 0, (cs[0].float(), cs[1].float()), n_q, n_kv, hd, True)
    with pytest.raises(ValueError, match="outside the cache"):
        qk_norm_rope_write_triton(qkv, cache, 7, cs, n_q, n_kv, hd, True)
    with pytest.raises(ValueError, match="q_norm"):
        qk_norm_rope_write_triton(qkv, cache, 0, cs, n_q, n_kv, hd, True, q_norm=torch.ones(hd + 1))
