"""FP8-KV decode attention (one query row per head, T = 1) written in Gluon, Triton's explicit-layout dialect.

Contract: the split half of :func:`edgespec.kernels.attention.triton_attention.cached_attention_triton` for an FP8 cache
with key-blocked V (``v_block`` 32) and 16-bit queries: it writes the same normalised partials and log2-sum-exps,
and the same merge launch combines them.

Why a second form of the decode program. Profiled (docs/notes/attention-experiments.md), the Triton program is issue-
and latency-bound: 873 warp-instructions per 32-key tile on 2 warps, a fifth of them register moves that rebuild the
query operand from shared memory on every tile, and 8 barriers per tile for the softmax shared by both warps. Triton
picks those operand layouts itself (all ``tl.dot`` sizes >= 16, 8-bit operand layout for the query). Here they are
written out:

- Both products are transposed, so the query heads of one KV head are the mma's N = 8 (6 used for Qwen3.5-27B):
  ``S^T [keys, 8] = K [keys, hd] . Q^T [hd, 8]`` and ``O^T [hd, 8] += V^T [hd, keys] . P^T [keys, 8]``. Half the
  tensor-core work of the 16-row form, and the query operand (``Q^T``, 32 registers at hd 256) stays in
  registers for the whole loop in the layout the mma takes.
- Every warp owns its own keys (``BLOCK_W`` of each ``num_warps * BLOCK_W``-key tile) and its own online softmax
  (a leading "warp" dimension in every tensor), so the loop has no exchange between warps; the warps of a
  program are merged once, after the loop.
- The e4m3 tiles go from shared memory into the operand layout as bytes (``k_width`` 4) and are converted in
  registers, one instruction per pair, as in the Triton program.
- The logits product runs as four independent tensor-core chains over 64-dim chunks of the head (one chain of 16
  dependent mma per tile otherwise), each chunk in its own shared-memory buffer.
- The k and v scales travel with their tile through the cp.async ring. Loaded into registers one tile ahead (the
  Triton program's way), they came back later than the tile itself: at full bandwidth a load waits behind the
  ~17 MB of copies in flight, and a profile put 37% of the loop's stall samples on the first use of the k scale.
- The query is loaded before the ring's first copies are issued (a barrier keeps the compiler from sinking it), so
  it does not queue behind them; it is converted after them.

Default launch (``GLUON_DECODE``): one warp per program on 32-key tiles, four programs per SM, one wave; from 8192
keys it runs level with or ahead of the Triton program. What it still spends above a plain streaming read of the same
bytes is the start (every program asks for its first tile at once) and uneven finishes (``lab/attn_trace.py``);
evening them out (tiles claimed from a counter, a ramped ring start, the merge inside this launch behind a per-KV-head
barrier) is slower. The 32-key blocks are dealt out evenly (``BALANCE``: no split left empty, every SM four busy
programs). Figures: docs/benchmarks.md, "Kernel launch choices"; the experiments: docs/notes/attention-experiments.md.

The scales follow the Triton program's "tile" rule (``V_SCALE_TILE``): the k scale multiplies the logits, and each
warp folds ``v_scale / vmax`` (its tile's largest v scale) into the probabilities and carries ``vmax`` in its
accumulator's factor, so fp16 products never see a value above 1.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from edgespec.cache.kv import V_BLOCK
from edgespec.kernels import split_count

_NEG_BIG = gl.constexpr(-1.0e30)
# Stamps of a ``TRACE`` build, per program: start (after the PDL wait), first tile in shared memory, loop done,
# partials stored; then the SM it ran on.
TRACE_POINTS = ("start", "first tile", "loop done", "stored")
N_HEADS = gl.constexpr(8)          # the mma's N: query heads per KV head, padded
_V_BLOCK = gl.constexpr(V_BLOCK)   # keys per block of the transposed V: the only layout this program reads


@gluon.jit
def _stamp(trace_ptr, point: gl.constexpr):
    """Diagnostic builds (``TRACE``): this program's global-timer reading (ns) at ``point`` of ``TRACE_POINTS``."""
    t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    base = (gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)) * 5
    gl.store(trace_ptr + base + point, t)
    if point == 0:                                            # and the SM it runs on
        sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.store(trace_ptr + base + 4, sm.to(gl.int64))


