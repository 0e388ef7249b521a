"""Depthwise causal conv1d + SiLU over T new rows with per-step state saves, in Triton.

Contract: :func:`edgespec.kernels.recurrent.conv.causal_conv1d_ref`. The conv has no recurrence: output row t reads
``seq = [state | x^T]`` at columns ``t .. t+K-1`` only. So the grid covers (channel block, row block) and
each program builds its ``[BLOCK_T, BLOCK_C]`` tile from K shifted loads (taps reaching before row 0 read
the old state); the checkpoint slots ``slot[t+1] = seq[:, t+1 : t+K]`` are those same taps and are stored as
they are loaded. The state is updated in place, so only the first row block (the only one that reads the
old state, as ``BLOCK_T >= K-1``) writes the new one, after a barrier.

Rounding follows the reference step by step: x is cast to the state dtype (``torch.cat`` does that), the
sequence to the weight dtype, the conv sum is rounded to the weight dtype before SiLU (``F.conv1d`` returns it
so), and SiLU's result is rounded to the weight dtype (``F.silu`` keeps it), then to x's dtype.

A tree verify (``tree=(parents, depths)``, :mod:`edgespec.kernels.verify.tree`) runs the same program with each tap read
from the row's own ancestor instead of the row before it, walked up the parents on the device: every branch of the
tree then gets, bit for bit, what this kernel gives for that branch run as a chain.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgespec.kernels.launch.triton_pdl import pdl_enter, pdl_launch
from edgespec.kernels.pointwise.triton_activation import gdn_gates_block


@triton.jit
def _seq_rows(x_ptr, state_ptr, c, c_ok, rows, T, stride_xt, KM1: tl.constexpr):
    """``seq`` values at x-row indices ``rows`` (a [BLOCK_T] vector; negative = old state column
    ``KM1 + row``) for channels c, as a [BLOCK_T, BLOCK_C] tile in the state dtype."""
    from_x = c_ok[None, :] & (rows[:, None] >= 0) & (rows[:, None] < T)
    from_s = c_ok[None, :] & (rows[:, None] < 0)
    xv = tl.load(x_ptr + rows[:, None] * stride_xt + c[None, :], mask=from_x, other=0.0)
    sv = tl.load(state_ptr + c[None, :] * KM1 + (KM1 + rows[:, None]), mask=from_s, other=0.0)
    return tl.where(from_x, xv.to(sv.dtype), sv)


@triton.jit
def _tree_tap_rows(par_ptr, dep_ptr, t, t_ok, UP: tl.constexpr):
    """``seq`` row index of the tap ``UP`` steps up each tree row's own branch: the ancestor's row, or, once the
    branch ends at the root (depth < UP), the committed state's column as a negative row (``-(UP - depth)``)."""
    cur = t
    for _ in tl.static_range(UP):
        cur = tl.load(par_ptr + cur, mask=t_ok & (cur >= 0), other=-1)
    depth = tl.load(dep_ptr + t, mask=t_ok, other=0)
    return tl.where(UP <= depth, cur, depth - UP)


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, state_ptr, w_ptr, slots_ptr, out_ptr, xs_ptr,
    a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, par_ptr, dep_ptr,
    T, C, stride_xt, stride_ot, stride_slot, stride_xst, H, stride_a, stride_b,
    K: tl.constexpr, KM1_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    SAVE_SLOTS: tl.constexpr, UPDATE_STATE: tl.constexpr, SAVE_X: tl.constexpr,
    FUSE_GATES: tl.constexpr, GATE_BLOCK: tl.constexpr, TREE: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid_c = tl.program_id(0)
    pid_t = tl.program_id(1)
    if FUSE_GATES:
        # The GDN decay / write strength of all T rows ride along in one program: a few hundred values, which as
        # a kernel of their own cost a launch per layer.
        if pid_c == 0:
            if pid_t == 0:
                gdn_gates_block(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, tl.arange(0, GATE_BLOCK), T, H,
                                stride_a, stride_b)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    w_ty = w_ptr.dtype.element_ty
    for j in tl.static_range(K):
        # Tap j of output row t reads seq column t + j, i.e. x row t + j - (K-1); a tree row reads its own
        # ancestor K-1-j steps up instead (``par_ptr`` / ``dep_ptr``: the tree's parents and depths).
        if TREE:
            tap = _tree_tap_rows(par_ptr, dep_ptr, t, t_ok, K - 1 - j)
        else:
            tap = t + j - (K - 1)
        val = _seq_rows(x_ptr, state_ptr, c, c_ok, tap, T, stride_xt, K - 1)
        w = tl.load(w_ptr + c * K + j, mask=c_ok, other=0.0)
        acc += w.to(tl.float32)[None, :] * val.to(w_ty).to(tl.float32)
        if SAVE_SLOTS:
            if j >= 1:
                # Slot t+1 (state after row t) column j-1 = seq column t + j: the tap just loaded.
                tl.store(slots_ptr + (t[:, None] + 1) * stride_slot + c[None, :] * (K - 1) + (j - 1),
                         val.to(slots_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])
        if SAVE_X:
            if j == K - 1:
                # The last tap reads x row t itself (as the window stores it): the deferred commit's input.
                tl.store(xs_ptr + t[:, None] * stride_xst + c[None, :], val, mask=t_ok[:, None] & c_ok[None, :])
    acc = acc.to(w_ty).to(tl.float32)
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + t[:, None] * stride_ot + c[None, :], y.to(w_ty).to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])
    if UPDATE_STATE:
        if pid_t == 0:
            # New state = seq columns T .. T+K-2. Only this row block read the old state (BLOCK_T >= K-1), so
            # overwriting it here, after a barrier that finishes this program's reads, races with nobody.
            jj = tl.arange(0, KM1_P2)
            rows = T - (K - 1) + jj
            from_x = c_ok[:, None] & (jj[None, :] < K - 1) & (rows[None, :] >= 0)
            from_s = c_ok[:, None] & (jj[None, :] < K - 1) & (rows[None, :] < 0)
            xv = tl.load(x_ptr + rows[None, :] * stride_xt + c[:, None], mask=from_x, other=0.0)
            sv = tl.load(state_ptr + c[:, None] * (K - 1) + (K - 1 + rows[None, :]), mask=from_s, other=0.0)
            new_state = tl.where(from_x, xv.to(sv.dtype), sv)
            tl.debug_barrier()
            tl.store(state_ptr + c[:, None] * (K - 1) + jj[None, :], new_state,
                     mask=c_ok[:, None] & (jj[None, :] < K - 1))


