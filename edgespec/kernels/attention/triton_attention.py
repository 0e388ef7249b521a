"""Split-K (flash-decoding) GQA attention of T <= 32 new query rows over the KV cache, in Triton.

Contract: :func:`edgespec.kernels.attention.attention.attention_ref`. Two launches:

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
applied to the tiles but folded into the logits (``q.k_n * ks_n``) and into the probabilities, which costs one
multiply per score instead of one per element. bf16/fp32 products take ``p_n * vs_n`` as is; fp16 products
(bf16 queries over an FP8 cache run their products in fp16: e4m3 -> fp16 is one instruction per pair) take
``p_n * vs_n / vmax`` with ``vmax`` the tile's largest v scale, which stays in [0, 1] whatever the scales, and
carry ``vmax`` in the accumulator's per-row factor (``V_SCALE`` "tile"; the older form multiplied every V element,
"rows").

FP8 code generation (sm_90, Triton 3.6; read off the compiled SASS with ``lab/attn_sass.py``, timed with
``tools/kernel_bench.py --fp8-sweep``; the experiments behind these choices: docs/notes/attention-experiments.md):

- V is stored key-blocked and transposed for FP8 (:class:`~edgespec.cache.kv.KVCache`, ``V_BLOCK``): the tensor
  cores take the ``p . V`` operand as pairs of consecutive keys and sm_90 has no 8-bit transposing load, so a
  key-major e4m3 V was gathered byte by byte (128 single-byte shared-memory loads per 32-key tile). Read as
  ``[HEAD_DIM, BLOCK_N]`` with the keys contiguous, the tile is copied as 16-byte vectors and converted in place.
- The compiler places the e4m3 -> fp16 conversion itself. ``OPAQUE_CVT`` (an identity it cannot see into, so tiles
  are converted once and fed by ldmatrix) cuts the loop's instructions but was slower at decode; it stays as a
  launch option.
- The program shape matters more than instruction counts: the decode program is bound by the dependency chains of
  its own conversions, softmax and products (Nsight Compute), not by memory issue. See ``FP8_LAUNCH`` for the
  measured launches; from 8192 keys one-row decode runs the Gluon program instead
  (:mod:`edgespec.kernels.attention.gluon_attention_fp8`).
- Pipelining needs ``num_stages`` >= 3: with 2 the next tile's copy is issued only after the current tile's dots.

Nothing about the position is compiled in: ``start`` is a plain runtime argument (not specialised), or is read
from a device tensor ``start_t``, and the grid then depends only on ``T`` and the cache size, so one CUDA
graph per T replays correctly at every position.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from edgespec.cache.kv import KVCache
from edgespec.kernels import sm_count, split_count
from edgespec.kernels.launch.triton_pdl import pdl_enter, pdl_launch, pdl_release, pdl_wait
from edgespec.kernels.options import KernelOptions, active

try:  # Gluon (Triton's explicit-layout dialect; Triton 3.6 has it): without it, the Triton program only.
    from edgespec.kernels.attention import gluon_attention_fp8
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon_attention_fp8 = None

_LOG2E = 1.4426950408889634
# Finite stand-in for -inf in the running max, so fully masked rows give exp2(-inf - m) = 0 and never NaN.
_NEG_BIG = tl.constexpr(-1.0e30)
# How an FP8 cache's v scales reach the output (``V_SCALE``): not at all (model-dtype cache); folded into the
# probabilities ("p": bf16/fp32 products have the exponent range); multiplied into every V element ("rows": the
# older fp16-product form, a per-element multiply and a register round trip of the V tile); folded into the
# probabilities relative to the tile's largest scale, which rides in the accumulator's per-row factor ("tile":
# fp16 products).
V_SCALE_NONE = tl.constexpr(0)
V_SCALE_P = tl.constexpr(1)
V_SCALE_ROWS = tl.constexpr(2)
V_SCALE_TILE = tl.constexpr(3)
_V_SCALE_MODES = {"p": 1, "rows": 2, "tile": 3}


@triton.jit
def _opaque(x):
    """Identity on a 16-bit tile that the compiler cannot see through (an impure inline-PTX move, which ptxas
    drops again). It keeps the e4m3 -> fp16 conversion in the load's layout, where the tile is read as vectors,
    and keeps the 8-bit operand layout off the dot (see the module notes)."""
    return tl.inline_asm_elementwise(asm="mov.b32 $0, $1;", constraints="=r,r", args=[x], dtype=x.dtype,
                                     is_pure=False, pack=2)


# n_splits is not specialised either: a split count divisible by 16 would otherwise compile a second kernel
# (nothing in the kernel gains from knowing it).
@triton.jit(do_not_specialize=["start", "n_splits"])
def _attn_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, start_ptr, o_part_ptr, lse_part_ptr, tree_ptr,
    start, T, n_splits, qk_scale,
    stride_qt, stride_qh,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_vb,
    stride_sn, stride_sh,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr, START_FROM_PTR: tl.constexpr, DOT_IEEE: tl.constexpr, V_SCALE: tl.constexpr,
    FP16_DOT: tl.constexpr, OPAQUE_CVT: tl.constexpr, PDL: tl.constexpr, V_BLOCK: tl.constexpr,
    TREE: tl.constexpr = False,
):
    pdl_wait(PDL)
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
    if TREE:
        # Tree verify (edgespec.kernels.verify.tree): row t sees the prefix and the new rows whose bit is set in
        # its mask.
        anc = tl.load(tree_ptr + t, mask=row_ok, other=0)
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
    # V_SCALE_TILE: acc holds the true accumulator divided by c_i, the largest v scale of the last tile.
    c_i = tl.full([], 1.0, tl.float32)
    if IS_FP8:
        # The scales of tile i+1 are loaded during tile i, so the small strided scale loads never sit on
        # the critical path of a tile (a small gain: docs/benchmarks.md, "Kernel launch choices").
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
        k = tl.load(k_ptr + n[:, None] * stride_kn + kvh * stride_kh + d[None, :], mask=n_ok[:, None], other=0.0)
        if V_BLOCK:
            # Key-blocked, transposed V (FP8 caches, see KVCache): the tile is read as [HEAD_DIM, BLOCK_N] with the
            # keys contiguous, which is the k-major operand the p.V product wants, so it is copied as 16-byte
            # vectors and converted in place instead of being gathered byte by byte. The mask is rounded up to
            # 16 keys (a uniform mask per vector); the extra keys are in bounds (whole blocks are allocated), finite
            # (zero-initialised or written rows) and get p = 0 from the masked logits.
            n_v = n < tl.multiple_of(tl.cdiv(hi, 16) * 16, 16)
            v = tl.trans(tl.load(v_ptr + (n // V_BLOCK)[None, :] * stride_vb + kvh * stride_vh
                                 + d[:, None] * V_BLOCK + (n % V_BLOCK)[None, :], mask=n_v[None, :], other=0.0))
        else:
            v = tl.load(v_ptr + n[:, None] * stride_vn + kvh * stride_vh + d[None, :], mask=n_ok[:, None],
                        other=0.0)
        k = k.to(dot_ty)
        v = v.to(dot_ty)
        if OPAQUE_CVT:
            k = _opaque(k)
            v = _opaque(v)
        if DOT_IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if IS_FP8:
            s = s * (ks * qk_scale)[None, :]
        else:
            s = s * qk_scale
        if TREE:
            rel = tl.minimum(tl.maximum(n - start, 0), 63).to(tl.int64)
            in_tree = ((anc[:, None] >> rel[None, :]) & 1) != 0
            visible = n_ok[None, :] & ((n[None, :] < start) | (in_tree & (n[None, :] < start + T)))
        else:
            visible = n_ok[None, :] & (n[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_SCALE == V_SCALE_P:
            p = p * vs[None, :]
        elif V_SCALE == V_SCALE_ROWS:
            v = (v.to(tl.float32) * vs[:, None]).to(dot_ty)
        elif V_SCALE == V_SCALE_TILE:
            # p * vs / vmax lies in [0, 1] whatever the scales (fp16-safe); the tile's vmax moves into acc's
            # per-row factor, so V stays untouched between shared memory and the tensor cores.
            vmax = tl.max(vs, axis=0)
            c_new = tl.where(vmax > 0.0, vmax, c_i)           # an all-masked tile (vs = 0) keeps the old factor
            p = p * (vs * (1.0 / c_new))[None, :]
            alpha = alpha * (c_i / c_new)
            c_i = c_new
        if DOT_IEEE:
            acc = tl.dot(p.to(dot_ty), v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(dot_ty), v, acc * alpha[:, None])
        m_i = m_new

    # Empty chunks (or rows that see none of this chunk) leave l_i = 0: write o = 0 and a log-sum-exp the
    # combine step weights by exp2(_NEG_BIG - max) = 0.
    has = l_i > 0.0
    if V_SCALE == V_SCALE_TILE:
        o = acc * (c_i / tl.where(has, l_i, 1.0))[:, None]
    else:
        o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), _NEG_BIG)
    pdl_release(PDL)
    tl.store(o_part_ptr + pid_s * stride_ps + t[:, None] * stride_pt + head[:, None] * stride_ph + d[None, :],
             o, mask=row_ok[:, None])
    tl.store(lse_part_ptr + pid_s * stride_ls + t * stride_lt + head, lse, mask=row_ok)


@triton.jit
def _attn_combine_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, n_splits, n_heads,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    BLOCK_D: tl.constexpr, SPLITS_P2: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
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


# Launch policy of FP8 caches under 16-bit queries, kept apart from the model-dtype one so each is tuned alone
# (``tools/kernel_bench.py --fp8-sweep``). "decode": <= 16 packed rows, one mma.sync row block; "rows": more, in
# 32-row mma.sync blocks; "wide": 64-128-row blocks a caller asks for (wgmma, which needs the
# converted tiles in shared memory whatever is done). ``waves``: programs per SM the split count aims at (three
# 32-key, three-stage programs fit an SM's shared memory at hd 256; with 64-key tiles only one does). Any key may be
# overridden per call (``config=``), and so may ``OPAQUE_CVT`` and ``V_SCALE`` (see ``cached_attention_triton``).
FP8_LAUNCH: dict[str, dict[str, int]] = {
    # Decode: the best of the sweep (tools/kernel_bench.py --fp8-sweep): narrow programs, many of them: 2 warps on
    # 32-key tiles, 4 programs per SM. With one or two warps splitting a 16-row block the per-tile softmax and the
    # P exchange between warps shrink; one warp, and more than 4 programs per SM, were slower. Compiler-placed
    # conversion (OPAQUE_CVT 0: same time, less shared memory). Figures: docs/benchmarks.md, "Kernel launch choices".
    "decode": {"BLOCK_N": 32, "num_warps": 2, "num_stages": 3, "waves": 4, "OPAQUE_CVT": 0},
    # More than 16 packed rows (verify, and decode of several rows): 32-row mma.sync blocks, each re-reading the KV
    # tiles (from L2 after the first block), 64-key tiles on 4 warps. With the blocked V this beat one 64/128-row
    # wgmma block and 32-key tiles in every 32k case of the sweep (docs/benchmarks.md, "Kernel launch choices").
    "rows": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "waves": 2, "OPAQUE_CVT": 0},
    # Row blocks of 64-128 (only when a caller sets BLOCK_M; the former verify default): wgmma. 32-key tiles:
    # 64-key ones spill registers with 128 rows (ptxas: ~160 spill instructions per tile). Two programs per SM where
    # they fit (64-row blocks: 96 KB each at hd 256; 128-row ones fit once).
    "wide": {"BLOCK_N": 32, "num_warps": 8, "num_stages": 3, "waves": 2},
}
# Warps of an FP8 decode program when the whole grid fits one program per SM (see attention_launch_config).
FP8_SHORT_WARPS = 4
# Largest model-dtype K+V of one layer (bytes, over the rows the grid is sized for) run with 16-row blocks whatever
# T is (see attention_launch_config); the largest size measured to gain.
SHORT_KV_BYTES = 8 << 20
# Keys a caller may override (``config=``); ``n_splits`` given outright wins over the waves rule; ``maxnreg`` caps
# the registers per thread (absent: the compiler's choice), so more programs fit an SM's register file.
LAUNCH_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "waves", "n_splits", "maxnreg")


def fp8_smem_bytes(block_m: int, block_n: int, head_dim: int, num_stages: int, opaque: bool = True) -> int:
    """Shared memory of one FP8 program (16-bit products): ``num_stages - 1`` e4m3 K+V buffers, the fp16 K and V
    copies (OPAQUE_CVT only: the compiler-placed conversion converts from the e4m3 buffers in registers), the query
    tile. Matches the compiled size at hd 64-256 (sm_90, Triton 3.6) for OPAQUE_CVT."""
    copies = 2 * 2 * block_n if opaque else 0
    return (max(num_stages - 1, 1) * 2 * block_n + copies + 2 * block_m) * head_dim


def attention_launch_config(T: int, n_q_heads: int, n_kv_heads: int, head_dim: int, key_len_hint: int,
                            sm_count: int, kv_bytes: int, q_bytes: int = 2,
                            overrides: dict[str, int] | None = None,
                            smem_per_sm: int = 228 * 1024) -> dict[str, int]:
    """Pick tile sizes, warps, pipeline depth and the number of sequence splits.

    ``key_len_hint`` is the key count the grid is sized for: the real length for eager calls, the cache
    capacity when the start comes from a device tensor (the grid must not change with the position).
    Splits aim at ``waves`` programs per SM (one for large row blocks, two for small ones), but never below ~4
    key tiles per split, because every split costs a partial-output write and read of ``T * Hq * hd`` floats.
    ``kv_bytes`` (bytes per cached element) bounds the pipeline depth of model-dtype caches: each stage holds a
    K and a V tile in shared memory. FP8 caches (``kv_bytes`` 1) with 16-bit queries take their tiles, warps,
    stages and waves from ``FP8_LAUNCH``, the waves capped by how many programs fit ``smem_per_sm`` (bytes of
    shared memory per SM) unless ``overrides`` sets them. fp32 queries (``q_bytes`` 4, IEEE dots on the FMA
    units) keep row blocks small. ``overrides`` replaces any of ``LAUNCH_KEYS`` before the split count is
    derived.
    """
    overrides = dict(overrides or {})
    group = n_q_heads // n_kv_heads
    m = T * group
    # One 128-row block serves a whole verify (e.g. 16 rows x 6 heads) per KV read, which beat two 64-row blocks
    # (bf16; FP8 caches use 32-row blocks, below; docs/benchmarks.md, "Kernel launch choices").
    max_m = 128 if q_bytes <= 2 else 32
    # A short model-dtype cache (all of its KV rows fit L2 easily) is latency-bound, not bandwidth-bound: 16-row
    # blocks, the decode launch, give more programs with less work each and re-read the KV from L2
    # (docs/benchmarks.md, "Kernel launch choices").
    if kv_bytes >= 2 and q_bytes <= 2 and 2 * key_len_hint * n_kv_heads * head_dim * kv_bytes <= SHORT_KV_BYTES:
        max_m = 16
    if kv_bytes == 1 and q_bytes <= 2:
        max_m = 32                                        # FP8 caches: mma.sync row blocks (see FP8_LAUNCH)
    block_m = overrides.get("BLOCK_M", min(max(16, triton.next_power_of_2(m)), max_m))
    if kv_bytes == 1 and q_bytes <= 2:
        policy = "wide" if block_m > 32 else "rows" if m > 16 else "decode"
        cfg = {"BLOCK_M": block_m, **FP8_LAUNCH[policy]}
    else:
        # 128 rows of bf16 hd=256 fit shared memory only with 32-key tiles.
        block_n = 32 if block_m >= 128 and head_dim >= 256 and kv_bytes >= 2 else 64
        stage_bytes = 2 * block_n * head_dim * kv_bytes
        cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4 if block_m <= 16 else 8,
               "num_stages": max(1, min(3, (160 * 1024) // stage_bytes)),
               "waves": 2 if block_m <= 32 else 1}        # big-tile programs fill an SM on their own
    cfg.update({k: int(v) for k, v in overrides.items() if k in LAUNCH_KEYS and k != "n_splits"})
    if kv_bytes == 1 and q_bytes <= 2 and "waves" not in overrides:
        per_program = fp8_smem_bytes(cfg["BLOCK_M"], cfg["BLOCK_N"], head_dim, cfg["num_stages"],
                                     opaque=bool(overrides.get("OPAQUE_CVT", cfg.get("OPAQUE_CVT", 1))))
        per_sm = smem_per_sm // (per_program + 1024)
        cfg["waves"] = max(1, min(cfg["waves"], per_sm))
    m_blocks = triton.cdiv(m, cfg["BLOCK_M"])

    def splits(block_n: int) -> int:
        if "n_splits" in overrides:
            return int(overrides["n_splits"])
        return split_count(cfg["waves"], sm_count, m_blocks * n_kv_heads, key_len_hint, block_n)

    n_splits = splits(cfg["BLOCK_N"])
    if kv_bytes == 1 and q_bytes <= 2 and cfg["BLOCK_M"] <= 32:
        # A key range too short to give every SM a program (the split count is capped by ~4 tiles per split).
        # Under half the SMs busy with 64-key tiles: halve the tiles, which doubles the splits; still at most one
        # program per SM: more warps per program (docs/benchmarks.md, "Kernel launch choices").
        if (cfg["BLOCK_N"] > 32 and "BLOCK_N" not in overrides
                and m_blocks * n_kv_heads * n_splits <= sm_count // 2):
            cfg["BLOCK_N"] = 32
            n_splits = splits(32)
        if "num_warps" not in overrides and m_blocks * n_kv_heads * n_splits <= sm_count:
            cfg["num_warps"] = FP8_SHORT_WARPS
    cfg.update(n_splits=n_splits, m_blocks=m_blocks)
    return cfg


def _interpreting() -> bool:
    """True under Triton's CPU interpreter (``TRITON_INTERPRET=1``, as Triton's own knob reads it)."""
    return bool(triton.knobs.runtime.interpret)


@functools.cache
def _smem_per_sm(device: torch.device) -> int:
    """Shared memory per SM of ``device`` (228 KB, an H100/H200's, off CUDA or where torch does not say)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "shared_memory_per_multiprocessor", 228 * 1024))
    return 228 * 1024


# The Gluon decode program runs by default from this many keys (the grid's key-length hint) on: below it the Triton
# program's short-cache launches win; from here on the two are level or the Gluon program leads
# (docs/benchmarks.md, "Kernel launch choices").
GLUON_MIN_KEYS = 8192
# Config keys that tune the Triton program only: a config with one of them runs it unless it sets GLUON.
TRITON_ONLY_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "OPAQUE_CVT", "V_SCALE", "FP16_DOT", "maxnreg"})