@gluon.jit
def _q_chunk(q_ptr, kvh, stride_qh, d0, GROUP: gl.constexpr, KC: gl.constexpr, W: gl.constexpr,
             NH: gl.constexpr, layout: gl.constexpr):
    """Q^T [W (the same for every warp), KC, NH] of head dims ``d0 .. d0+KC-1``, as loaded (see ``_fp16_operand``)."""
    qd = gl.arange(0, KC, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    qn = gl.arange(0, NH, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    qw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    off = (gl.expand_dims(gl.expand_dims(qn, 0), 1) + kvh * GROUP) * stride_qh \
        + gl.expand_dims(gl.expand_dims(qd + d0, 0), 2) + gl.expand_dims(gl.expand_dims(qw * 0, 1), 2)
    ok = gl.expand_dims(gl.expand_dims(qn < GROUP, 0), 1) & gl.expand_dims(gl.expand_dims(qw >= 0, 1), 2)
    return gl.load(q_ptr + off, mask=ok, other=0.0)


@gluon.jit
def _fp16_operand(q):
    """A query chunk as the fp16 operand: clamped to fp16's range (far beyond normed query values)."""
    return gl.minimum(gl.maximum(q.to(gl.float32), -65504.0), 65504.0).to(gl.float16)


@gluon.jit
def _issue_tile(k_fill, v_smem, s_fill, slot, k_ptr, v_ptr, s_base, n0, hi, live, kvh, stride_kn, stride_kh,
                stride_vb, stride_vh, stride_sn, k_key, k_col, v_key, v_dim, s_key):
    """cp.async of the tile at key ``n0`` (K in head-dim chunks, V^T, the k and v scales) into ring slot ``slot``,
    one copy per buffer (two copies into one buffer would make the compiler fence them apart with a barrier); keys
    past ``hi`` (K, scales) or past ``hi`` rounded up to 16 (V: whole 16-byte vectors; those rows exist and get
    p = 0) copy as zeros, and so does everything when ``live`` is false (a tile past the chunk's end)."""
    async_copy.async_copy_global_to_shared(
        k_fill.index(slot), k_ptr + (n0.to(gl.int64) + k_key) * stride_kn + kvh * stride_kh + k_col,
        mask=((n0 + k_key) < hi) & live)
    vk = n0 + v_key
    async_copy.async_copy_global_to_shared(
        v_smem.index(slot), v_ptr + (vk // _V_BLOCK).to(gl.int64) * stride_vb + kvh * stride_vh + v_dim * _V_BLOCK
        + vk % _V_BLOCK,
        mask=(vk < gl.cdiv(hi, 16) * 16) & live)
    # the tile's k and v scales (4-byte copies): they arrive with the tile, however long the memory queue is
    sk = n0 + s_key
    async_copy.async_copy_global_to_shared(s_fill.index(slot), s_base + sk.to(gl.int64) * stride_sn,
                                           mask=(sk < hi) & live)
    async_copy.commit_group()


@gluon.jit
def _attend_tile(k_smem, v_smem, s_smem, slot, key_ok, q0, q1, q2, q3, m_i, l_i, c_i, acc, s_zero, qk_scale,
                 NCH: gl.constexpr, a_op: gl.constexpr, b_op: gl.constexpr, s_rows: gl.constexpr,
                 stat: gl.constexpr):
    """One tile of the online softmax, every warp on its own keys: the tile in ring slot ``slot`` (its keys valid
    where ``key_ok``) folded into each warp's running max ``m_i``, sum ``l_i``, v-scale factor ``c_i`` and
    accumulator ``acc`` (O^T)."""
    ks = s_smem.index(slot * 2).load(s_rows)
    vs = s_smem.index(slot * 2 + 1).load(s_rows)
    # S^T [W, BW, NH]: NCH independent tensor-core chains over head-dim chunks, summed
    s = mma_v2(k_smem.index(slot * NCH + 0).load(a_op).to(gl.float16), q0, s_zero)
    if NCH > 1:
        s = s + mma_v2(k_smem.index(slot * NCH + 1).load(a_op).to(gl.float16), q1, s_zero)
    if NCH > 2:
        s = s + mma_v2(k_smem.index(slot * NCH + 2).load(a_op).to(gl.float16), q2, s_zero)
    if NCH > 3:
        s = s + mma_v2(k_smem.index(slot * NCH + 3).load(a_op).to(gl.float16), q3, s_zero)
    s = s * gl.expand_dims(ks * qk_scale, 2)
    s = gl.where(gl.expand_dims(key_ok, 2), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    vmax = gl.max(vs, axis=1)                                               # [W]
    c_new = gl.where(vmax > 0.0, vmax, c_i)                   # a warp with no key in this tile keeps its factor
    p = p * gl.expand_dims(vs * gl.expand_dims(1.0 / c_new, 1), 2)
    alpha = alpha * gl.expand_dims(gl.convert_layout(c_i / c_new, gl.SliceLayout(1, stat)), 1)
    pT = gl.convert_layout(p.to(gl.float16), b_op)                          # P^T [W, BW, NH]
    v8 = v_smem.index(slot).load(a_op)                                      # V^T [W, HD, BW] e4m3
    acc = mma_v2(v8.to(gl.float16), pT, acc * gl.expand_dims(alpha, 1))
    return m_new, l_i, c_new, acc


# start and n_splits are not specialised (see the Triton program): one compiled kernel for every position.
@gluon.jit(do_not_specialize=["start", "n_splits"])
def _fp8_decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, start_ptr, o_part_ptr, lse_part_ptr, trace_ptr,
    start, n_splits, qk_scale,
    stride_qh, stride_kn, stride_kh, stride_vb, stride_vh, stride_sn, stride_sh,
    stride_ps, stride_ph, stride_ls,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_W: gl.constexpr, STAGES: gl.constexpr,
    W: gl.constexpr, START_FROM_PTR: gl.constexpr, PDL: gl.constexpr, TRACE: gl.constexpr, BALANCE: gl.constexpr,
):
    NH: gl.constexpr = N_HEADS
    gl.static_assert(_V_BLOCK == 32, "the V copies take 32-byte rows: one 32-key block")
    BN: gl.constexpr = W * BLOCK_W                                  # keys per program per iteration
    KC: gl.constexpr = 64                                           # head dims per chunk of the logits product
    NCH: gl.constexpr = HEAD_DIM // KC
    if PDL:
        gdc_wait()
    if TRACE:
        _stamp(trace_ptr, 0)
    pid_s = gl.program_id(0)
    kvh = gl.program_id(1)
    if START_FROM_PTR:
        start = gl.load(start_ptr).to(gl.int32)
    L = start + 1
    if BALANCE:
        # Every split gets the same number of 32-key V blocks, give or take one, so every program (and every SM)
        # has work: whole-tile chunks left the last splits empty (32768 keys over 132 splits: 128 splits of 8 tiles,
        # 4 empty) and 4 SMs with next to nothing. Whole blocks: a split starting mid-block would read half of each
        # 32-byte V row, and its neighbour the same sectors again (figures: docs/benchmarks.md, "Kernel launch
        # choices").
        units = gl.cdiv(L, _V_BLOCK)
        per = units // n_splits
        extra = units % n_splits
        lo = gl.multiple_of((pid_s * per + gl.minimum(pid_s, extra)) * _V_BLOCK, 32)
        hi = gl.minimum(lo + (per + (pid_s < extra).to(gl.int32)) * _V_BLOCK, L)
    else:
        chunk = gl.cdiv(gl.cdiv(L, n_splits), BN) * BN
        lo = pid_s * chunk
        hi = gl.minimum(lo + chunk, L)

    # ---- layouts: a leading dimension of W, one warp each ----
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
    # Copies move 16 bytes per thread. K: each warp copies its own keys, in 64-byte head-dim chunks (one smem
    # buffer per chunk, so the logits product runs NCH independent tensor-core chains instead of one). V^T rows are
    # 32 bytes (a 32-key block) in memory: neighbouring lanes copy the two halves, whichever warp reads them.
    k_cp: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 16], threads_per_warp=[1, 32 * 16 // KC, KC // 16],
                                          warps_per_cta=[W, 1, 1], order=[2, 1, 0])
    VC: gl.constexpr = BLOCK_W // 16
    VT: gl.constexpr = min(W, 2 // VC)
    v_cp: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 16], threads_per_warp=[VT, 32 // (VT * VC), VC],
                                          warps_per_cta=[W // VT, VT, 1], order=[2, 0, 1])
    k_sh: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=128 // KC, max_phase=KC // 16, order=[2, 1, 0])
    v_sh: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=128 // BLOCK_W, max_phase=VC, order=[2, 1, 0])
    # K ring: [stage * NCH + chunk, warp, key, dim] for the products; the copy writes one stage at once through the
    # same bytes seen as [stage, chunk * W + warp, key, dim].
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * NCH, W, BLOCK_W, KC], k_sh)
    k_fill = k_smem._reinterpret(gl.float8e4nv, [STAGES, NCH * W, BLOCK_W, KC], k_sh)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, W, HEAD_DIM, BLOCK_W], v_sh)
    # scale ring: [stage * 2 + (0: k, 1: v), warp, key] for the reads, [stage, kind * W + warp, key] for the copy
    sc_sh: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    s_smem = gl.allocate_shared_memory(gl.float32, [STAGES * 2, W, BLOCK_W], sc_sh)
    s_fill = s_smem._reinterpret(gl.float32, [STAGES, 2 * W, BLOCK_W], sc_sh)
    s_cp: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32 // BLOCK_W, BLOCK_W],
                                          warps_per_cta=[W, 1], order=[1, 0])
    sck = gl.arange(0, 2 * W, layout=gl.SliceLayout(1, s_cp))                   # kind * W + warp
    scr = gl.arange(0, BLOCK_W, layout=gl.SliceLayout(0, s_cp))
    s_cpkey = gl.expand_dims((sck % W) * BLOCK_W, 1) + gl.expand_dims(scr, 0)    # [2W, BW]
    s_base = gl.where(gl.expand_dims(sck < W, 1), ks_ptr, vs_ptr) + kvh * stride_sh

    # ---- copy addresses, relative to the tile's first key ----
    kcw = gl.arange(0, NCH * W, layout=gl.SliceLayout(1, gl.SliceLayout(2, k_cp)))        # chunk * W + warp
    kr = gl.arange(0, BLOCK_W, layout=gl.SliceLayout(0, gl.SliceLayout(2, k_cp)))
    kc = gl.arange(0, KC, layout=gl.SliceLayout(0, gl.SliceLayout(1, k_cp)))
    k_key = gl.expand_dims(gl.expand_dims((kcw % W) * BLOCK_W, 1) + gl.expand_dims(kr, 0), 2)  # [NCH*W,BW,1]
    k_col = gl.expand_dims(gl.expand_dims((kcw // W) * KC, 1), 2) + gl.expand_dims(gl.expand_dims(kc, 0), 1)
    vw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, v_cp)))
    vd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(2, v_cp)))
    vc = gl.arange(0, BLOCK_W, layout=gl.SliceLayout(0, gl.SliceLayout(1, v_cp)))
    v_key = gl.expand_dims(gl.expand_dims(vw * BLOCK_W, 1), 2) + gl.expand_dims(gl.expand_dims(vc, 0), 1)  # [W,1,BW]
    v_dim = gl.expand_dims(gl.expand_dims(vd, 0), 2)                                                        # [1,HD,1]

    # ---- the query, transposed, in NCH head-dim chunks: the B operand of the logits product. Its load goes
    # out first, so it is not queued behind the prologue's copies; it is converted after them. ----
    q0 = _q_chunk(q_ptr, kvh, stride_qh, 0, GROUP, KC, W, NH, b_op)
    q1 = _q_chunk(q_ptr, kvh, stride_qh, (1 * KC) % HEAD_DIM, GROUP, KC, W, NH, b_op)
    q2 = _q_chunk(q_ptr, kvh, stride_qh, (2 * KC) % HEAD_DIM, GROUP, KC, W, NH, b_op)
    q3 = _q_chunk(q_ptr, kvh, stride_qh, (3 * KC) % HEAD_DIM, GROUP, KC, W, NH, b_op)
    gl.thread_barrier()                                         # keeps the compiler from sinking the load below

    n_tiles = gl.cdiv(hi - lo, BN)
    for i in gl.static_range(STAGES - 1):                       # prologue: the first STAGES - 1 tiles
        _issue_tile(k_fill, v_smem, s_fill, i, k_ptr, v_ptr, s_base, lo + i * BN, hi, i < n_tiles, kvh, stride_kn,
                    stride_kh, stride_vb, stride_vh, stride_sn, k_key, k_col, v_key, v_dim, s_cpkey)

    q0 = _fp16_operand(q0)
    q1 = _fp16_operand(q1)
    q2 = _fp16_operand(q2)
    q3 = _fp16_operand(q3)

    # ---- scales: per key, in the rows of S^T ----
    s_rows: gl.constexpr = gl.SliceLayout(2, mma)                                # [W, BW]
    sw = gl.arange(0, W, layout=gl.SliceLayout(1, s_rows))
    sr = gl.arange(0, BLOCK_W, layout=gl.SliceLayout(0, s_rows))
    s_key = gl.expand_dims(sw * BLOCK_W, 1) + gl.expand_dims(sr, 0)              # [W, BW] key offset in the tile

    stat: gl.constexpr = gl.SliceLayout(1, mma)                                  # [W, NH]: per warp, per head
    m_i = gl.full([W, NH], _NEG_BIG, gl.float32, stat)
    l_i = gl.zeros([W, NH], gl.float32, stat)
    c_i = gl.full([W], 1.0, gl.float32, gl.SliceLayout(1, s_rows))
    acc = gl.zeros([W, HEAD_DIM, NH], gl.float32, mma)
    s_zero = gl.zeros([W, BLOCK_W, NH], gl.float32, mma)

    for it in range(n_tiles):
        n0 = lo + it * BN
        slot = it % STAGES
        async_copy.wait_group(STAGES - 2)                       # this tile has landed (this thread's copies) ...
        gl.thread_barrier()                                     # ... and every thread's; last tile's slot is free
        if TRACE:
            if it == 0:
                _stamp(trace_ptr, 1)
        nx = it + STAGES - 1
        _issue_tile(k_fill, v_smem, s_fill, nx % STAGES, k_ptr, v_ptr, s_base, lo + nx * BN, hi, nx < n_tiles, kvh,
                    stride_kn, stride_kh, stride_vb, stride_vh, stride_sn, k_key, k_col, v_key, v_dim, s_cpkey)

        m_i, l_i, c_i, acc = _attend_tile(k_smem, v_smem, s_smem, slot, (n0 + s_key) < hi, q0, q1, q2, q3, m_i, l_i,
                                          c_i, acc, s_zero, qk_scale, NCH, a_op, b_op, s_rows, stat)

    async_copy.wait_group(0)
    if TRACE:
        _stamp(trace_ptr, 2)
    # ---- merge the warps: one factor per (warp, head) scales each warp's accumulator into the normalised output ----
    m_all = gl.max(m_i, axis=0)                                                 # [NH]
    wgt = gl.exp2(m_i - gl.expand_dims(m_all, 0))                               # [W, NH]
    l_all = gl.sum(l_i * wgt, axis=0)
    has = l_all > 0.0                 # a chunk no key of which this program saw: o = 0, lse = -big (merge weight 0)
    inv_l = gl.where(has, 1.0 / gl.where(has, l_all, 1.0), 0.0)
    fac = wgt * gl.expand_dims(gl.convert_layout(c_i, gl.SliceLayout(1, stat)), 1) * gl.expand_dims(inv_l, 0)
    o = gl.sum(acc * gl.expand_dims(fac, 1), axis=0)                            # O^T [HD, NH]
    lse = gl.where(has, m_all + gl.log2(gl.where(has, l_all, 1.0)), _NEG_BIG)
    if PDL:
        gdc_launch_dependents()
    # stored through a layout with 4 consecutive head dims per thread: 16-byte stores along each head's row
    st: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 1], threads_per_warp=[32, 1], warps_per_cta=[W, 1],
                                        order=[0, 1])
    o = gl.convert_layout(o, st)
    od = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, st))
    on = gl.arange(0, NH, layout=gl.SliceLayout(0, st))
    gl.store(o_part_ptr + pid_s * stride_ps + gl.expand_dims(kvh * GROUP + on, 0) * stride_ph + gl.expand_dims(od, 1),
             o, mask=gl.expand_dims(on < GROUP, 0))
    h_l: gl.constexpr = gl.SliceLayout(0, stat)
    hn = gl.arange(0, NH, layout=h_l)
    gl.store(lse_part_ptr + pid_s * stride_ls + kvh * GROUP + hn, lse, mask=hn < GROUP)
    if TRACE:
        _stamp(trace_ptr, 3)


