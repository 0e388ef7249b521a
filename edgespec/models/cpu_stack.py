"""A whole Llama / Qwen3 layer stack on the CPU in one compiled call (``gguf_stack_forward`` in
``edgespec/kernels/cpu/gguf_cpu.c``).

A batch-1 decode step of the demo model is 30 layers of 8 small steps each; run from Python, every step costs a
module call, a few tensor allocations and a ctypes call, a large share of a step this small. Here the model
is described to C once (per-layer pointers to the weights, as they are stored: GGUF blocks or dense fp32 / bf16 /
fp16 rows), each KV cache once, and a forward of T rows is one call: the embedding rows in, the final-normed rows
and the tapped layers' outputs out. The C stack runs the same kernels in the same order as the per-layer path
(:class:`edgespec.models.decoder.DecoderLayer` with the helpers of :mod:`edgespec.kernels.cpu.cpu_step`), so a Llama
forward equals it bit for bit (tests), and every row is computed as in a one-row call: verify == decode.

:func:`stack_forward` returns None where the stack does not apply (another device or dtype, gradients, GDN or MoE
layers, gated attention or zero-centred norms, FP8 or blocked KV caches, packed formats other than GGUF's, no
compiler), and the caller runs the per-layer path.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgespec.kernels.cpu import gguf_native

# ggml type ids of the dense weights the products read (GGUF blocks carry their own: GGUFBlockWeight.ggml_type).
_DENSE_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}


class Weight(ctypes.Structure):
    """``gguf_weight_t``: one [N, K] weight as the products read it."""

    _fields_ = [("kind", ctypes.c_int), ("N", ctypes.c_int), ("K", ctypes.c_int), ("data", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    """``gguf_layer_t``: the norms and merged projections of one decoder layer."""

    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", Weight), ("o", Weight), ("gate_up", Weight),
                ("down", Weight), ("causal", ctypes.c_int)]


class Stack(ctypes.Structure):
    """``gguf_stack_t``: the model's shape and its layers."""

    _fields_ = [("n_layers", ctypes.c_int), ("D", ctypes.c_int), ("H", ctypes.c_int), ("Hkv", ctypes.c_int),
                ("hd", ctypes.c_int), ("I", ctypes.c_int), ("rd", ctypes.c_int), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("layers", ctypes.POINTER(Layer)), ("final_norm", ctypes.c_void_p)]


@dataclass
class StackPlan:
    """The C description of one model (``stack``), and the tensors it points into, kept alive with it."""

    stack: Stack
    layers: ctypes.Array
    keep: list[torch.Tensor]


def _fp32(t: torch.Tensor | None, keep: list[torch.Tensor]) -> int | None:
    """Pointer to ``t`` when it is a contiguous fp32 CPU tensor (None for None); raises ``_Declined`` otherwise."""
    if t is None:
        return None
    t = t.detach()
    if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
        raise _Declined
    keep.append(t)
    return t.data_ptr()


class _Declined(Exception):
    """The model has a part the C stack does not run."""


def _weight(linear: torch.nn.Module | None, keep: list[torch.Tensor]) -> Weight:
    from edgespec.weights.base import is_packed
    from edgespec.weights.gguf import GGUFBlockWeight

    if linear is None:
        raise _Declined
    w = linear.weight
    bias = _fp32(linear.bias, keep)
    if is_packed(w):
        if not isinstance(w, GGUFBlockWeight) or w.kernel is not None or w.blocks.device.type != "cpu":
            raise _Declined
        keep.append(w.blocks)
        return Weight(w.ggml_type, w.out_features, w.in_features, w.blocks.data_ptr(), bias)
    w = w.detach()
    kind = _DENSE_KINDS.get(w.dtype)
    if kind is None or w.device.type != "cpu" or not w.is_contiguous():
        raise _Declined
    keep.append(w)
    return Weight(kind, w.shape[0], w.shape[1], w.data_ptr(), bias)