def use_gluon_decode(config: dict, supported: bool, key_len_hint: int, options: KernelOptions | None = None) -> bool:
    """Whether a call runs the Gluon decode program: ``config["GLUON"]`` when given (1 where it is not
    ``supported`` is the caller's error), else where it is supported, the grid is sized for at least
    ``GLUON_MIN_KEYS`` keys, the config tunes nothing of the Triton program's and the ``gluon`` kernel option is on
    (``EDGESPEC_GLUON=0``: the switch back to the Triton program everywhere, e.g. for a Triton build whose Gluon
    misbehaves; ``options``: those in force unless given)."""
    if "GLUON" in config:
        return bool(config["GLUON"])
    return (supported and key_len_hint >= GLUON_MIN_KEYS and not (TRITON_ONLY_KEYS & set(config))
            and (options or active()).gluon)


def cached_attention_triton(q: torch.Tensor, cache: KVCache, start: int, scale: float,
                            start_t: torch.Tensor | None = None,
                            config: dict[str, int | str] | None = None,
                            tree_bits: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of ``q [T, Hq, hd]`` (positions ``start .. start+T-1``) over cache rows
    ``0 .. start+T-1``. Returns ``[T, Hq, hd]`` in q's dtype.

    ``start_t``: optional int32/int64 one-element CUDA tensor holding the start; when given it overrides
    ``start`` inside the kernel and the launch no longer depends on the position (CUDA-graph safe).
    ``config``: optional override of :func:`attention_launch_config`'s choice (benchmarks sweep it; any of
    ``LAUNCH_KEYS``), plus for FP8 caches ``FP16_DOT`` (0: bf16 products for bf16 queries), ``V_SCALE`` ("p",
    "rows", "tile") and ``OPAQUE_CVT`` (0: let the compiler place the e4m3 conversion). ``GLUON`` (1 / 0) picks
    the Gluon decode program (:mod:`edgespec.kernels.attention.gluon_attention_fp8`) for one query row over an FP8
    cache, whose own keys are ``GLUON_KEYS`` (``num_warps``, ``BLOCK_W``, ``num_stages``, ``BALANCE``, ``waves``,
    ``n_splits``; default: see :func:`use_gluon_decode`).
    ``tree_bits``: ``[T]`` int64 ancestor masks of a tree verify (:class:`edgespec.kernels.verify.tree.TreeMask`): row t
    then sees the prefix ``0 .. start-1`` and the new rows whose bit is set, instead of the causal rows.
    """
    q, group = _checked_query(q, cache)
    T, n_q, hd = q.shape
    n_kv = cache.k.shape[1]
    hint = cache.max_len if start_t is not None else start + T
    config = config or {}
    gluon_ok = (gluon_attention_fp8 is not None and q.is_cuda and not _interpreting()
                and gluon_attention_fp8.gluon_decode_supported(T, n_q, n_kv, hd, cache.fp8, cache.v_block, q.dtype))
    if tree_bits is None and use_gluon_decode(config, gluon_ok, hint):
        if not gluon_ok:
            raise ValueError("GLUON decode needs Triton's Gluon and one CUDA query row of 16 bits over an FP8 cache "
                             "with 32-key V blocks and at most 8 query heads per KV head")
        return _gluon_decode(q, cache, start, scale, start_t, config, hint)
    cfg = attention_launch_config(T, n_q, n_kv, hd, hint, sm_count(q.device), cache.k.element_size(),
                                  q.element_size(), overrides=config, smem_per_sm=_smem_per_sm(q.device))
    n_splits = cfg["n_splits"]

    o_part, lse_part, out = _split_buffers(q, n_splits)
    k, v = cache.k, cache.v
    ks = cache.k_scale if cache.fp8 else k
    vs = cache.v_scale if cache.fp8 else v
    if cache.fp8:
        assert cache.k_scale.stride() == cache.v_scale.stride()
    s_strides = (ks.stride(0), ks.stride(1)) if cache.fp8 else (0, 0)
    fp16_dot, v_scale, opaque = _fp8_products(q, cache, config, cfg)
    pdl = pdl_launch(q.device)
    _attn_split_kernel[(cfg["m_blocks"], n_splits, n_kv)](
        q, k, v, ks, vs, start_t if start_t is not None else q, o_part, lse_part,
        tree_bits if tree_bits is not None else q,
        int(start), T, n_splits, float(scale) * _LOG2E,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), *cache.v_strides(),
        *s_strides,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        GROUP=group, HEAD_DIM=hd, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        IS_FP8=cache.fp8, START_FROM_PTR=start_t is not None, DOT_IEEE=q.dtype == torch.float32,
        V_SCALE=v_scale, FP16_DOT=fp16_dot, OPAQUE_CVT=opaque, PDL=bool(pdl), V_BLOCK=cache.v_block,
        TREE=tree_bits is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl,
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )
    merge_splits(o_part, lse_part, out, pdl)
    return out


def _fp8_products(q: torch.Tensor, cache: KVCache, config: dict[str, int | str],
                  cfg: dict[str, int | str]) -> tuple[bool, int, bool]:
    """How the attention program multiplies over the cache: (``FP16_DOT``, ``V_SCALE`` mode value, ``OPAQUE_CVT``).
    Model-dtype caches: (False, none, False)."""
    # bf16 queries over an FP8 cache: fp16 products, faster than bf16 ones (docs/benchmarks.md, "Kernel launch
    # choices").
    fp16_dot = cache.fp8 and q.dtype == torch.bfloat16 and config.get("FP16_DOT", 1) == 1
    if not cache.fp8:
        return fp16_dot, V_SCALE_NONE.value, False
    # fp16 products have too little exponent range for p * v_scale (both small): fold the scales in relative to
    # each tile's largest ("tile"), or scale every V element ("rows", the older, slower form).
    fp16_products = fp16_dot or q.dtype == torch.float16
    mode = config.get("V_SCALE", "tile" if fp16_products else "p")
    if mode not in _V_SCALE_MODES or (mode == "p" and fp16_products):
        raise ValueError(f"V_SCALE {mode!r} not valid with {'fp16' if fp16_products else q.dtype} products")
    # 16-bit products only (the identity moves packed pairs); the interpreter runs no inline PTX, and the identity
    # changes no value, so it is simply left out there.
    opaque = (q.element_size() == 2 and bool(config.get("OPAQUE_CVT", cfg.get("OPAQUE_CVT", 1)))
              and not _interpreting())
    return fp16_dot, _V_SCALE_MODES[mode], opaque


def _checked_query(q: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, int]:
    """``q`` with unit stride in its last dimension, and its query heads per KV head; raises on a head size or
    grouping the kernel cannot take."""
    n_q, hd = q.shape[1:]
    n_kv = cache.k.shape[1]
    if hd not in (64, 128, 256):
        raise ValueError(f"head_dim {hd} not supported by the Triton attention (64/128/256)")
    if n_q % n_kv:
        raise ValueError(f"{n_q} query heads do not group over {n_kv} KV heads")
    return (q if q.stride(-1) == 1 else q.contiguous()), n_q // n_kv


def _split_buffers(q: torch.Tensor, n_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The partial outputs ``[n_splits, T, Hq, hd]`` and log2-sum-exps ``[n_splits, T, Hq]`` (float32) a split
    launch writes for ``q [T, Hq, hd]``, and the merged output (q's dtype)."""
    T, n_q, hd = q.shape
    return (torch.empty((n_splits, T, n_q, hd), dtype=torch.float32, device=q.device),
            torch.empty((n_splits, T, n_q), dtype=torch.float32, device=q.device),
            torch.empty((T, n_q, hd), dtype=q.dtype, device=q.device))