# Launch of the Gluon decode program (``config`` keys of cached_attention_triton): warps per program, keys per warp per
# iteration, copy stages; ``waves`` (programs per SM) follows from shared memory. One warp on 32 keys and 3 stages are
# the best of lab/attn_overhead_probe.py's sweep over warps, keys per warp and stages; ``BALANCE`` 1 deals the key range
# out in whole 32-key blocks (0: whole tiles per split, rounded up, which leaves the last splits empty). Figures:
# docs/benchmarks.md, "Kernel launch choices".
GLUON_DECODE: dict[str, int] = {"num_warps": 1, "BLOCK_W": 32, "num_stages": 3, "BALANCE": 1}
# The config keys this program takes: its launch's, and the programs per SM and split count the rule derives.
GLUON_KEYS = frozenset({*GLUON_DECODE, "waves", "n_splits"})


def gluon_decode_supported(T: int, n_q: int, n_kv: int, head_dim: int, fp8: bool, v_block: int,
                           q_dtype: torch.dtype) -> bool:
    """True where the Gluon decode program applies: one query row, an FP8 cache with key-blocked V (32 keys per
    block), 16-bit queries, at most 8 query heads per KV head and a head dim the copies tile (64-256)."""
    return (T == 1 and fp8 and v_block == V_BLOCK and q_dtype in (torch.bfloat16, torch.float16)
            and n_q % n_kv == 0 and n_q // n_kv <= N_HEADS.value and head_dim in (64, 128, 256))


def gluon_decode_config(n_kv: int, head_dim: int, key_len_hint: int, sm_count: int, smem_per_sm: int,
                        overrides: dict | None = None) -> dict[str, int]:
    """Warps, keys per warp, stages and split count: as many programs per SM as shared memory holds (at most 4
    per SM's worth of 2-warp programs, the register file's limit at ~190 registers), one wave of them."""
    cfg = {**GLUON_DECODE, **{k: int(v) for k, v in (overrides or {}).items() if k in GLUON_KEYS}}
    w, bw, stages = cfg["num_warps"], cfg["BLOCK_W"], cfg["num_stages"]
    smem = stages * w * 2 * bw * head_dim
    by_smem = smem_per_sm // (smem + 1024)
    by_regs = 65536 // (w * 32 * 192)
    waves = cfg.get("waves", max(1, min(by_smem, by_regs)))
    cfg["n_splits"] = int(cfg.get("n_splits", split_count(waves, sm_count, n_kv, key_len_hint, w * bw)))
    cfg["waves"] = waves
    return cfg


def gluon_decode_split(q: torch.Tensor, cache, start: int, start_t: torch.Tensor | None, qk_scale: float,
                       o_part: torch.Tensor, lse_part: torch.Tensor, cfg: dict, pdl: dict,
                       trace: torch.Tensor | None = None) -> None:
    """Launch the split program of one decode attention over ``cache`` (an FP8 ``KVCache``); ``o_part`` and
    ``lse_part`` as :func:`~edgespec.kernels.attention.triton_attention.cached_attention_triton` allocates them, with
    ``cfg["n_splits"]`` splits; ``qk_scale`` already in log2 units. ``trace``: an int64 ``[n_splits, n_kv, 5]``
    tensor that receives each program's global-timer stamps (see ``TRACE_POINTS``), for ``lab/attn_trace.py``."""
    _, n_q, hd = q.shape
    n_kv = cache.k.shape[1]
    _, stride_vh, stride_vb = cache.v_strides()
    _fp8_decode_kernel[(cfg["n_splits"], n_kv)](
        q, cache.k, cache.v, cache.k_scale, cache.v_scale, start_t if start_t is not None else q,
        o_part, lse_part, trace if trace is not None else lse_part, int(start), cfg["n_splits"], float(qk_scale),
        q.stride(1), cache.k.stride(0), cache.k.stride(1), stride_vb, stride_vh,
        cache.k_scale.stride(0), cache.k_scale.stride(1),
        o_part.stride(0), o_part.stride(2), lse_part.stride(0),
        GROUP=n_q // n_kv, HEAD_DIM=hd, BLOCK_W=cfg["BLOCK_W"], STAGES=cfg["num_stages"], W=cfg["num_warps"],
        START_FROM_PTR=start_t is not None, PDL=bool(pdl), TRACE=trace is not None, BALANCE=bool(cfg["BALANCE"]),
        num_warps=cfg["num_warps"],
        **pdl)
