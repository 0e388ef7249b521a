"""The CUDA FP8 decode attention (``edgespec/kernels/cuda/fp8_decode_attention.cu``) against the fp32 torch
reference, and its build and dispatch rules.

GPU tests skip cleanly without CUDA or where the kernel library cannot be built (no ``nvcc``). Every check draws
fresh random inputs with outlier tokens and heads, poisons the allocator with NaN first, and compares by relative
error with the reference run on exactly the dequantised values the kernel reads.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from edgespec.cache.kv import KVCache, dequantize_fp8
from edgespec.kernels import cuda_build
from edgespec.kernels.attention import attention_ref, cached_attention
from edgespec.kernels.cuda_attention import (
    VARIANTS,
    cuda_decode_library,
    cuda_decode_supported,
    decode_launch_config,
    fp8_decode_attention_cuda,
)

DEV = "cuda"
TOL = 1e-2                     # fp16 products of exact e4m3 values, fp32 accumulation: measured ~3e-3


def _library_ready() -> bool:
    return torch.cuda.is_available() and cuda_decode_library(torch.device(DEV)) is not None


def gpu(test):
    """Mark a GPU test: selected by ``-m gpu``, skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


@pytest.fixture(autouse=True)
def _fresh_seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.fixture
def library() -> None:
    if not _library_ready():
        pytest.skip("the CUDA kernel library cannot be built here (no nvcc?)")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def poison_allocator() -> None:
    """NaN in freed blocks of both allocator pools: an output element the kernel forgets to write shows up."""
    big = [torch.full((64 << 18,), float("nan"), device=DEV) for _ in range(2)]
    small = [torch.full((n,), float("nan"), device=DEV) for n in (1 << 17, 1 << 14, 1 << 10) for _ in range(16)]
    del big, small


def make_fp8_cache(max_len: int, n_kv: int, hd: int, length: int) -> KVCache:
    """``length`` random rows with outlier tokens and a quiet head (the per-row scales absorb both)."""
    cache = KVCache(max_len, n_kv, hd, torch.bfloat16, DEV, fp8=True)
    k = torch.randn(length, n_kv, hd, device=DEV)
    v = torch.randn(length, n_kv, hd, device=DEV)
    k[::17] *= 8.0
    v[:, 0] *= 0.01
    v[::29] *= 20.0
    cache.write(0, k.to(torch.bfloat16), v.to(torch.bfloat16))
    return cache


def oracle(q: torch.Tensor, cache: KVCache, start: int, scale: float) -> torch.Tensor:
    """fp32 reference over the exact dequantised cache (no rounding to the compute dtype)."""
    k = dequantize_fp8(cache.k[:start + 1], cache.k_scale[:start + 1], torch.float32)
    v = dequantize_fp8(cache.v[:start + 1], cache.v_scale[:start + 1], torch.float32)
    return attention_ref(q.float(), k, v, start, scale)


CASES = [
    # (Hq, Hkv, hd, start): 27B / 4B / 9B / Qwen3 heads, lengths below, at and across block and split edges
    (24, 4, 256, 0),
    (24, 4, 256, 15),
    (24, 4, 256, 16),
    (24, 4, 256, 4999),
    (24, 4, 256, 32767),
    (16, 4, 256, 777),
    (16, 2, 256, 12345),
    (32, 8, 128, 3000),
    (32, 4, 128, 64),
    (4, 4, 256, 100),           # group 1
    (16, 2, 128, 2049),         # group 8
]


@gpu
@pytest.mark.parametrize("n_q,n_kv,hd,start", CASES)
@pytest.mark.parametrize("pos", ["int", "int64", "int32"])
def test_matches_reference(library: None, n_q: int, n_kv: int, hd: int, start: int, pos: str) -> None:
    cache = make_fp8_cache(start + 1 + 7, n_kv, hd, start + 1 + 7)     # rows past start must be ignored
    q = torch.randn(1, n_q, hd, device=DEV, dtype=torch.bfloat16)
    scale = hd ** -0.5
    poison_allocator()
    start_t = None if pos == "int" else torch.tensor([start], device=DEV, dtype=getattr(torch, pos))
    out = fp8_decode_attention_cuda(q, cache, start if start_t is None else 0, scale, start_t=start_t)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert rel_err(out, oracle(q, cache, start, scale)) < TOL


@gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n_splits", [1, 7, 64, 256])
def test_every_variant_and_split_count(library: None, variant: tuple[int, int], n_splits: int) -> None:
    """Each built (warps, ring depth) shape; 256 splits of 3000 keys leave splits with no key at all."""
    cache = make_fp8_cache(3001, 4, 256, 3001)
    q = torch.randn(1, 24, 256, device=DEV, dtype=torch.bfloat16)
    poison_allocator()
    cfg = {"num_warps": variant[0], "num_stages": variant[1], "n_splits": n_splits}
    out = fp8_decode_attention_cuda(q, cache, 3000, 0.0625, config=cfg)
    assert rel_err(out, oracle(q, cache, 3000, 0.0625)) < TOL