def _layer(layer: torch.nn.Module, keep: list[torch.Tensor]) -> Layer:
    """One pre-norm attention + SwiGLU layer (a decoder's or a DFlash drafter's) as ``gguf_layer_t``."""
    from edgespec.models.layers import MLP

    attn, mlp = getattr(layer, "self_attn", None), layer.mlp
    if (attn is None or getattr(attn, "gated", False) or not isinstance(mlp, MLP)
            or layer.input_layernorm.zero_centred):
        raise _Declined
    q_norm = k_norm = None
    if attn.q_norm is not None:
        if attn.q_norm.zero_centred or attn.q_norm.eps != layer.input_layernorm.eps:
            raise _Declined
        q_norm, k_norm = _fp32(attn.q_norm.weight, keep), _fp32(attn.k_norm.weight, keep)
    return Layer(_fp32(layer.input_layernorm.weight, keep), _fp32(layer.post_attention_layernorm.weight, keep),
                 q_norm, k_norm, _weight(attn.qkv_proj, keep), _weight(attn.o_proj, keep),
                 _weight(mlp.gate_up_proj, keep), _weight(mlp.down_proj, keep),
                 int(getattr(layer, "causal", True)))


def _stack_plan(layers: Sequence[torch.nn.Module], final_norm: torch.nn.Module, hidden: int, inter: int,
                rotary_dim: int, eps: float) -> StackPlan | None:
    """The C description of ``layers`` and the final norm, or None where the stack does not run them."""
    lib = gguf_native.library()
    if lib is None or not len(layers) or final_norm.zero_centred:
        return None
    keep: list[torch.Tensor] = []
    try:
        table = (Layer * len(layers))(*(_layer(layer, keep) for layer in layers))
        final = _fp32(final_norm.weight, keep)
    except _Declined:
        return None
    attn = layers[0].self_attn
    stack = Stack(len(table), hidden, attn.n_heads, attn.n_kv, attn.hd, inter, rotary_dim, eps, attn.scale, table,
                  final)
    if lib.gguf_stack_check(ctypes.byref(stack)) != 0:
        return None
    return StackPlan(stack, table, keep)


def build_plan(model: torch.nn.Module) -> StackPlan | None:
    """The C description of ``model`` (a ``TargetModel``), or None where the stack does not run it."""
    cfg = model.config
    if model.dtype != torch.float32 or model.device.type != "cpu":
        return None
    if any(kind != "full_attention" for kind in cfg.layer_types):
        return None
    return _stack_plan(model.model.layers, model.model.norm, cfg.hidden_size, cfg.intermediate_size,
                       model.rope.rotary_dim, cfg.rms_norm_eps)


def build_drafter_plan(drafter: torch.nn.Module, rotary_dim: int) -> StackPlan | None:
    """The C description of a DFlash drafter's layers (``DFlashDraftModel``), or None where the stack does not
    run them."""
    cfg = drafter.cfg
    if drafter.fc.weight.device.type != "cpu":
        return None
    return _stack_plan(drafter.layers, drafter.norm, cfg.hidden_size, cfg.intermediate_size, rotary_dim,
                       cfg.rms_norm_eps)


_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # model or drafter -> StackPlan | None
_cache_ptrs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ModelCache -> (k pointers, v pointers)


def plan_of(model: torch.nn.Module) -> StackPlan | None:
    """:func:`build_plan`, once per model (its weights do not move after loading)."""
    if model not in _plans:
        _plans[model] = build_plan(model)
    return _plans[model]


