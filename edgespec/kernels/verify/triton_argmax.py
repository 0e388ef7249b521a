"""The greedy verdict in two Triton launches: chunked row argmax, then one program that combines and judges.

Contract: :func:`edgespec.kernels.verify.argmax.greedy_verdict_ref` (torch's argmax, bit for bit).

Stage 1, grid ``(R, n_chunks)``: a program reduces one ``BLOCK_V``-wide chunk of one row to its largest value and
the index of that value's first occurrence, written to two ``int32 [R, n_chunks]`` partial buffers. Stage 2, one
program: per row, the largest partial wins and among equal partials the lowest index (chunks lie in index order,
so that is the lowest chunk); the targets go to ``out[1:]``, then ``out[0]`` gets the first i with
``tokens[i + 1] != targets[i]`` (R - 1 when there is none). Rows are handled as vectors of up to 64 (padded to a
power of two); more rows loop.

Why two launches: a [16, 248k] logits tensor is 8-16 MB and needs the whole GPU to read at bandwidth, which a
one-program-per-row grid (16 programs) cannot do; the cross-row prefix count then needs every row's result, and
a grid-wide barrier or atomics-and-last-program scheme would cost more than a second tiny launch inside a graph.

Comparison keys: each value is widened to fp32 (exact for bf16/fp16, so no new ties) and mapped to an int32 whose
signed order is the float order: ``bits ^ ((bits >> 31) & 0x7fffffff)``, with ``-0.0`` first turned into ``+0.0``
(torch counts them as equal) and every NaN into ``INT32_MAX`` (torch's argmax takes NaN as the maximum). Integer
keys make ties exact and NaN-proof under ``tl.max(..., return_indices=True)`` with its left tie-break (lowest
index), which stage 1 requests explicitly. The partial "value" buffer holds these keys, not floats.

Chunk width (:func:`block_v`): the largest power of two in [512, 8192] that still gives ``R * n_chunks >= 2 *
SMs``, else 512 (small inputs are latency-bound whatever the width). For V = 248,320 on 132 SMs: R = 1 gets
512 (485 programs), R = 2 gets 1024 (486), R = 16 gets 8192 (16 x 31 = 496), R = 17 8192 (527). Narrow chunks
for small R keep every SM busy; wide ones for large R keep the partials (and stage 2) small. The vocabulary size
and row stride are ordinary runtime arguments (never constexpr), so one compiled variant per chunk width serves
every vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels import sm_count
from edgespec.kernels.launch.triton_pdl import pdl_enter, pdl_launch

_MIN_BLOCK_V, _MAX_BLOCK_V = 512, 8192
_MAX_ROWS = 64        # stage 2 row vector width
_STAGE2_TILE = 4096   # partials per stage-2 tile (rows x chunks)
# Key of padding lanes: below every real key (the smallest, -inf's, is INT32_MIN + 0x7fffff), and a literal that
# stays int32 in Triton (INT32_MIN itself does not).
_PAD_KEY = tl.constexpr(-2147483647)
_NAN_KEY = tl.constexpr(2147483647)


@triton.jit
def _order_key(x):
    """int32 keys of fp32 ``x`` whose signed order is the float order; -0.0 as +0.0, NaN above +inf."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)      # negative floats: flip magnitude bits so larger |x| sorts lower
    return tl.where(x != x, _NAN_KEY, key)


