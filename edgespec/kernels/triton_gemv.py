"""Few-row products ``y = x W^T`` in Triton for batch-1 decoding on a GPU: a GEMV for one row (decode) and a
skinny GEMM for 2-16 rows (verify, DFlash blocks).

A decode step is a chain of GEMVs whose cost should be the weight bytes over the memory bandwidth. cuBLAS picks
GEMM tiles for them (M padded to 8) and splits K with a separate reduction kernel on the narrow matrices; on an
H200 the Qwen3.5-4B decode's matrices stream at ~80% of copy bandwidth that way (tools/step_profile.py).

Here each program owns ``BLOCK_N`` output rows and walks the whole K extent in ``BLOCK_K`` slices: every weight
element is read once, coalesced along K, multiplied by the broadcast input slice and accumulated in fp32 per
row; no split-K, so no second kernel and no partial sums in memory. The input vector is tiny and stays in cache.
Verify rows go through :func:`skinny_gemm_triton`: the same weight streaming with the rows as one 16-row
tensor-core tile (cuBLAS's 16-row kernels ran ~10% slower than its own one-row ones on the Qwen3.5-4B shape).
Contract: :func:`edgespec.kernels.linear.linear_ref` (fp32 accumulation, output in x's dtype).

Prologues (:class:`Prologue`, a constexpr of both kernels): the input rows can be computed while they are loaded
from the output of the pointwise step before the product, which then costs no launch of its own (each is
~1.5-3 us on a decode step that is a chain of GEMVs). Each K slice of the input is formed from two operand slices
``x`` and ``gate`` of the same shape:

* ``SILU_MUL``: ``silu(gate) * x`` (SwiGLU; ``gate``/``x`` are the two halves of ``gate_up``);
* ``GATED_RMS_NORM``: ``w * rms_norm(x) * silu(gate)`` per head of ``HEAD`` elements (GDN output norm); the
  slices hold whole heads (``BLOCK_K`` is a multiple of the power-of-two head size), so a head's rms is a
  reduction inside the slice;
* ``SIGMOID_GATE``: ``x * sigmoid(gate)`` (gated attention output).

The prologue rounds where the torch references round (:func:`edgespec.kernels.activation.silu_mul_ref`,
:func:`edgespec.kernels.norm.gated_rms_norm_ref`, ``x * torch.sigmoid(gate)``: every torch op computes in fp32 and
rounds to the tensor's dtype), and on CUDA it computes with what torch's CUDA kernels use: libdevice's ``expf`` and
``rsqrtf`` (no flush-to-zero, as nvcc builds them), IEEE division, squares rounded before they are summed. The
input slice then holds the reference's bits, and the product is the plain kernel's on them: equal to
``linear(reference(...), W)`` run with the same launch config (tests/test_kernels_gpu.py reads the prologue's
values back through an identity weight). The per-head sum of squares is the one step whose order is the kernel's
own, so a norm input element can differ from torch's in its last bit. Each row's prologue reads only its own row:
a row's result does not depend on how many rows are in the batch, as for the plain skinny kernel.

Cost: the input is recomputed by every program (N / BLOCK_N of them), a few dozen instructions per element (on
sm_90 the 2 x 1024 GEMV loop grows from 76 to ~280 instructions with SwiGLU or the gate, ~370 with the norm), so
on long rows with 2 rows per program the prologue can outweigh the launch it saves: time it on the device.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from edgespec.kernels import sm_count
from edgespec.kernels.triton_pdl import pdl_enter, pdl_launch, pdl_release, pdl_wait


class Prologue(enum.IntEnum):
    """What the product's input rows are computed from while they are loaded (module docstring)."""

    NONE = 0
    SILU_MUL = 1
    GATED_RMS_NORM = 2
    SIGMOID_GATE = 3


@triton.jit
def _exp_f32(v, PRECISE: tl.constexpr):
    """``exp`` in fp32: libdevice's ``expf`` on CUDA (what torch's kernels call), else ``tl.exp`` (interpreter)."""
    if PRECISE:
        return libdevice.exp(v)
    else:
        return tl.exp(v)


@triton.jit
def _silu_f32(v, PRECISE: tl.constexpr):
    """torch's silu in fp32: ``v / (1 + exp(-v))`` with a correctly rounded division."""
    return tl.math.div_rn(v, 1.0 + _exp_f32(-v, PRECISE))