def _pointers(tensors: Sequence[torch.Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


def _kv_pointers(cache) -> tuple[ctypes.Array, ctypes.Array] | None:
    """Every layer's K and V pointers, once per cache; None for caches the stack does not read (FP8, blocked V,
    another dtype or device)."""
    ptrs = _cache_ptrs.get(cache)
    if ptrs is not None and ptrs[2] == cache.layers[0].k.data_ptr():
        return ptrs[0], ptrs[1]
    for kv in cache.layers:
        if (getattr(kv, "fp8", True) or kv.v_block or kv.k.dtype != torch.float32 or kv.k.device.type != "cpu"
                or not (kv.k.is_contiguous() and kv.v.is_contiguous())):
            return None
    k, v = _pointers([kv.k for kv in cache.layers]), _pointers([kv.v for kv in cache.layers])
    _cache_ptrs[cache] = (k, v, cache.layers[0].k.data_ptr())
    return k, v


def _run(plan: StackPlan, keys: ctypes.Array, values: ctypes.Array, kv_row: int, h: torch.Tensor,
         cs: tuple[torch.Tensor, torch.Tensor], bias: ctypes.Array | None, taps: list[int]
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``gguf_stack_forward`` call: (final-normed rows, taps or None)."""
    T = h.shape[0]
    cos, sin = (c.reshape(T, -1).contiguous() for c in cs)
    h = h.contiguous()
    hidden = torch.empty_like(h)
    tap_out = torch.empty(T, len(taps), h.shape[1]) if taps else None
    tap_ids = (ctypes.c_int * len(taps))(*taps)
    rc = gguf_native.library().gguf_stack_forward(
        ctypes.byref(plan.stack), keys, values, kv_row, T, cos.data_ptr(), sin.data_ptr(), bias, h.data_ptr(),
        tap_ids, len(taps), None if tap_out is None else tap_out.data_ptr(), hidden.data_ptr(), gguf_native.threads())
    if rc == -2:
        raise MemoryError(f"CPU layer stack: no memory for the work buffers of {T} rows")
    if rc != 0:
        raise RuntimeError(f"CPU layer stack refused a description it accepted before (code {rc})")
    return hidden, tap_out


def _eligible(h: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() and h.dtype == torch.float32 and h.device.type == "cpu"


def stack_forward(model: torch.nn.Module, h: torch.Tensor, cache, start: int, cs: tuple[torch.Tensor, torch.Tensor],
                  taps: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Run every layer of ``model`` over the embedding rows ``h [T, D]`` at positions ``start ..`` (their rotary
    angles ``cs``), writing the K/V cache rows: ``(final-normed rows [T, D], taps [T, len(taps), D] or None)``, or
    None where the stack does not apply (then nothing was written). ``h`` is overwritten."""
    if not _eligible(h):
        return None
    plan = plan_of(model)
    ptrs = None if plan is None else _kv_pointers(cache)
    if ptrs is None:
        return None
    order = sorted(set(taps))
    if order != list(taps) or any(t < 0 or t >= plan.stack.n_layers for t in order):
        return None     # the decoder's tap layout (config order, repeats) stays with the per-layer path
    return _run(plan, ptrs[0], ptrs[1], start, h, cs, None, order)


def drafter_block_forward(drafter: torch.nn.Module, h: torch.Tensor, keys: Sequence[torch.Tensor],
                          values: Sequence[torch.Tensor], biases: Sequence[torch.Tensor],
                          cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
    """A DFlash block through every drafter layer in one call (``DFlashDraftModel.block_forward``'s contract):
    ``keys[i]`` / ``values[i] [W + T, Hkv, hd]`` fp32 hold layer i's window K/V, its last T rows the block's
    scratch; ``biases[i] [rep * T, W + T]`` its additive mask. Returns the final-normed rows, or None where the
    stack does not apply."""
    if not _eligible(h):
        return None
    if drafter not in _plans:
        _plans[drafter] = build_drafter_plan(drafter, cs[0].shape[-1])
    plan = _plans[drafter]
    T = h.shape[0]
    if plan is None or plan.stack.rd != cs[0].shape[-1]:
        return None
    if any(k.dtype != torch.float32 or not k.is_contiguous() or k.shape[0] < T for k in (*keys, *values)):
        return None
    rows = [b[:T] if b.is_contiguous() else b[:T].contiguous() for b in biases]
    return _run(plan, _pointers(keys), _pointers(values), keys[0].shape[0] - T, h, cs, _pointers(rows), [])[0]