def _gluon_decode(q: torch.Tensor, cache: KVCache, start: int, scale: float, start_t: torch.Tensor | None,
                  config: dict, key_len_hint: int) -> torch.Tensor:
    """FP8 decode (one query row) by the Gluon split program (:mod:`edgespec.kernels.attention.gluon_attention_fp8`),
    then the same merge launch as the Triton program's."""
    cfg = gluon_attention_fp8.gluon_decode_config(cache.k.shape[1], q.shape[-1], key_len_hint, sm_count(q.device),
                                                  _smem_per_sm(q.device), overrides=config)
    o_part, lse_part, out = _split_buffers(q, cfg["n_splits"])
    pdl = pdl_launch(q.device)
    gluon_attention_fp8.gluon_decode_split(q, cache, start, start_t, float(scale) * _LOG2E, o_part, lse_part, cfg,
                                           pdl)
    merge_splits(o_part, lse_part, out, pdl)
    return out


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, pdl: dict,
                 block_d: int | None = None) -> None:
    """Second launch of a split attention: merge the normalised partials ``o_part [splits, T, Hq, hd]`` (float32)
    by their log2-sum-exps ``lse_part [splits, T, Hq]`` into ``out [T, Hq, hd]``. ``pdl``: the launch options of
    :func:`~edgespec.kernels.launch.triton_pdl.pdl_launch` (empty: an ordinary launch). ``block_d``: columns per program
    (benchmarks sweep it; default: the measured best)."""
    splits, T, n_q, hd = o_part.shape
    splits_p2 = max(2, triton.next_power_of_2(splits))
    if block_d is None:
        # 32 columns per program at every split count: more programs than a per-tile float budget gave at 16-32
        # splits, and no loss at more (docs/benchmarks.md, "Kernel launch choices").
        block_d = min(hd, 32)
    _attn_combine_kernel[(T * n_q, hd // block_d)](
        o_part, lse_part, out, splits, n_q,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_D=block_d, SPLITS_P2=splits_p2, PDL=bool(pdl), num_warps=4, **pdl,
    )
