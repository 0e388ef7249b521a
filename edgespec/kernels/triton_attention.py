"""Split-K (flash-decoding) GQA attention of T <= 32 new query rows over the KV cache, in Triton.

Contract: :func:`edgespec.kernels.attention.attention_ref`. Two launches:

1. ``_attn_split_kernel``, grid ``(m_blocks, n_splits, Hkv)``. The key range ``0 .. L-1`` (``L = start + T``)
   is cut into ``n_splits`` contiguous chunks (a multiple of BLOCK_N keys each). A program owns one chunk of
   one KV head and ``BLOCK_M`` packed query rows: packed row ``r = t * G + g`` is query row t of head
   ``kvh * G + g`` (``G = Hq / Hkv``), so every query head that shares the KV head is served by one read of
   each KV row. It streams its chunk with an online softmax and writes a normalised partial output plus its
   log-sum-exp.
2. ``_attn_combine_kernel``, grid ``(T * Hq, hd / BLOCK_D)``, merges the partials of all splits.

Why this shape: at decode (T=1) there are only ``Hkv`` heads, far too few programs to pull full bandwidth from
a long cache, so the sequence itself must be split over the chip. FP8 caches are read as e4m3 bytes and
converted in registers (exactly: every e4m3 value is a bf16/fp16 value); the per-(token, head) scales are not
applied to the tiles but folded into the logits (``q.k_n * ks_n``) and into the probabilities
(``p_n * vs_n``), which costs one multiply per score instead of one per element. (With fp16 queries the V rows
are scaled instead: ``p_n * vs_n`` can fall below fp16's normal range.)

Measured status (H200, CUDA-graph timing, 32k keys, hd 256): the bf16 path streams at ~69% of copy
bandwidth at T=1; the FP8 path reads half the bytes but is NOT yet 1.6x faster (about 1.1x at T=1 and slower
at T=16). It runs at ~38% of copy bandwidth, so it is not DRAM-bound; the likely limit (not yet profiled) is
the in-register e4m3 -> bf16 conversion and the register -> shared-memory trip the converted tiles take to
the tensor cores. See ``tools/kernel_bench.py``.

Nothing about the position is compiled in: ``start`` is a plain runtime argument (not specialised), or is read
from a device tensor ``start_t``, and the grid then depends only on ``T`` and the cache size, so one CUDA
graph per T replays correctly at every position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.cache.kv import KVCache
from edgespec.kernels import sm_count

_LOG2E = 1.4426950408889634
# Finite stand-in for -inf in the running max, so fully masked rows give exp2(-inf - m) = 0 and never NaN.
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit(do_not_specialize=["start"])
def _attn_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, start_ptr, o_part_ptr, lse_part_ptr,
    start, T, n_splits, qk_scale,
    stride_qt, stride_qh,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_sn, stride_sh,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr, START_FROM_PTR: tl.constexpr, DOT_IEEE: tl.constexpr, V_SCALE_ROWS: tl.constexpr,
    FP16_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    kvh = tl.program_id(2)
    if START_FROM_PTR:
        start = tl.load(start_ptr).to(tl.int32)
    L = start + T
    # Same chunking in every program: keys per split, rounded up to whole BLOCK_N tiles.
    chunk = tl.cdiv(tl.cdiv(L, n_splits), BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, L)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = rows < T * GROUP
    last_key = start + t                                  # causal: row t sees keys 0 .. start + t
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if FP16_DOT:
        # e4m3 -> fp16 is one instruction per pair, e4m3 -> bf16 several: run the products in fp16 (finer than
        # bf16; queries are clamped to fp16's range, far beyond normed q values).
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    dot_ty = q.dtype

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if IS_FP8:
        # The scales of tile i+1 are loaded during tile i, so the small strided scale loads never sit on
        # the critical path of a tile (measured gain on an H200 was small: 42.8 -> 42.0 us at 32k, T=1).
        n_nx = lo + tl.arange(0, BLOCK_N)
        ks_nx = tl.load(ks_ptr + n_nx * stride_sn + kvh * stride_sh, mask=n_nx < hi, other=0.0)
        vs_nx = tl.load(vs_ptr + n_nx * stride_sn + kvh * stride_sh, mask=n_nx < hi, other=0.0)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        if IS_FP8:
            ks = ks_nx
            vs = vs_nx
            n_nx = n + BLOCK_N
            ks_nx = tl.load(ks_ptr + n_nx * stride_sn + kvh * stride_sh, mask=n_nx < hi, other=0.0)
            vs_nx = tl.load(vs_ptr + n_nx * stride_sn + kvh * stride_sh, mask=n_nx < hi, other=0.0)
        k = tl.load(k_ptr + n[:, None] * stride_kn + kvh * stride_kh + d[None, :],
                    mask=n_ok[:, None], other=0.0).to(dot_ty)
        v = tl.load(v_ptr + n[:, None] * stride_vn + kvh * stride_vh + d[None, :],
                    mask=n_ok[:, None], other=0.0).to(dot_ty)
        if DOT_IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if IS_FP8:
            s = s * (ks * qk_scale)[None, :]
        else:
            s = s * qk_scale
        visible = n_ok[None, :] & (n[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IS_FP8:
            if V_SCALE_ROWS:
                v = (v.to(tl.float32) * vs[:, None]).to(dot_ty)
            else:
                p = p * vs[None, :]
        if DOT_IEEE:
            pv = tl.dot(p.to(dot_ty), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(dot_ty), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # Empty chunks (or rows that see none of this chunk) leave l_i = 0: write o = 0 and a log-sum-exp the
    # combine step weights by exp2(_NEG_BIG - max) = 0.
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), _NEG_BIG)
    tl.store(o_part_ptr + pid_s * stride_ps + t[:, None] * stride_pt + head[:, None] * stride_ph + d[None, :],
             o, mask=row_ok[:, None])
    tl.store(lse_part_ptr + pid_s * stride_ls + t * stride_lt + head, lse, mask=row_ok)


@triton.jit
def _attn_combine_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, n_splits, n_heads,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    BLOCK_D: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    # One program per (row, head, BLOCK_D columns). All splits are loaded as one [SPLITS_P2, BLOCK_D] tile:
    # a loop over splits would be a chain of dependent-latency loads in only T * Hq programs.
    pid = tl.program_id(0)
    t = pid // n_heads
    h = pid % n_heads
    sp = tl.arange(0, SPLITS_P2)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    sp_ok = sp < n_splits
    lse = tl.load(lse_part_ptr + sp * stride_ls + t * stride_lt + h, mask=sp_ok, other=_NEG_BIG)
    w = tl.exp2(lse - tl.max(lse, axis=0))
    w = tl.where(sp_ok, w, 0.0)
    o = tl.load(o_part_ptr + sp[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
                mask=sp_ok[:, None], other=0.0)
    acc = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, acc.to(out_ptr.dtype.element_ty))


def attention_launch_config(T: int, n_q_heads: int, n_kv_heads: int, head_dim: int, key_len_hint: int,
                            sm_count: int, kv_bytes: int, q_bytes: int = 2) -> dict[str, int]:
    """Pick tile sizes, warps, pipeline depth and the number of sequence splits.

    ``key_len_hint`` is the key count the grid is sized for: the real length for eager calls, the cache
    capacity when the start comes from a device tensor (the grid must not change with the position).
    Splits aim at one (large row blocks) or two (small ones) programs per SM, but never below ~4 key tiles
    per split, because every split costs a partial-output write and read of ``T * Hq * hd`` floats.
    ``kv_bytes`` (bytes per cached element) bounds the pipeline depth: each stage holds a K and a V tile in
    shared memory. fp32 queries (``q_bytes`` 4, IEEE dots on the FMA units) keep row blocks small.
    """
    group = n_q_heads // n_kv_heads
    m = T * group
    # One 128-row block serves a whole verify (e.g. 16 rows x 6 heads) per KV read: measured on an H200 at
    # 32k, hd=256, T=16, it beat two 64-row blocks by 1.7x (FP8) and 1.9x (bf16).
    max_m = 128 if q_bytes <= 2 else 32
    block_m = min(max(16, triton.next_power_of_2(m)), max_m)
    m_blocks = triton.cdiv(m, block_m)
    # 128 rows of bf16 hd=256 fit shared memory only with 32-key tiles.
    block_n = 32 if block_m >= 128 and head_dim >= 256 and kv_bytes >= 2 else 64
    num_warps = 4 if block_m <= 16 else 8
    stage_bytes = 2 * block_n * head_dim * kv_bytes
    num_stages = max(1, min(3, (160 * 1024) // stage_bytes))
    per_split = m_blocks * n_kv_heads
    waves = 2 if block_m <= 32 else 1                   # big-tile programs fill an SM on their own
    by_chip = triton.cdiv(waves * sm_count, per_split)
    by_len = max(1, triton.cdiv(key_len_hint, 4 * block_n))
    n_splits = max(1, min(by_chip, by_len, 256))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages,
            "n_splits": n_splits, "m_blocks": m_blocks}


def cached_attention_triton(q: torch.Tensor, cache: KVCache, start: int, scale: float,
                            start_t: torch.Tensor | None = None,
                            config: dict[str, int] | None = None) -> torch.Tensor:
    """Causal GQA attention of ``q [T, Hq, hd]`` (positions ``start .. start+T-1``) over cache rows
    ``0 .. start+T-1``. Returns ``[T, Hq, hd]`` in q's dtype.

    ``start_t``: optional int32/int64 one-element CUDA tensor holding the start; when given it overrides
    ``start`` inside the kernel and the launch no longer depends on the position (CUDA-graph safe).
    ``config``: optional override of :func:`attention_launch_config`'s choice (benchmarks sweep it).
    """
    T, n_q, hd = q.shape
    n_kv = cache.k.shape[1]
    if hd not in (64, 128, 256):
        raise ValueError(f"head_dim {hd} not supported by the Triton attention (64/128/256)")
    if n_q % n_kv:
        raise ValueError(f"{n_q} query heads do not group over {n_kv} KV heads")
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = n_q // n_kv
    hint = cache.max_len if start_t is not None else start + T
    cfg = attention_launch_config(T, n_q, n_kv, hd, hint, sm_count(q.device), cache.k.element_size(),
                                  q.element_size())
    if config:
        cfg.update(config)
    cfg["m_blocks"] = triton.cdiv(T * group, cfg["BLOCK_M"])
    n_splits = cfg["n_splits"]

    o_part = torch.empty((n_splits, T, n_q, hd), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((n_splits, T, n_q), dtype=torch.float32, device=q.device)
    out = torch.empty((T, n_q, hd), dtype=q.dtype, device=q.device)
    k, v = cache.k, cache.v
    ks = cache.k_scale if cache.fp8 else k
    vs = cache.v_scale if cache.fp8 else v
    if cache.fp8:
        assert cache.k_scale.stride() == cache.v_scale.stride()
    s_strides = (ks.stride(0), ks.stride(1)) if cache.fp8 else (0, 0)
    # bf16 queries over an FP8 cache: fp16 products (H200, 32k keys, hd 256: 42.5 -> 35.1 us at T=1,
    # 104.7 -> 81.5 us at T=16; docs/measurements/attn_sweep_h200.txt).
    fp16_dot = cache.fp8 and q.dtype == torch.bfloat16 and cfg.get("FP16_DOT", 1) == 1
    _attn_split_kernel[(cfg["m_blocks"], n_splits, n_kv)](
        q, k, v, ks, vs, start_t if start_t is not None else q, o_part, lse_part,
        int(start), T, n_splits, float(scale) * _LOG2E,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *s_strides,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        GROUP=group, HEAD_DIM=hd, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        IS_FP8=cache.fp8, START_FROM_PTR=start_t is not None, DOT_IEEE=q.dtype == torch.float32,
        # fp16 has too little exponent range for p * v_scale (both small): scale the V rows instead.
        V_SCALE_ROWS=q.dtype == torch.float16 or fp16_dot, FP16_DOT=fp16_dot,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    splits_p2 = max(2, triton.next_power_of_2(n_splits))
    block_d = max(16, min(hd, 8192 // splits_p2))          # keep the [splits, BLOCK_D] tile at <= 8k floats
    _attn_combine_kernel[(T * n_q, hd // block_d)](
        o_part, lse_part, out, n_splits, n_q,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_D=block_d, SPLITS_P2=splits_p2, num_warps=4,
    )
    return out


def attention_bytes(T: int, n_q: int, n_kv: int, hd: int, key_len: int, fp8: bool, q_bytes: int = 2) -> int:
    """Fewest bytes one call must move: every visible KV row (and its scales) once, q in, out back."""
    kv = 2 * key_len * n_kv * hd * (1 if fp8 else q_bytes)
    scales = 2 * key_len * n_kv * 4 if fp8 else 0
    return kv + scales + 2 * T * n_q * hd * q_bytes