def causal_conv1d_triton(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                         slots: torch.Tensor | None = None, *, update_state: bool = True,
                         out: torch.Tensor | None = None, x_save: torch.Tensor | None = None,
                         gates: tuple[torch.Tensor, ...] | None = None,
                         tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``silu(causal depthwise conv)`` of ``x [T, C]`` continuing from ``state [C, K-1]`` (updated in place unless
    ``update_state`` is False).

    With ``slots [>=T+1, C, K-1]`` the state after row i goes to slot i+1; ``x_save [T, C]`` (state dtype)
    receives x as the state stores it; ``out [T, C]`` (x's dtype) takes the result. ``gates``: ``(a, b, A_log,
    dt_bias, g, beta)`` as checked by ``triton_activation.check_gates``: the GDN gates are computed in the same
    launch. ``tree``: ``(parents, depths)``, ``[T]`` int64 on x's device
    (:class:`edgespec.kernels.verify.tree.TreeMask`): row t's window is its own ancestors (a tree verify), so the
    state is only read (no ``slots``, no update). Returns ``[T, C]`` in x's dtype.
    """
    T, C = x.shape
    K = weight.shape[1]
    if K < 2 or state.shape != (C, K - 1) or weight.shape[0] != C:
        raise ValueError(f"conv shapes: x{tuple(x.shape)} state{tuple(state.shape)} "
                         f"weight{tuple(weight.shape)}")
    if not state.is_contiguous():
        raise ValueError("conv state must be contiguous (it is updated in place)")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    if slots is not None and (slots.shape[0] < T + 1 or slots.shape[1:] != state.shape
                              or not slots.is_contiguous()):
        raise ValueError("slots must be a contiguous [>=T+1, C, K-1] tensor")
    if out is None:
        out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    elif out.shape != (T, C) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"conv out must be a [{T}, {C}] {x.dtype} tensor with unit column stride")
    if x_save is not None and (x_save.shape != (T, C) or x_save.dtype != state.dtype or x_save.stride(1) != 1):
        raise ValueError(f"conv x_save must be a [{T}, {C}] {state.dtype} tensor with unit column stride")
    if tree is not None:
        parents, depths = tree
        if update_state or slots is not None:
            raise ValueError("a tree conv reads the committed state only: no slots, update_state=False")
        for name, t in (("parents", parents), ("depths", depths)):
            if t.shape != (T,) or t.dtype != torch.int64 or t.device != x.device or not t.is_contiguous():
                raise ValueError(f"tree conv {name} must be a contiguous int64 [{T}] tensor on {x.device}")
    if T == 0:
        return out
    if gates is not None:
        a, b, A_log, dt_bias, g, beta = gates
        if a.shape[0] != T:
            raise ValueError(f"gates cover {a.shape[0]} rows, the conv {T}")
        gate_args = (a, b, A_log, dt_bias, g, beta)
        gate_dims = (a.shape[1], a.stride(0), b.stride(0))
        gate_block = max(16, triton.next_power_of_2(T * a.shape[1]))
    else:
        gate_args = (state,) * 6
        gate_dims = (0, 0, 0)
        gate_block = 16
    pdl = pdl_launch(x.device)
    # Outputs do not depend on each other (no recurrence), so rows are spread over the grid too.
    block_t = max(2, triton.next_power_of_2(K - 1), min(16, triton.next_power_of_2(T)))
    block_c = 128 if block_t >= 8 else 256
    _causal_conv1d_kernel[(triton.cdiv(C, block_c), triton.cdiv(T, block_t))](
        x, state, weight, slots if slots is not None else state, out, x_save if x_save is not None else state,
        *gate_args, *(tree if tree is not None else (state, state)),
        T, C, x.stride(0), out.stride(0), slots.stride(0) if slots is not None else 0,
        x_save.stride(0) if x_save is not None else 0, *gate_dims,
        K=K, KM1_P2=max(2, triton.next_power_of_2(K - 1)), BLOCK_T=block_t, BLOCK_C=block_c,
        SAVE_SLOTS=slots is not None, UPDATE_STATE=update_state, SAVE_X=x_save is not None,
        FUSE_GATES=gates is not None, GATE_BLOCK=gate_block, TREE=tree is not None, PDL=bool(pdl), num_warps=4,
        **pdl,
    )
    return out