@triton.jit
def _gated_rms_norm_tile(x, g, nw_ptr, eps, HEAD: tl.constexpr, MID_TY: tl.constexpr, PRECISE: tl.constexpr):
    """:func:`edgespec.kernels.norm.gated_rms_norm_ref` over the heads of HEAD consecutive elements of a tile."""
    G: tl.constexpr = x.numel // HEAD
    xf = tl.reshape(x, (G, HEAD)).to(tl.float32)
    if PRECISE:
        sq = libdevice.mul_rn(xf, xf)          # torch materialises xf.pow(2): rounded squares, no fma
    else:
        sq = xf * xf
    var = tl.sum(sq, axis=1) * (1.0 / HEAD)    # HEAD is a power of two: exact, as torch's mean
    if PRECISE:
        rstd = libdevice.rsqrt(var + eps)
    else:
        rstd = tl.rsqrt(var + eps)
    xn = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(nw_ptr + tl.arange(0, HEAD)).to(tl.float32)
    y = (xn * w[None, :]).to(MID_TY).to(tl.float32)                   # weight * x̂ in promote(w, x)
    y = y * _silu_f32(tl.reshape(g, (G, HEAD)).to(tl.float32), PRECISE)   # * silu(gate.float()), fp32
    return tl.reshape(y.to(x.dtype), x.shape)


@triton.jit
def _prologue(x, g, nw_ptr, eps, PROLOGUE: tl.constexpr, HEAD: tl.constexpr, MID_TY: tl.constexpr,
              PRECISE: tl.constexpr):
    """The product's input slice (x's dtype, x's shape) from the operand slices ``x`` and ``g``."""
    if PROLOGUE == 1:        # silu(gate) rounded to the dtype, times up, rounded
        act = _silu_f32(g.to(tl.float32), PRECISE).to(x.dtype).to(tl.float32)
        return (act * x.to(tl.float32)).to(x.dtype)
    elif PROLOGUE == 2:
        return _gated_rms_norm_tile(x, g, nw_ptr, eps, HEAD, MID_TY, PRECISE)
    else:                    # x * sigmoid(gate), the sigmoid rounded to the dtype first
        one = tl.full(g.shape, 1.0, tl.float32)
        sig = tl.math.div_rn(one, 1.0 + _exp_f32(-g.to(tl.float32), PRECISE)).to(x.dtype).to(tl.float32)
        return (x.to(tl.float32) * sig).to(x.dtype)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, g_ptr, nw_ptr, N, K, stride_wn, eps,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 PROLOGUE: tl.constexpr, HEAD: tl.constexpr, MID_TY: tl.constexpr, PRECISE: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_wait(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for i in range(0, tl.cdiv(K, BLOCK_K)):
        k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + k)
            if PROLOGUE != 0:
                g = tl.load(g_ptr + k)
            w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = k < K
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
            if PROLOGUE != 0:
                g = tl.load(g_ptr + k, mask=k_ok, other=0.0)
            w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)
        if PROLOGUE != 0:
            x = _prologue(x, g, nw_ptr, eps, PROLOGUE, HEAD, MID_TY, PRECISE)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    pdl_release(PDL)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv_config(N: int, K: int, sm_count: int) -> dict[str, int]:
    """Launch shape from the H200 sweep (``tools/gemv_bench.py --sweep``, docs/measurements/gemv_bench_h200.txt):
    long rows (K >= 4096) go best as 2 rows per program over 1024-wide K slices; shorter rows as 8-16 rows per
    program over 256-wide slices, with deeper pipelining for the wide matrices."""
    if K >= 4096:
        return {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 4 if K >= 8192 else 2}
    block_k = min(256, triton.next_power_of_2(K))
    if N >= 12000:
        return {"BLOCK_N": 16, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 4}
    block_n = 8
    while block_n > 1 and triton.cdiv(N, block_n) < 2 * sm_count:    # small N: keep the chip covered
        block_n //= 2
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 2}


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: dict[str, int] | None = None, *, prologue: Prologue = Prologue.NONE,
                gate: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                eps: float = 0.0) -> torch.Tensor:
    """``x [1, K] @ weight[N, K]^T (+ bias)`` -> ``[1, N]`` in x's dtype. ``config`` overrides the launch.

    ``prologue``: the input row is that step of ``x`` and ``gate [1, K]`` (``norm_weight [HEAD]`` and ``eps`` for
    the norm) instead of ``x`` itself (module docstring)."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [1, K] and [N, K]")
    if weight.stride(1) != 1:
        raise ValueError("gemv: weight rows must be contiguous")
    N, K = weight.shape
    x = x.contiguous()
    pro = _prologue_operands(x, prologue, gate, norm_weight, eps)
    cfg = _launch_config(gemv_config(N, K, sm_count(x.device)), config, pro)
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    pdl = pdl_launch(x.device)
    _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else x, y, pro.gate, pro.norm_weight, N, K,
        weight.stride(0), pro.eps,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], HAS_BIAS=bias is not None,
        EVEN_K=K % cfg["BLOCK_K"] == 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pro.constexprs, PDL=bool(pdl), **pdl,
    )
    return y


# ---- prologue operands --------------------------------------------------------------------------------------------

# Largest norm head a prologue takes: the skinny kernel's K slice grows to one head (4-stage tiles in shared memory).
NORM_HEAD_MAX = 256

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class _PrologueOperands:
    """What a launch passes for its prologue: the gate rows, the norm weight, eps and the constexprs."""

    def __init__(self, x: torch.Tensor, prologue: Prologue, gate: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float, head: int, mid: torch.dtype) -> None:
        self.gate, self.norm_weight, self.eps, self.head = gate, norm_weight, float(eps), head
        # libdevice (torch's math) on CUDA; the interpreter's CPU tensors take tl's numpy math. No flush-to-zero in
        # libdevice, as torch's kernels are built (the option is the CUDA backend's only: set it with a prologue).
        precise = prologue != Prologue.NONE and x.is_cuda and torch.version.hip is None
        self.constexprs = {"PROLOGUE": int(prologue), "HEAD": head, "MID_TY": _TL_DTYPE[mid], "PRECISE": precise}
        if precise:
            self.constexprs["enable_reflect_ftz"] = False


def _prologue_operands(x: torch.Tensor, prologue: Prologue, gate: torch.Tensor | None,
                       norm_weight: torch.Tensor | None, eps: float) -> _PrologueOperands:
    """Checks the prologue's operands against the input rows ``x [M, K]`` (before any launch)."""
    prologue = Prologue(prologue)
    if prologue == Prologue.NONE:
        if gate is not None or norm_weight is not None:
            raise ValueError("gate / norm_weight given without a prologue")
        return _PrologueOperands(x, prologue, x, x, 0.0, 1, torch.float32)
    if gate is None or gate.shape != x.shape or gate.dtype != x.dtype or gate.device != x.device:
        raise ValueError(f"{prologue.name} prologue: gate {None if gate is None else tuple(gate.shape)} must match "
                         f"x {tuple(x.shape)} {x.dtype}")
    if x.dtype not in _TL_DTYPE:
        raise ValueError(f"{prologue.name} prologue: unsupported dtype {x.dtype}")
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    if prologue != Prologue.GATED_RMS_NORM:
        if norm_weight is not None:
            raise ValueError(f"{prologue.name} prologue takes no norm_weight")
        return _PrologueOperands(x, prologue, gate, x, 0.0, 1, x.dtype)
    if norm_weight is None or norm_weight.dim() != 1 or norm_weight.device != x.device:
        raise ValueError("GATED_RMS_NORM prologue: needs a 1-d norm_weight [HEAD] on x's device")
    head = norm_weight.shape[0]
    if head < 1 or head & (head - 1) or head > NORM_HEAD_MAX or x.shape[-1] % head:
        raise ValueError(f"GATED_RMS_NORM prologue: head size {head} must be a power of two <= {NORM_HEAD_MAX} "
                         f"dividing K = {x.shape[-1]}")
    mid = torch.promote_types(norm_weight.dtype, x.dtype)
    if not norm_weight.is_floating_point() or mid not in _TL_DTYPE:
        raise ValueError(f"GATED_RMS_NORM prologue: unsupported norm weight dtype {norm_weight.dtype}")
    return _PrologueOperands(x, prologue, gate, norm_weight.contiguous(), eps, head, mid)


