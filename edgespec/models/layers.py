"""Building blocks shared by every target model: RMSNorm, rotary embedding, MLP and (gated) causal attention.

All modules work on one sequence (batch 1): activations are ``[T, hidden]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from edgespec.cache.kv import KVCache
from edgespec.kernels.attention.attention import cached_attention
from edgespec.kernels.attention.rope import qk_norm_rope_write, rope_ref
from edgespec.kernels.pointwise.activation import silu_mul
from edgespec.kernels.pointwise.norm import add_rms_norm, rms_norm
from edgespec.kernels.quant.linear import linear
from edgespec.kernels.verify.tree import TreeMask, tree_attention
from edgespec.models.config import ModelConfig
from edgespec.models.mrope import rotary_axes
from edgespec.weights.base import PackedLinear, is_packed


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; ``zero_centred`` scales by ``1 + w`` (Qwen3.5) instead of ``w``."""

    def __init__(self, dim: int, eps: float, zero_centred: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))
        self.eps = eps
        self.zero_centred = zero_centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centred)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = residual + x`` and its norm, fused on CUDA: returns ``(s, norm(s))``."""
        return add_rms_norm(x, residual, self.weight, self.eps, self.zero_centred)


def gather_rows(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``table[rows]``: the rows of ``table [N, D]`` at the indices ``rows [T]``, bit for bit what ``index_select`` /
    ``nn.Embedding`` return. Indexing runs one CUDA thread per output element; ``index_select`` (and so the
    embedding) takes a kernel that walks the indices one after another, each waiting on a memory read, so a
    16-row verify's gather costs several times a one-row one (``tools/step_profile.py`` shows it). A packed table
    (a GGUF Q8_0 embedding) decodes only the rows asked for."""
    if is_packed(table):
        return table.rows(rows)
    return table[rows]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.x frequency rescaling: long wavelengths divided by ``factor``, a smooth ramp in between."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _yarn_inv_freq(dim: int, base: float, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN (HF ``rope_type: "yarn"``): per frequency, a blend of the original (extrapolated) and the
    ``factor``-interpolated inverse frequency -- high frequencies (many rotations within the original context) keep
    theirs, low ones are interpolated, with a linear ramp between the dimensions that complete ``beta_fast`` and
    ``beta_slow`` rotations over ``original_max_position_embeddings``. Returns (inv_freq, attention factor): cos and
    sin are multiplied by that factor (``0.1 ln(factor) + 1`` unless the config sets it or mscale /
    mscale_all_dim), which scales the attention logits by its square."""
    original = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor")
    if factor is None:           # DeepSeek-V3 style configs give the two lengths instead of the factor
        factor = max_positions / original

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale_of(factor, m) / mscale_of(factor, m_all) if m and m_all else mscale_of(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        # the rotary dimension whose frequency turns ``rotations`` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    """NeoX-style (rotate-half) RoPE over the first ``rotary_dim`` channels of each head.

    cos/sin for every position up to ``max_len`` are precomputed once, so a step only indexes a table. They are
    computed on the host whatever the ambient device (``.to(device)`` moves them): under a loader's
    ``torch.device("meta")`` the first meta-tensor op (``arange``) imports ``torch._dynamo`` with sympy and triton,
    about 140 MB resident for the rest of a CPU process.
    """

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        with torch.device("cpu"):
            self._build(cfg, max_len)

    def _build(self, cfg: ModelConfig, max_len: int) -> None:
        dim = cfg.rotary_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        scaling = cfg.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        attention_factor = 1.0
        if kind == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(dim, cfg.rope_theta, scaling, cfg.max_position_embeddings)
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind not in ("default", "mrope"):
            # mrope on text-only input reduces to plain RoPE; anything else would silently change the model.
            from edgespec.errors import UnsupportedModelError
            raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported")
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq).float()
        emb = torch.cat([freqs, freqs], dim=-1)
        self.rotary_dim = dim
        self.attention_factor = attention_factor
        # YaRN's attention factor rides on the tables, so every consumer (fused kernels included) applies it.
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)
        # Multimodal RoPE: the position axis (t, h, w) each table channel turns with (edgespec.models.multimodal).
        axes = None
        if cfg.mrope_section is not None:
            axes = rotary_axes(cfg.mrope_section, cfg.mrope_interleaved, dim)
        self.register_buffer("mrope_axes", axes, persistent=False)

    def angles(self, start: int, T: int, pos_t: torch.Tensor | None, dtype: torch.dtype,
               delta_t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin) [T, 1, rotary_dim]`` in ``dtype`` for positions ``start ..`` (or ``pos_t[0] ..``, plus the
        one-element ``delta_t`` when given: a multimodal cache's rope delta, read on the device by graph replays).

        A forward computes them once and hands them to every layer: per layer and per q/k they were four small
        gathers and casts each (on a GPU ~120 kernels of a Qwen3.5-4B decode step, and a slow index_select on
        16-row verifies)."""
        if pos_t is None:
            cos = self.cos[start:start + T, None, :]
            sin = self.sin[start:start + T, None, :]
        else:
            idx = pos_t + torch.arange(T, device=pos_t.device)
            if delta_t is not None:
                idx = idx + delta_t
            cos = gather_rows(self.cos, idx)[:, None, :]
            sin = gather_rows(self.sin, idx)[:, None, :]
        return cos.to(dtype), sin.to(dtype)

    def angles_mrope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin) [T, 1, rotary_dim]`` of multimodal positions ``[T, 3]`` (t, h, w): each channel read from the
        1-D table at the position of its axis, so a text row (three equal positions) gets exactly
        :meth:`angles`' values."""
        if self.mrope_axes is None:
            raise ValueError("multimodal positions for a model without mrope_section in its config")
        idx = positions[:, self.mrope_axes]                              # [T, rotary_dim]
        channel = torch.arange(self.rotary_dim, device=positions.device)
        return self.cos[idx, channel][:, None, :].to(dtype), self.sin[idx, channel][:, None, :].to(dtype)

    def angles_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin) [T, 1, rotary_dim]`` of arbitrary positions (a tree verify: start + each row's depth)."""
        return (gather_rows(self.cos, positions)[:, None, :].to(dtype),
                gather_rows(self.sin, positions)[:, None, :].to(dtype))

    def forward(self, x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate ``x [T, H, hd]`` by the angles ``cs`` of its rows' positions (from :meth:`angles`): the torch
        rotate-half of :func:`edgespec.kernels.attention.rope.rope_ref`, which the fused attention prologue's reference
        uses too."""
        return rope_ref(x, *cs)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and checkpoint keys) computed by :func:`edgespec.kernels.quant.linear.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def merge_linears(parent: nn.Module, names: list[str]) -> nn.Module | None:
    """Replace the Linears ``names`` of ``parent`` by one whose output is their outputs concatenated.

    A batch-1 forward is weight-read bound and each projection is a separate GEMV launch; one GEMV over the stacked
    rows reads the same bytes with fewer launches and a better-shaped matrix. The loader merges on the meta device,
    before anything is allocated, and streams each checkpoint part into its rows of the merged weight (the
    ``merged_parts`` attribute records the row layout); merging loaded layers copies each part into its rows and
    drops the parts, at most one group of extra memory. Packed parts merge through their format's ``cat``; where
    that cannot split at the part boundaries, or the parts mix formats, nothing changes and None is returned (the
    caller keeps the separate layers).
    """
    from edgespec.weights.base import PackedWeight

    parts = [getattr(parent, n) for n in names]
    has_bias = parts[0].bias is not None
    if any((p.bias is not None) != has_bias for p in parts):
        return None
    weights = [p.weight for p in parts]
    packed = [isinstance(w, PackedWeight) for w in weights]
    if any(packed):
        if not all(packed) or len({type(w) for w in weights}) != 1:
            return None
        merged_weight = type(weights[0]).cat(weights)
        if merged_weight is None:
            return None
        bias = torch.cat([p.bias.detach() for p in parts]) if has_bias else None
        merged: nn.Module = PackedLinear(merged_weight, bias)
        merged.merged_parts = [(n, p.out_features) for n, p in zip(names, parts, strict=True)]
        for n in names:
            delattr(parent, n)
        return merged
    merged = Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=has_bias,
                    device=parts[0].weight.device, dtype=parts[0].weight.dtype)
    row = 0
    with torch.no_grad():
        for n, p in zip(names, parts, strict=True):
            merged.weight[row:row + p.out_features].copy_(p.weight)
            if has_bias:
                merged.bias[row:row + p.out_features].copy_(p.bias)
            row += p.out_features
            delattr(parent, n)
    # Row layout of the merge, so a loader can fill a merged layer built on the meta device part by part.
    merged.merged_parts = [(n, p.out_features) for n, p in zip(names, parts, strict=True)]
    return merged


def merge_all_projections(root: nn.Module) -> None:
    """Merge the projections of every submodule of ``root`` that can (attention q/k/v, MLP gate/up, GDN inputs)."""
    for module in list(root.modules()):
        if module is not root and hasattr(module, "merge_projections"):
            module.merge_projections()


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, inter: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=bias)
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)
        self.gate_up_proj: Linear | None = None

    def merge_projections(self) -> None:
        if self.gate_up_proj is None:       # None after a merge: the parts stay separate
            self.gate_up_proj = merge_linears(self, ["gate_proj", "up_proj"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            # Separate SwiGLU kernel on purpose: fused into the down GEMV, every GEMV program would recompute the
            # whole input (docs/notes/attention-experiments.md compares the two).
            return self.down_proj(silu_mul(self.gate_up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Causal GQA attention over a preallocated KV cache.

    Llama: plain. Qwen3: per-head q/k RMSNorm before RoPE. Qwen3.5: zero-centred q/k norm, partial RoPE, and
    ``q_proj`` emitting ``[q_h | gate_h]`` per head with the output multiplied by ``sigmoid(gate)``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.hd = cfg.head_dim
        self.gated = cfg.gated_attention
        q_out = self.n_heads * self.hd * (2 if self.gated else 1)
        self.q_proj = Linear(cfg.hidden_size, q_out, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, bias=cfg.attention_bias)
        self.o_proj = Linear(self.n_heads * self.hd, cfg.hidden_size, bias=cfg.attention_bias)
        if cfg.has_qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, cfg.zero_centred_norms)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, cfg.zero_centred_norms)
        else:
            self.q_norm = self.k_norm = None
        self.scale = self.hd ** -0.5
        self.qkv_proj: Linear | None = None

    def merge_projections(self) -> None:
        if self.qkv_proj is None:           # None after a merge: the parts stay separate
            self.qkv_proj = merge_linears(self, ["q_proj", "k_proj", "v_proj"])

    def forward(self, x: torch.Tensor, cache: KVCache, start: int, rope: RotaryEmbedding,
                pos_t: torch.Tensor | None = None, cs: tuple[torch.Tensor, torch.Tensor] | None = None,
                tree: TreeMask | None = None) -> torch.Tensor:
        """``pos_t``: the start position as a device tensor (CUDA-graph replay at any position); else ``start``.
        ``cs``: the forward's rotary angles (:meth:`RotaryEmbedding.angles`), computed here when not given.
        ``tree``: a tree verify (rows at ``start + depth``, attending to the prefix and their ancestors; ``cs``
        must then be the rows' own angles)."""
        T = x.shape[0]
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
        else:
            # Unmerged layout (golden tests): the same values, concatenated into the merged layout.
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        if cs is None:
            cs = rope.angles(start, T, pos_t, qkv.dtype)
        if self.q_norm is None and not self.gated and pos_t is None and tree is None and qkv.device.type == "cpu":
            # Llama on CPU: RoPE, cache write and attention in one compiled call (edgespec.kernels.cpu.cpu_step).
            from edgespec.kernels.cpu.cpu_step import llama_attention_cpu
            out = llama_attention_cpu(qkv, cache, start, cs, self.n_heads, self.n_kv, self.hd, self.scale)
            if out is not None:
                return self.o_proj(out)
        # q/k norm, RoPE and the K/V cache write: one kernel on CUDA (in torch the split, norms, rotate-half and
        # the scatter are ~19 small kernels per layer), the unfused torch sequence elsewhere.
        norms = self.q_norm is not None
        q, gate = qk_norm_rope_write(
            qkv, cache, start, cs, self.n_heads, self.n_kv, self.hd, self.gated,
            q_norm=self.q_norm.weight if norms else None, k_norm=self.k_norm.weight if norms else None,
            eps=self.q_norm.eps if norms else 1e-6, zero_centred=norms and self.q_norm.zero_centred, pos_t=pos_t)
        if tree is None:
            out = cached_attention(q, cache, start, self.scale, pos_t)
        else:
            out = tree_attention(q, cache, start, self.scale, tree, pos_t)
        out = out.reshape(T, self.n_heads * self.hd)
        if gate is not None:
            out = out * torch.sigmoid(gate).reshape(T, self.n_heads * self.hd)
        return self.o_proj(out)