@gpu
def test_dispatcher_routes_decode_and_agrees_with_triton(library: None) -> None:
    from edgespec.kernels.triton_attention import cached_attention_triton
    cache = make_fp8_cache(8192, 4, 256, 8192)
    q = torch.randn(1, 24, 256, device=DEV, dtype=torch.bfloat16)
    ref = oracle(q, cache, 8191, 0.0625)
    via_dispatch = cached_attention(q, cache, 8191, 0.0625)
    via_cuda = fp8_decode_attention_cuda(q, cache, 8191, 0.0625)
    via_triton = cached_attention_triton(q, cache, 8191, 0.0625)
    assert torch.equal(via_dispatch, via_cuda)
    assert rel_err(via_cuda, ref) < TOL and rel_err(via_triton, ref) < TOL


@gpu
def test_graph_replays_at_every_position(library: None) -> None:
    """Captured once with the position in a device tensor, replayed at three positions: equal to eager calls."""
    cache = make_fp8_cache(4096, 4, 256, 4096)
    q = torch.randn(1, 24, 256, device=DEV, dtype=torch.bfloat16)
    pos = torch.zeros(1, dtype=torch.long, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fp8_decode_attention_cuda(q, cache, 0, 0.0625, start_t=pos)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_decode_attention_cuda(q, cache, 0, 0.0625, start_t=pos)
    for start in (5, 1000, 4095):
        pos.fill_(start)
        graph.replay()
        eager = fp8_decode_attention_cuda(q, cache, 0, 0.0625, start_t=pos)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        assert rel_err(out, oracle(q, cache, start, 0.0625)) < TOL


@gpu
def test_bad_inputs_are_named(library: None) -> None:
    cache = make_fp8_cache(64, 4, 256, 64)
    q = torch.randn(1, 24, 256, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not serve"):
        fp8_decode_attention_cuda(q.half(), cache, 10, 0.1)
    with pytest.raises(ValueError, match="does not serve"):
        fp8_decode_attention_cuda(torch.cat([q, q]), cache, 10, 0.1)
    with pytest.raises(ValueError, match="start_t"):
        fp8_decode_attention_cuda(q, cache, 0, 0.1, start_t=torch.zeros(1, device=DEV))
    with pytest.raises(ValueError, match="not built"):
        fp8_decode_attention_cuda(q, cache, 10, 0.1, config={"num_warps": 3})
    bf16 = KVCache(64, 4, 256, torch.bfloat16, DEV, fp8=False)
    assert not cuda_decode_supported(q, bf16)
    with pytest.raises(ValueError, match="does not serve"):
        fp8_decode_attention_cuda(q, bf16, 10, 0.1)


# ------------------------------------------------------------------------------------------ CPU-side rules

def test_launch_config_rules() -> None:
    cfg = decode_launch_config(4, 32768, 132)
    assert cfg["n_splits"] == 66                          # 2 blocks per SM over 4 KV heads
    assert decode_launch_config(4, 100, 132)["n_splits"] == 1     # short: >= two 16-key blocks per warp
    assert decode_launch_config(4, 32768, 132, {"n_splits": 9})["n_splits"] == 9
    with pytest.raises(ValueError, match="not built"):
        decode_launch_config(4, 32768, 132, {"num_warps": 16})


def test_cpu_tensors_are_not_served() -> None:
    cache = KVCache(32, 2, 128, torch.bfloat16, "cpu", fp8=True)
    assert not cuda_decode_supported(torch.randn(1, 4, 128, dtype=torch.bfloat16), cache)


def test_build_errors_name_the_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(cuda_build.CudaBuildError, match="no_such_kernel.cu not found"):
        cuda_build.build_library("no_such_kernel", (9, 0))
    with pytest.raises(cuda_build.CudaBuildError, match="could not run"):
        cuda_build.build_library("fp8_decode_attention", (9, 0), nvcc=str(tmp_path / "nvcc"))
    with pytest.raises(cuda_build.CudaBuildError, match="sm_80 or newer"):
        cuda_build.gencode((7, 5))
    monkeypatch.setenv("EDGESPEC_CUDA_KERNELS", "0")
    assert cuda_build.load_library.__wrapped__("fp8_decode_attention", (9, 0)) is None


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="no nvcc on this machine")
def test_kernel_source_compiles_for_hopper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA source builds with this machine's nvcc (no GPU needed), and the build is cached by content."""
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))
    first = cuda_build.build_library("fp8_decode_attention", (9, 0))
    assert first.is_file() and first.parent == tmp_path / "cuda"
    assert cuda_build.build_library("fp8_decode_attention", (9, 0)) == first
