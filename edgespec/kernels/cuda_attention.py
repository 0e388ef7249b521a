"""One-row (decode) attention over an FP8 KV cache, in CUDA: ``cuda/fp8_decode_attention.cu``.

Contract: :func:`edgespec.kernels.attention.attention_ref` for ``T = 1`` (the same as
:func:`edgespec.kernels.triton_attention.cached_attention_triton`), with bf16 queries, head_dim 128 or 256 and at
most 8 query heads per KV head. The kernel writes split partials in the Triton kernel's format and the Triton
merge (:func:`~edgespec.kernels.triton_attention.merge_splits`) combines them, so both paths share the split rule
and the merge. Why a hand-written kernel for this one case: see the notes at the top of the ``.cu`` file and
``docs/benchmarks.md`` (the Triton code generation of the FP8 P.V product was the bound, not memory).

The dispatcher (:func:`edgespec.kernels.attention.cached_attention`) uses it where :func:`cuda_decode_supported`
holds and falls back to Triton otherwise (no ``nvcc``, ``EDGESPEC_CUDA_KERNELS=0``, other shapes).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from edgespec.cache.kv import KVCache
from edgespec.kernels import pdl_enabled, sm_count
from edgespec.kernels.cuda_build import load_library
from edgespec.kernels.triton_pdl import pdl_launch

_LOG2E = 1.4426950408889634
_KEYS = 16                                   # keys per block of one warp (the kernel's kKeys)

# Launch policy (H200, 27B heads, 32k keys: tools/kernel_bench.py --fp8-sweep). ``waves``: blocks per SM the
# split count aims at. Instantiated shapes: (num_warps, num_stages) in VARIANTS.
CUDA_DECODE_LAUNCH: dict[str, int] = {"num_warps": 4, "num_stages": 3, "waves": 2}
VARIANTS = ((2, 3), (2, 4), (4, 2), (4, 3), (4, 4), (8, 2), (8, 3))
CONFIG_KEYS = ("num_warps", "num_stages", "waves", "n_splits")


@functools.cache
def _library(capability: tuple[int, int]) -> ctypes.CDLL | None:
    lib = load_library("fp8_decode_attention", capability)
    if lib is None:
        return None
    fn = lib.edgespec_fp8_decode_attention
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    fn.argtypes = [vp] * 6 + [i32, i32, vp, vp, i32, i32, i32, i32, ctypes.c_float] + [i64] * 10 + [i32, i32, i32,
                                                                                                 vp]
    fn.restype = i32
    lib.edgespec_cuda_error_string.argtypes = [i32]
    lib.edgespec_cuda_error_string.restype = ctypes.c_char_p
    return lib


def cuda_decode_library(device: torch.device) -> ctypes.CDLL | None:
    """The kernel library for ``device`` (built on first use), or ``None`` where it cannot be had."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _library(torch.cuda.get_device_capability(index))


def cuda_decode_supported(q: torch.Tensor, cache: KVCache) -> bool:
    """True when the CUDA kernel serves this call: one bf16 query row on CUDA over an FP8 cache, head_dim 128 or
    256, 1-8 query heads per KV head, contiguous head_dim, and the library built."""
    T, n_q, hd = q.shape
    n_kv = cache.k.shape[1]
    return (q.is_cuda and cache.fp8 and T == 1 and q.dtype == torch.bfloat16 and hd in (128, 256)
            and n_q % n_kv == 0 and 1 <= n_q // n_kv <= 8 and q.stride(-1) == 1 and cache.k.stride(-1) == 1
            and cache.v.stride(-1) == 1 and cuda_decode_library(q.device) is not None)


