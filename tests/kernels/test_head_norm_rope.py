"""``head_norm_rope``: RMSNorm of the first n heads (each by its own weight), then NeoX RoPE, for the DFlash drafter.

On CPU the reference must be bit for bit the sequence the drafter ran before (``_head_rms_norm``: a unit-weight
``rms_norm`` of all heads, the first n sliced, times the stacked weights; then ``RotaryEmbedding.forward``), on
its two call shapes: the block's ``[T, nh + 2 nkv, hd]`` view of the merged projection with one ``[nh + nkv, hd]``
weight, and every layer's stacked context keys ``[L, T, 2 nkv, hd]`` with per-layer ``[L, 1, 1, hd]`` weights.
The Triton kernel is checked against the reference on CUDA (skipped without one).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from edgespec.kernels.attention.rope import head_norm_rope, head_norm_rope_ref
from edgespec.kernels.pointwise.norm import rms_norm
from edgespec.models.config import ModelConfig
from edgespec.models.layers import RotaryEmbedding

EPS = 1e-6


@pytest.fixture(autouse=True)
def _fresh_seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def _rope(hd: int, partial: float, max_len: int = 64, device: str = "cpu") -> RotaryEmbedding:
    cfg = ModelConfig(family="qwen3", model_type="qwen3", vocab_size=64, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=hd,
                      rope_theta=1e6, partial_rotary_factor=partial, max_position_embeddings=max_len)
    return RotaryEmbedding(cfg, max_len).to(device)


def _old_sequence(x: torch.Tensor, n: int, weight: torch.Tensor, rope: RotaryEmbedding,
                  cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The drafter before the fusion: ``rope(_head_rms_norm(x, n, weight, unit, eps), cs)``, verbatim."""
    unit = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return rope(rms_norm(x, unit, EPS, False)[..., :n, :] * weight, cs)


