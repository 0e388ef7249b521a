"""The Gluon FP8 decode program (``config={"GLUON": 1}``) against the fp32 oracle and the Triton program (its CUDA-graph
replay: ``tests/kernels/test_kernels_gpu.py::test_attention_start_tensor_and_cuda_graph``).

GPU only: Gluon kernels do not run in Triton's interpreter. The CPU side (launch rules, the compiled loop) is in
``tests/kernels/test_gluon_attention.py``.
"""

from __future__ import annotations

import importlib.util
import zlib

import pytest
import torch
from test_kernels_gpu import _fp8_oracle_fp32 as oracle
from test_kernels_gpu import _per_head_err as per_head_err
from test_kernels_gpu import make_cache, rel_err
from test_kernels_gpu import poison_allocator as poison

from edgespec.cache.kv import KVCache

_READY = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _READY, reason="needs a CUDA device and Triton")]

DEV = "cuda"
GLUON = {"GLUON": 1}
# Launch forms the benchmark times; each must give the same attention.
FORMS = [{}, {"num_warps": 4}, {"num_warps": 1}, {"BLOCK_W": 32}, {"num_warps": 1, "BLOCK_W": 32},
         {"num_stages": 2}, {"num_stages": 4},
         {"n_splits": 1}, {"n_splits": 7}, {"n_splits": 200}, {"BALANCE": 0}, {"BALANCE": 0, "n_splits": 7}]


@pytest.fixture(autouse=True)
def _fresh_seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def fp8_cache(max_len: int, n_kv: int, hd: int, length: int) -> KVCache:
    """``make_cache``'s FP8 cache of ``length`` rows, with junk rows after them (the rows of a rolled-back draft,
    which no call may read)."""
    cache = make_cache(max_len, n_kv, hd, length, torch.bfloat16, True)
    junk = min(20, max_len - length)
    if junk:
        rows = (300.0 * torch.randn(junk, n_kv, hd, device=DEV)).to(torch.bfloat16)
        cache.write(length, rows, rows)
    return cache


@pytest.mark.parametrize("n_q,n_kv,hd", [(24, 4, 256), (16, 4, 256), (32, 8, 128), (9, 3, 64), (8, 8, 128)])
@pytest.mark.parametrize("start", [0, 15, 31, 1500, 5000])
def test_gluon_decode_matches_oracle(n_q: int, n_kv: int, hd: int, start: int) -> None:
    """Every launch form against the oracle and the Triton program, at lengths that end inside a 16-key group,
    a 32-key block and a split, with 1 key (start 0) and with more splits than tiles (empty splits)."""
    from edgespec.kernels.attention.triton_attention import cached_attention_triton
    cache = fp8_cache(start + 40, n_kv, hd, start + 1)
    q = torch.randn(1, n_q, hd, device=DEV, dtype=torch.bfloat16)
    scale = hd ** -0.5
    ref = oracle(q, cache, start, scale)
    triton_out = cached_attention_triton(q, cache, start, scale)
    for form in FORMS:
        poison()
        out = cached_attention_triton(q, cache, start, scale, config={**GLUON, **form})
        assert out.shape == q.shape and out.dtype == q.dtype
        assert torch.isfinite(out).all(), form
        assert rel_err(out, ref) < 1e-2, (form, rel_err(out, ref))
        assert rel_err(out, triton_out) < 5e-3, (form, rel_err(out, triton_out))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_decode_v_scale_extremes(dtype: torch.dtype) -> None:
    """v scales far apart (tokens 1e-4x, zero rows, a KV head 1e-6x (fp16: 1e-2x), one 1e3x): every head to
    tolerance on its own scale, nothing outside fp16's range."""
    from edgespec.kernels.attention.triton_attention import cached_attention_triton
    n_q, n_kv, hd, start = 24, 4, 256, 700
    cache = KVCache(start + 9, n_kv, hd, dtype, DEV, fp8=True)
    k = torch.randn(start + 1, n_kv, hd, device=DEV)
    v = torch.randn(start + 1, n_kv, hd, device=DEV)
    k[::17] *= 8.0
    v[::23] *= 1e-4
    v[7::31] = 0.0
    v[:, 1] *= 1e-6 if dtype == torch.bfloat16 else 1e-2
    v[:, 3] *= 1e3
    cache.write(0, k.to(dtype), v.to(dtype))
    q = torch.randn(1, n_q, hd, device=DEV).to(dtype)
    ref = oracle(q, cache, start, hd ** -0.5)
    for form in ({}, {"n_splits": 64}, {"num_warps": 4}):
        out = cached_attention_triton(q, cache, start, hd ** -0.5, config={**GLUON, **form})
        assert torch.isfinite(out).all(), form
        assert per_head_err(out, ref) < {torch.bfloat16: 1e-2, torch.float16: 5e-3}[dtype], form


def test_gluon_decode_rejects_what_it_cannot_run() -> None:
    """Asked for where it does not apply (a verify, a bf16 cache, a key-major V), the call says why."""
    from edgespec.kernels.attention.triton_attention import cached_attention_triton
    n_q, n_kv, hd = 24, 4, 256
    fp8 = fp8_cache(64, n_kv, hd, 40)
    bf16 = KVCache(64, n_kv, hd, torch.bfloat16, DEV)
    q2 = torch.randn(2, n_q, hd, device=DEV, dtype=torch.bfloat16)
    q1 = q2[:1]
    with pytest.raises(ValueError, match="GLUON"):
        cached_attention_triton(q2, fp8, 30, hd ** -0.5, config=GLUON)
    with pytest.raises(ValueError, match="GLUON"):
        cached_attention_triton(q1, bf16, 30, hd ** -0.5, config=GLUON)
    rows = KVCache(64, n_kv, hd, torch.bfloat16, DEV, fp8=True, v_block=0)
    with pytest.raises(ValueError, match="GLUON"):
        cached_attention_triton(q1, rows, 30, hd ** -0.5, config=GLUON)