def _launch_config(default: dict[str, int], config: dict[str, int] | None,
                   pro: _PrologueOperands) -> dict[str, int]:
    """The launch of a GEMV or skinny product: the shape's default, the caller's overrides, whole norm heads."""
    cfg = {**default, **(config or {})}
    _fit_heads(cfg, config, pro)
    return cfg


def _fit_heads(cfg: dict[str, int], config: dict[str, int] | None, pro: _PrologueOperands) -> None:
    """K slices must hold whole norm heads: a default slice narrower than a head grows to one head."""
    if pro.head > cfg["BLOCK_K"] and not (config and "BLOCK_K" in config):
        cfg["BLOCK_K"] = pro.head
    if cfg["BLOCK_K"] % pro.head:
        raise ValueError(f"BLOCK_K {cfg['BLOCK_K']} does not hold whole norm heads of {pro.head}")


# ---- a few rows (verify, DFlash blocks): tensor-core tiles over a 16-row block -----------------------------------

SKINNY_MAX_ROWS = 16


def skinny_pays(N: int, sm_count: int) -> bool:
    """Whether the skinny GEMM beats cuBLAS for this output width: when it runs unsplit (at least one 64-row
    block per SM). On narrow matrices its K split lost to cuBLAS's on the H200 (tools/gemv_bench.py --rows 16:
    5120x6144 at 71% vs 82% of copy bandwidth), on wide ones it won (248320x5120 102% vs 95%, 14336x5120 93% vs
    87%)."""
    return triton.cdiv(N, 64) >= sm_count


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, part_ptr, b_ptr, y_ptr, g_ptr, nw_ptr, M, N, K, k_per_split, stride_xm,
                   stride_wn, stride_ps, stride_pm, stride_ym, stride_gm, eps,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DIRECT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, PROLOGUE: tl.constexpr, HEAD: tl.constexpr, MID_TY: tl.constexpr,
                   PRECISE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    lo = pid_k * k_per_split
    hi = tl.minimum(lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hi
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & k_ok[None, :], other=0.0)
        if PROLOGUE != 0:    # rows past M load zeros and stay zero (their outputs are not stored)
            g = tl.load(g_ptr + m[:, None] * stride_gm + k[None, :], mask=(m[:, None] < M) & k_ok[None, :],
                        other=0.0)
            x = _prologue(x, g, nw_ptr, eps, PROLOGUE, HEAD, MID_TY, PRECISE)
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    pdl_release(PDL)
    out_ok = (m[:, None] < M) & (n[None, :] < N)
    if DIRECT:          # no K split: finish here (bias, rounding to the output dtype)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_ok)
    else:
        tl.store(part_ptr + pid_k * stride_ps + m[:, None] * stride_pm + n[None, :], acc, mask=out_ok)


