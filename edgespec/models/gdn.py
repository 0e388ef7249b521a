"""Gated DeltaNet token mixer of the Qwen3.5 / Qwen3.6 hybrid (the "linear_attention" layers).

Weights follow the Qwen3.5 checkpoint layout (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
``conv1d``, ``A_log``, ``dt_bias``, ``norm``, ``out_proj``). The math is in ``edgespec.kernels.recurrent.gdn``.
"""

from __future__ import annotations

import torch
from torch import nn

from edgespec.cache.state import GDNState, StateMode
from edgespec.kernels.pointwise.norm import gated_rms_norm
from edgespec.kernels.recurrent.conv import causal_conv1d_gates
from edgespec.kernels.recurrent.gdn import gdn_chunked, gdn_recurrent
from edgespec.kernels.verify.tree import TreeMask, gdn_tree, tree_conv_gates
from edgespec.models.config import ModelConfig
from edgespec.models.layers import Linear, merge_linears


class GatedDeltaNet(nn.Module):
    """One GDN layer: projections, causal conv, delta-rule recurrence, gated norm, output projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hk = cfg.linear_num_key_heads
        self.hv = cfg.linear_num_value_heads
        self.dk = cfg.linear_key_head_dim
        self.dv = cfg.linear_value_head_dim
        # Value heads per key head when the value heads are tiled (llama.cpp's GGUF order): the key heads are
        # repeated to one per value head before the kernels, which then pair head h with head h. Grouped order
        # (HF) is the kernels' own mapping (head h reads key head h // r), so nothing is repeated.
        self.tile_keys = self.hv // self.hk if cfg.linear_value_head_order == "tiled" and self.hv != self.hk else 1
        self.key_dim = self.hk * self.dk
        self.value_dim = self.hv * self.dv
        conv_dim = cfg.gdn_conv_dim
        self.in_proj_qkv = Linear(cfg.hidden_size, conv_dim, bias=False)
        self.in_proj_z = Linear(cfg.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = Linear(cfg.hidden_size, self.hv, bias=False)
        self.in_proj_a = Linear(cfg.hidden_size, self.hv, bias=False)
        # Depthwise conv stored as nn.Conv1d so checkpoint keys and shapes ([C, 1, K]) match.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.norm = _GatedNormWeight(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size, bias=False)
        self.in_proj: Linear | None = None
        self._in_split = [conv_dim, self.value_dim, self.hv, self.hv]

    def merge_projections(self) -> None:
        if self.in_proj is None:            # None after a merge: the parts stay separate
            self.in_proj = merge_linears(self, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"])

    def forward(self, x: torch.Tensor, state: GDNState, *, chunked: bool,
                mode: StateMode = StateMode.ADVANCE, tree: TreeMask | None = None) -> torch.Tensor:
        """Mix ``x [T, hidden]``. ``chunked``: prefill form. ``mode`` CHECKPOINT: save state after each row (slot
        i+1); DEFER: leave the state as it was and keep the rows' inputs in ``state.pending`` for the commit.
        ``tree``: a tree verify (deferred, each row mixed along its own branch: :mod:`edgespec.kernels.verify.tree`)."""
        T = x.shape[0]
        checkpoint, defer = mode is StateMode.CHECKPOINT, mode is StateMode.DEFER or tree is not None
        pending = state.pending if defer else None
        if defer and (pending is None or T > pending.x.shape[0]):
            raise ValueError(f"deferred GDN forward of {T} rows without room to keep them")
        conv_slots = state.conv_slots if checkpoint else None
        rec_slots = state.recurrent_slots if checkpoint else None
        if self.in_proj is not None:
            mixed, z, b, a = self.in_proj(x).split(self._in_split, dim=-1)
        else:
            mixed, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        weight = self.conv1d.weight[:, 0, :]
        if tree is not None:
            # Conv over each row's ancestors; the kept inputs are what the commit replays along the accepted path.
            qkv, g, beta = pending.qkv[:T], pending.g[:T], pending.beta[:T]
            tree_conv_gates(mixed, state.conv, weight, a, b, self.A_log, self.dt_bias, tree, out=qkv,
                            x_save=pending.x[:T], gates_out=(g, beta))
        elif pending is None:
            qkv, g, beta = causal_conv1d_gates(mixed, state.conv, weight, a, b, self.A_log, self.dt_bias, conv_slots)
        else:
            qkv, g, beta = causal_conv1d_gates(mixed, state.conv, weight, a, b, self.A_log, self.dt_bias,
                                               update_state=False, out=pending.qkv[:T], x_save=pending.x[:T],
                                               gates_out=(pending.g[:T], pending.beta[:T]))
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.hk, self.dk)
        k = k.reshape(T, self.hk, self.dk)
        if self.tile_keys > 1:
            q, k = q.repeat(1, self.tile_keys, 1), k.repeat(1, self.tile_keys, 1)   # key head h % hk per value head
        v = v.reshape(T, self.hv, self.dv)
        if tree is not None:
            o = gdn_tree(q, k, v, g, beta, state.recurrent, tree, x.dtype)
        elif chunked and not (checkpoint or defer):
            o = gdn_chunked(q, k, v, g, beta, state.recurrent).to(x.dtype)
        else:
            o = gdn_recurrent(q, k, v, g, beta, state.recurrent, rec_slots, out_dtype=x.dtype,
                              update_state=not defer)
        z = z.reshape(T, self.hv, self.dv)
        # A separate norm kernel on purpose: fused into the out_proj GEMV, every GEMV program would recompute the
        # norm of its whole input (docs/notes/attention-experiments.md compares the two).
        o = gated_rms_norm(o, z, self.norm.weight, self.norm.eps)
        return self.out_proj(o.reshape(T, self.value_dim))


class _GatedNormWeight(nn.Module):
    """Holds ``linear_attn.norm.weight`` (plain ``w``, initialised to one) and its epsilon."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