def decode_launch_config(n_kv: int, key_len_hint: int, sm_count: int,
                         overrides: dict[str, int] | None = None) -> dict[str, int]:
    """Warps, ring depth and split count. Splits aim at ``waves`` blocks per SM but keep at least two 16-key blocks
    per warp (each split costs a partial write and read); ``n_splits`` given outright wins."""
    cfg = {**CUDA_DECODE_LAUNCH, **{k: int(v) for k, v in (overrides or {}).items() if k in CONFIG_KEYS}}
    if (cfg["num_warps"], cfg["num_stages"]) not in VARIANTS and (cfg["num_warps"], cfg["num_stages"]) != (4, -3):
        raise ValueError(f"num_warps={cfg['num_warps']}, num_stages={cfg['num_stages']} not built; one of {VARIANTS}")
    if "n_splits" not in cfg:
        by_chip = -(-cfg["waves"] * sm_count // n_kv)
        by_len = max(1, -(-key_len_hint // (2 * _KEYS * cfg["num_warps"])))
        cfg["n_splits"] = max(1, min(by_chip, by_len, 256))
    return cfg


def fp8_decode_attention_cuda(q: torch.Tensor, cache: KVCache, start: int, scale: float,
                              start_t: torch.Tensor | None = None,
                              config: dict[str, int] | None = None) -> torch.Tensor:
    """Attention of one query row per head ``q [1, Hq, hd]`` (position ``start``, or ``start_t[0]`` read on the
    device: CUDA-graph safe) over FP8 cache rows ``0 .. start``. Returns ``[1, Hq, hd]`` bf16. ``config``: any of
    ``CONFIG_KEYS`` (benchmarks sweep them). Raises ``ValueError`` for calls :func:`cuda_decode_supported`
    rejects and ``RuntimeError`` with CUDA's message when the launch fails."""
    from edgespec.kernels.triton_attention import merge_splits
    if not cuda_decode_supported(q, cache):
        raise ValueError(f"fp8_decode_attention_cuda does not serve q {tuple(q.shape)} {q.dtype} over "
                         f"{'an FP8' if cache.fp8 else 'a ' + str(cache.k.dtype)} cache (see cuda_decode_supported)")
    if start_t is not None and (start_t.numel() != 1 or start_t.dtype not in (torch.int32, torch.int64)
                                or start_t.device != q.device):
        raise ValueError("start_t must be one int32/int64 element on q's device")
    _, n_q, hd = q.shape
    n_kv = cache.k.shape[1]
    hint = cache.max_len if start_t is not None else start + 1
    cfg = decode_launch_config(n_kv, hint, sm_count(q.device), config)
    o_part = torch.empty((cfg["n_splits"], 1, n_q, hd), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((cfg["n_splits"], 1, n_q), dtype=torch.float32, device=q.device)
    out = torch.empty((1, n_q, hd), dtype=q.dtype, device=q.device)
    launch_splits(q, cache, start, scale, start_t, o_part, lse_part, cfg)
    merge_splits(o_part, lse_part, out, pdl_launch(q.device))
    return out


def launch_splits(q: torch.Tensor, cache: KVCache, start: int, scale: float, start_t: torch.Tensor | None,
                  o_part: torch.Tensor, lse_part: torch.Tensor, cfg: dict[str, int]) -> None:
    """The first of the two launches: the split kernel, writing ``o_part [n_splits, 1, Hq, hd]`` and
    ``lse_part [n_splits, 1, Hq]`` (float32) with ``cfg`` from :func:`decode_launch_config`. Callers have checked
    :func:`cuda_decode_supported`."""
    n_q, hd = q.shape[1], q.shape[2]
    n_kv = cache.k.shape[1]
    k, v, ks, vs = cache.k, cache.v, cache.k_scale, cache.v_scale
    assert ks.stride() == vs.stride() and o_part.shape[0] == cfg["n_splits"]
    lib = cuda_decode_library(q.device)
    err = lib.edgespec_fp8_decode_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), ks.data_ptr(), vs.data_ptr(),
        start_t.data_ptr() if start_t is not None else None,
        int(start_t is not None and start_t.dtype == torch.int64), int(start),
        o_part.data_ptr(), lse_part.data_ptr(), cfg["n_splits"], n_kv, n_q // n_kv, hd, float(scale) * _LOG2E,
        q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), ks.stride(0), ks.stride(1),
        o_part.stride(0), o_part.stride(2), lse_part.stride(0),
        cfg["num_warps"], cfg["num_stages"], int(pdl_enabled(q.device)),
        torch.cuda.current_stream(q.device).cuda_stream)
    if err != 0:
        raise RuntimeError(f"FP8 decode attention launch failed: {lib.edgespec_cuda_error_string(err).decode()}")