@triton.jit
def _split_sum_kernel(part_ptr, b_ptr, y_ptr, M, N, n_splits, stride_ps, stride_pm, stride_ym,
                      HAS_BIAS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    s = tl.arange(0, SPLITS_P2)
    ok = (s[:, None] < n_splits) & (n[None, :] < N)
    parts = tl.load(part_ptr + s[:, None] * stride_ps + row * stride_pm + n[None, :], mask=ok, other=0.0)
    y = tl.sum(parts, axis=0)              # fixed order: the same bits on every run (no atomics)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n < N)


def skinny_config(N: int, K: int, sm_count: int) -> dict[str, int]:
    """64 weight rows per program; narrow matrices (fewer row blocks than SMs) split K until the grid covers the
    chip twice."""
    block_n, block_k = 64, 128
    n_blocks = triton.cdiv(N, block_n)
    splits = 1 if n_blocks >= sm_count else max(1, min(K // 1024, triton.cdiv(2 * sm_count, n_blocks)))
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": splits, "num_warps": 4, "num_stages": 4}


def skinny_gemm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       config: dict[str, int] | None = None, *, prologue: Prologue = Prologue.NONE,
                       gate: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                       eps: float = 0.0) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias)`` for ``2 <= M <= 16`` rows -> ``[M, N]`` in x's dtype.

    The rows are one 16-row tensor-core tile, so each weight element is read once whatever M is; narrow matrices
    split K over more programs and sum the fp32 partials in a fixed order in a second small kernel (no atomics:
    the same bits on every run). The launch depends on N and K only and each output element on its own row only,
    so a row's result is the same whatever M is. ``prologue``: as :func:`gemv_triton`, with ``gate [M, K]``
    (rows of x and gate may be strided views, e.g. the two halves of ``gate_up``)."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"skinny gemm: x {tuple(x.shape)}, weight {tuple(weight.shape)} (rows 1..16, contiguous)")
    M, K = x.shape
    N = weight.shape[0]
    if not 1 <= M <= SKINNY_MAX_ROWS or weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"skinny gemm: x {tuple(x.shape)}, weight {tuple(weight.shape)} (rows 1..16, contiguous)")
    if x.stride(1) != 1:
        x = x.contiguous()
    pro = _prologue_operands(x, prologue, gate, norm_weight, eps)
    cfg = _launch_config(skinny_config(N, K, sm_count(x.device)), config, pro)
    splits = cfg["SPLIT_K"]
    k_per_split = triton.cdiv(triton.cdiv(K, splits), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    splits = triton.cdiv(K, k_per_split)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    direct = splits == 1
    part = y if direct else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    b = bias if bias is not None else y
    pdl = pdl_launch(x.device)
    _skinny_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), splits)](
        x, weight, part, b, y, pro.gate, pro.norm_weight, M, N, K, k_per_split, x.stride(0), weight.stride(0),
        part.stride(0) if not direct else 0, part.stride(1) if not direct else 0, y.stride(0), pro.gate.stride(0),
        pro.eps, BLOCK_M=16, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], DIRECT=direct,
        HAS_BIAS=bias is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pro.constexprs,
        PDL=bool(pdl), **pdl,
    )
    if direct:
        return y
    block = 1024
    _split_sum_kernel[(M, triton.cdiv(N, block))](
        part, bias if bias is not None else part, y, M, N, splits, part.stride(0), part.stride(1), y.stride(0),
        HAS_BIAS=bias is not None, SPLITS_P2=max(2, triton.next_power_of_2(splits)), BLOCK=block, num_warps=4,
        PDL=bool(pdl), **pdl,
    )
    return y