@triton.jit
def _chunk_argmax_kernel(logits_ptr, key_ptr, idx_ptr, V, stride_row, n_chunks,
                         BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=valid, other=0.0)
    key = tl.where(valid, _order_key(x.to(tl.float32)), _PAD_KEY)
    best, arg = tl.max(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(key_ptr + row * n_chunks + chunk, best)
    tl.store(idx_ptr + row * n_chunks + chunk, chunk * BLOCK_V + arg)


@triton.jit
def _larger_then_lower(k1, i1, k2, i2):
    """Combine of (key, index) pairs: the larger key, the lower index among equal keys."""
    first = (k1 > k2) | ((k1 == k2) & (i1 < i2))
    return tl.where(first, k1, k2), tl.where(first, i1, i2)


@triton.jit
def _combine_verdict_kernel(key_ptr, idx_ptr, tok_ptr, out_ptr, R, n_chunks, stride_tok, stride_out,
                            ROWS: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # n = first mismatching row, R - 1 when every draft matches; a tensor from the start so the loop carries it.
    n = tl.full([], 0, tl.int32) + (R - 1)
    for r0 in range(0, R, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        in_rows = rows < R
        best_key = tl.full([ROWS], _PAD_KEY, tl.int32)
        best_idx = tl.zeros([ROWS], tl.int32)
        for c0 in range(0, n_chunks, CHUNKS):
            cols = c0 + tl.arange(0, CHUNKS)
            m = in_rows[:, None] & (cols < n_chunks)[None, :]
            p = rows[:, None] * n_chunks + cols[None, :]
            k = tl.load(key_ptr + p, mask=m, other=_PAD_KEY)
            i = tl.load(idx_ptr + p, mask=m, other=_NAN_KEY)
            bk, bi = tl.reduce((k, i), 1, _larger_then_lower)
            # Later tiles hold higher indices: they win only with a strictly larger key.
            take = bk > best_key
            best_key = tl.where(take, bk, best_key)
            best_idx = tl.where(take, bi, best_idx)
        targets = best_idx.to(tl.int64)
        tl.store(out_ptr + (rows + 1) * stride_out, targets, mask=in_rows)
        judged = rows < R - 1                       # row i is judged against draft tokens[i + 1]
        tok = tl.load(tok_ptr + (rows + 1) * stride_tok, mask=judged, other=0).to(tl.int64)
        first_miss = tl.min(tl.where(judged & (tok != targets), rows, R - 1), axis=0)
        n = tl.minimum(n, first_miss)
    tl.store(out_ptr, n.to(tl.int64))


def block_v(rows: int, vocab: int, sms: int) -> int:
    """Stage-1 chunk width: the largest power of two in [512, 8192] with ``rows * n_chunks >= 2 * sms``, else
    512 (see the module docstring)."""
    width = _MAX_BLOCK_V
    while width > _MIN_BLOCK_V and rows * triton.cdiv(vocab, width) < 2 * sms:
        width //= 2
    return width


def greedy_verdict_triton(logits: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``[n, argmax of each row]`` into ``out`` (int64 ``[R + 1]``) and return it. Arguments are as
    validated by :func:`edgespec.kernels.verify.argmax.greedy_verdict`: logits ``[R, V]`` bf16/fp16/fp32, tokens
    int32/int64 ``[R]``, all on one CUDA device (or CPU under ``TRITON_INTERPRET=1``).

    Allocates two ``int32 [R, n_chunks]`` partial buffers (from the graph pool under capture).
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()    # rows may have any stride, elements must be adjacent
    R, V = logits.shape
    width = block_v(R, V, sm_count(logits.device))
    n_chunks = triton.cdiv(V, width)
    keys = torch.empty((R, n_chunks), dtype=torch.int32, device=logits.device)
    idxs = torch.empty((R, n_chunks), dtype=torch.int32, device=logits.device)
    pdl = pdl_launch(logits.device)
    _chunk_argmax_kernel[(R, n_chunks)](
        logits, keys, idxs, V, logits.stride(0), n_chunks,
        BLOCK_V=width, PDL=bool(pdl), num_warps=max(2, min(8, width // 256)), **pdl,
    )
    rows = min(_MAX_ROWS, triton.next_power_of_2(R))
    chunks = max(1, min(triton.next_power_of_2(n_chunks), _STAGE2_TILE // rows))
    _combine_verdict_kernel[(1,)](
        keys, idxs, tokens, out, R, n_chunks, tokens.stride(0), out.stride(0),
        ROWS=rows, CHUNKS=chunks, PDL=bool(pdl), num_warps=4, **pdl,
    )
    return out