def _block_inputs(T: int, nh: int, nkv: int, hd: int, dtype: torch.dtype, device: str = "cpu"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``heads [T, nh + 2 nkv, hd]``: a view of a merged projection output, as ``DFlashAttention.forward`` has it;
    and the stacked q|k norm weights ``[nh + nkv, hd]`` (distinct per head: a head mix-up must show)."""
    proj = (torch.randn(T, (nh + 2 * nkv) * hd, device=device) * 3).to(dtype)
    w = (torch.randn(nh + nkv, hd, device=device) * 0.3 + 1).to(dtype)
    return proj.view(T, nh + 2 * nkv, hd), w


def _context_inputs(L: int, T: int, nkv: int, hd: int, dtype: torch.dtype, device: str = "cpu"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's k|v ``[L, T, 2 nkv, hd]`` (stacked, as ``_context_kv``) and per-layer k norms ``[L, 1, 1, hd]``."""
    kv = torch.stack([(torch.randn(T, 2 * nkv * hd, device=device) * 3).to(dtype) for _ in range(L)])
    w = torch.stack([(torch.randn(hd, device=device) * 0.3 + 1).to(dtype) for _ in range(L)])[:, None, None]
    return kv.view(L, T, 2 * nkv, hd), w


# ---------------------------------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("partial,hd", [(0.25, 64), (0.5, 64), (1.0, 64), (1.0, 32)])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_is_old_sequence_block(dtype, T, partial, hd) -> None:
    nh, nkv = 4, 2
    heads, w = _block_inputs(T, nh, nkv, hd, dtype)
    rope = _rope(hd, partial)
    cs = rope.angles(7, T, None, dtype)
    old = _old_sequence(heads, nh + nkv, w, rope, cs)
    for fn in (head_norm_rope_ref, head_norm_rope):
        new = fn(heads, nh + nkv, w, *cs, EPS)
        assert new.shape == (T, nh + nkv, hd) and new.dtype == dtype and new.is_contiguous()
        assert torch.equal(new, old), fn.__name__


@pytest.mark.parametrize("partial,hd", [(0.25, 64), (1.0, 64)])
@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_is_old_sequence_context(dtype, T, partial, hd) -> None:
    L, nkv = 3, 2
    kv, w = _context_inputs(L, T, nkv, hd, dtype)
    rope = _rope(hd, partial)
    cs = rope.angles(2, T, torch.tensor([2]), dtype)
    old = _old_sequence(kv, nkv, w, rope, cs)
    for fn in (head_norm_rope_ref, head_norm_rope):
        new = fn(kv, nkv, w, *cs, EPS)
        assert new.shape == (L, T, nkv, hd) and new.dtype == dtype and new.is_contiguous()
        assert torch.equal(new, old), fn.__name__


@pytest.mark.parametrize("form", ["[hd]", "[n,hd]", "[1,hd]", "[B,n,hd]", "[B,1,hd]", "[1,n,hd]", "[B,1,1,hd]",
                                  "[B,1,n,hd]"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_forms(form, dtype) -> None:
    """Every accepted weight form means the same as its full ``[B, 1, n, hd]`` broadcast in the old sequence;
    the forms without B serve a 3-D x too. 2-D ``[T, rotary_dim]`` angles equal ``[T, 1, rotary_dim]`` ones."""
    B, T, H, n, hd = 3, 4, 5, 3, 32
    x = (torch.randn(B, T, H, hd) * 2).to(dtype)
    full = (torch.randn(B, 1, n, hd) * 0.3 + 1).to(dtype)
    w = {"[hd]": full[0, 0, 0], "[n,hd]": full[0, 0], "[1,hd]": full[0, 0, :1], "[B,n,hd]": full[:, 0],
         "[B,1,hd]": full[:, 0, :1], "[1,n,hd]": full[:1, 0], "[B,1,1,hd]": full[:, :, :1],
         "[B,1,n,hd]": full}[form]
    broadcast = w[:, None] if w.dim() == 3 else w       # torch broadcasting would meet B with T
    rope = _rope(hd, 0.5)
    cs = rope.angles(0, T, None, dtype)
    old = _old_sequence(x, n, broadcast, rope, cs)
    assert old.shape == (B, T, n, hd)
    assert torch.equal(head_norm_rope(x, n, w, *cs, EPS), old)
    assert torch.equal(head_norm_rope(x, n, w, cs[0][:, 0], cs[1][:, 0], EPS), old)
    if "B" not in form:
        assert torch.equal(head_norm_rope(x[1], n, w, *cs, EPS), old[1])


def _bad_call_cases() -> list:
    T, H, n, hd, rot = 3, 6, 4, 32, 16
    x = torch.randn(T, H, hd).to(torch.bfloat16)
    x4 = torch.randn(2, T, H, hd).to(torch.bfloat16)
    w = torch.ones(n, hd, dtype=torch.bfloat16)
    cos = torch.ones(T, 1, rot, dtype=torch.bfloat16)
    ok = dict(x=x, n=n, weight=w, cos=cos, sin=cos)
    cases = [
        (dict(n=0), "n=0"),
        (dict(n=H + 1), "n=7"),
        (dict(x=x[0]), r"\[T, H_all, hd\]"),                                       # 2-D x
        (dict(x=x4[None]), r"\[T, H_all, hd\]"),                                   # 5-D x
        (dict(x=x.to(torch.int32)), "floating"),
        (dict(weight=w[:, :-1]), "weight"),                                         # hd does not fit
        (dict(weight=torch.ones(n + 1, hd, dtype=torch.bfloat16)), "weight"),       # head count
        (dict(weight=torch.ones(2, n, hd, dtype=torch.bfloat16)), "weight"),        # per-batch weight, 3-D x
        (dict(x=x4, weight=torch.ones(3, n, hd, dtype=torch.bfloat16)), "weight"),  # B does not fit
        (dict(x=x4, weight=torch.ones(2, T, n, hd, dtype=torch.bfloat16)), "weight"),  # a per-token weight
        (dict(weight=torch.ones(1, 1, 1, 1, hd, dtype=torch.bfloat16)), "weight"),  # 5-D
        (dict(weight=w.float()), "promote"),                                        # would promote to fp32
        (dict(cos=cos[:-1], sin=cos[:-1]), "cos"),                                  # angles for T-1 rows
        (dict(cos=cos.expand(T, 2, rot), sin=cos.expand(T, 2, rot)), "cos"),        # not [T, 1, rd]
        (dict(sin=cos[..., :8]), "rotary_dim"),                                     # cos/sin differ
        (dict(cos=cos[..., :7], sin=cos[..., :7]), "rotary_dim"),                   # odd
        (dict(cos=torch.ones(T, 1, 2 * hd, dtype=torch.bfloat16),
              sin=torch.ones(T, 1, 2 * hd, dtype=torch.bfloat16)), "rotary_dim"),   # past hd
        (dict(cos=cos.float(), sin=cos.float()), "dtype"),                          # angles in fp32
    ]
    return [pytest.param({**ok, **bad}, match, id=f"{i}-{match}") for i, (bad, match) in enumerate(cases)]


@pytest.mark.parametrize("args,match", _bad_call_cases())
def test_rejects_bad_inputs(args, match) -> None:
    for fn in (head_norm_rope, head_norm_rope_ref):
        with pytest.raises(ValueError, match=match):
            fn(args["x"], args["n"], args["weight"], args["cos"], args["sin"], EPS)


# ---------------------------------------------------------------------------------------------------- GPU

def _assert_mostly_bits(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Bitwise equal but for rare last-bit steps: the kernel sums the squares in another order than torch, so rstd
    may differ in its last bit and move an element by one rounding step (and through RoPE its partner channel).
    The allowance is the one the fused attention prologue's K rows get on an H200 (tests/kernels/test_kernels_gpu.py);
    a wrong head, row, weight or rotation moves most elements by O(1)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous(), what
    assert torch.isfinite(out).all(), what                      # every element written (outputs start as NaN)
    differ = (out != ref).sum().item()
    assert differ <= 0.2 * out.numel(), f"{what}: {differ} of {out.numel()} elements differ"
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= 4 * torch.finfo(ref.dtype).eps * ref.abs().max().item(), (what, err)
    rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel < 4e-3, (what, rel)


def _poison() -> None:
    """Freed allocator blocks full of NaN, so an element the kernel fails to write shows."""
    blocks = [torch.full((n,), float("nan"), device="cuda") for n in (1 << 22, 1 << 18, 1 << 14) for _ in range(4)]
    del blocks


# 27B-drafter-like shapes: (T, nh, nkv, hd, rotary fraction)
GPU_SHAPES = [(16, 24, 4, 256, 0.25), (16, 32, 8, 128, 1.0), (1, 24, 4, 256, 0.25), (16, 8, 2, 96, 0.5)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,nh,nkv,hd,partial", GPU_SHAPES)
@pytest.mark.parametrize("form", ["block", "context"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_matches_reference(form, T, nh, nkv, hd, partial, dtype) -> None:
    from edgespec.kernels.attention.triton_rope import head_norm_rope_triton
    rope = _rope(hd, partial, device="cuda")
    cs = rope.angles(5, T, None, dtype)
    if form == "block":
        x, w = _block_inputs(T, nh, nkv, hd, dtype, "cuda")
        n = nh + nkv
    else:
        x, w = _context_inputs(5, T, nkv, hd, dtype, "cuda")
        n = nkv
    ref = head_norm_rope_ref(x, n, w, *cs, EPS)
    _poison()
    out = head_norm_rope_triton(x, n, w, *cs, EPS)
    _assert_mostly_bits(out, ref, f"{form} {dtype}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_weight_forms_and_strides() -> None:
    """Per-batch-and-head weights, a shared ``[hd]`` one, 2-D angles and a layout whose leading dims are
    transposed (the kernel reads through x's strides, no copy)."""
    from edgespec.kernels.attention.triton_rope import head_norm_rope_triton
    L, T, nkv, hd = 4, 9, 4, 128
    kv, _ = _context_inputs(L, T, nkv, hd, torch.bfloat16, "cuda")
    strided = kv.transpose(0, 1).contiguous().transpose(0, 1)
    cs = _rope(hd, 0.5, device="cuda").angles(3, T, None, torch.bfloat16)
    for w in ((torch.randn(L, nkv, hd, device="cuda") * 0.3 + 1).to(torch.bfloat16),
              (torch.randn(hd, device="cuda") * 0.3 + 1).to(torch.bfloat16)):
        ref = head_norm_rope_ref(strided, nkv, w, *cs, EPS)
        _poison()
        out = head_norm_rope_triton(strided, nkv, w, cs[0][:, 0], cs[1][:, 0], EPS)
        _assert_mostly_bits(out, ref, f"weight {tuple(w.shape)}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dispatcher_in_cuda_graph() -> None:
    """Captured once through the public dispatcher on a view of a projection buffer, replayed on fresh rows and
    angles copied into the captured inputs: no host sync, no data-dependent shape, reads x in place."""
    T, nh, nkv, hd = 16, 24, 4, 256
    rope = _rope(hd, 0.25, device="cuda")
    heads, w = _block_inputs(T, nh, nkv, hd, torch.bfloat16, "cuda")
    cos, sin = (c.clone() for c in rope.angles(0, T, None, torch.bfloat16))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                        # compile and warm up outside the capture
        head_norm_rope(heads, nh + nkv, w, cos, sin, EPS)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = head_norm_rope(heads, nh + nkv, w, cos, sin, EPS)
    for start in (0, 9, 40):
        fresh, _ = _block_inputs(T, nh, nkv, hd, torch.bfloat16, "cuda")
        heads.copy_(fresh)
        fresh_cs = rope.angles(start, T, None, torch.bfloat16)
        cos.copy_(fresh_cs[0])
        sin.copy_(fresh_cs[1])
        out.fill_(float("nan"))
        graph.replay()
        _assert_mostly_bits(out, head_norm_rope_ref(heads, nh + nkv, w, cos, sin, EPS), f"replay at {start}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_rejects_mixed_devices() -> None:
    from edgespec.kernels.attention.triton_rope import head_norm_rope_triton
    heads, w = _block_inputs(2, 4, 2, 64, torch.bfloat16, "cuda")
    cs = _rope(64, 1.0, device="cuda").angles(0, 2, None, torch.bfloat16)
    with pytest.raises(ValueError, match="one device"):
        head_norm_rope_triton(heads, 6, w.cpu(), *cs, EPS)
