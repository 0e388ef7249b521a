"""Batched generation with tap capture, for making distillation data on attention-only targets.

The serving path (:class:`~edgespec.models.decoder.TargetModel`) runs one sequence at a time, which on a CPU is
weight-read bound, while the same weights applied to 16 rows at once cost barely more per step. Data generation needs
throughput, not latency, so this module runs the target's own weights (unmerged checkpoint layout, see
``load_target(merge=False)``) over a left-padded batch with a plain torch KV cache, and records the tapped hidden states
of every token as it goes -- the same values ``TargetModel.forward(taps=...)`` returns (tests compare both, and the
greedy tokens with the serving path's).

Only Llama / Qwen3 style targets (every layer full attention, no output gate) take this path; others
(Qwen3.5 hybrids) use :func:`edgespec.distill.data.generate_one` over the serving model, one sequence at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from edgespec.kernels.attention.rope import rope_ref
from edgespec.kernels.pointwise.norm import rms_norm_ref
from edgespec.models.decoder import TargetModel


def supports_batched(model: TargetModel) -> bool:
    """True when every layer is plain (ungated) full attention and the projections are unmerged."""
    cfg = model.config
    if any(kind != "full_attention" for kind in cfg.layer_types) or cfg.gated_attention:
        return False
    return all(hasattr(layer.self_attn, "q_proj") and hasattr(layer.mlp, "gate_proj") for layer in model.model.layers)


@dataclass
class Generated:
    """One generated sequence: ``tokens`` = prompt + continuation (stop token included when hit), and the
    tapped hidden states ``taps [n, n_taps, H]`` of its first ``n`` tokens (every token but possibly the last,
    which was never fed back)."""

    tokens: list[int]
    prompt_len: int
    taps: torch.Tensor


def _norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return rms_norm_ref(x, module.weight, module.eps, module.zero_centred)


class _BatchCache:
    """Per-layer K/V ``[B, Hkv, L, hd]`` for a left-padded batch; ``pad[b]`` leading slots of row b are padding."""

    def __init__(self, model: TargetModel, batch: int, max_len: int, pad: torch.Tensor) -> None:
        cfg = model.config
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in cfg.layer_types]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.pad = pad
        self.length = 0


def _forward(model: TargetModel, tokens: torch.Tensor, cache: _BatchCache, taps: Sequence[int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens [B, T]`` at slots ``cache.length ..`` -> (last-row logits ``[B, V]``, taps ``[B, T, n, H]``)."""
    cfg = model.config
    B, T = tokens.shape
    s = cache.length
    slots = torch.arange(s, s + T, device=tokens.device)
    pos = (slots[None, :] - cache.pad[:, None]).clamp(min=0)                  # [B, T] absolute positions
    cos, sin = model.rope.cos[pos].to(model.dtype), model.rope.sin[pos].to(model.dtype)    # [B, T, rd]
    cos, sin = cos[:, :, None], sin[:, :, None]
    keys = torch.arange(s + T, device=tokens.device)
    visible = (keys[None, None, :] <= slots[None, :, None]) & (keys[None, None, :] >= cache.pad[:, None, None])
    mask = visible[:, None]                                                   # [B, 1, T, s+T]
    h = model.model.embed_tokens.weight[tokens]
    out_taps = torch.empty(B, T, len(taps), cfg.hidden_size, dtype=h.dtype, device=h.device)
    tap_index = {layer: i for i, layer in enumerate(taps)}
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for i, layer in enumerate(model.model.layers):
        att = layer.self_attn
        x = _norm(layer.input_layernorm, h)
        q = F.linear(x, att.q_proj.weight, att.q_proj.bias).view(B, T, nh, hd)
        k = F.linear(x, att.k_proj.weight, att.k_proj.bias).view(B, T, nkv, hd)
        v = F.linear(x, att.v_proj.weight, att.v_proj.bias).view(B, T, nkv, hd)
        if att.q_norm is not None:
            q, k = _norm(att.q_norm, q), _norm(att.k_norm, k)
        q = rope_ref(q.reshape(B * T, nh, hd), cos.reshape(B * T, 1, -1), sin.reshape(B * T, 1, -1))
        k = rope_ref(k.reshape(B * T, nkv, hd), cos.reshape(B * T, 1, -1), sin.reshape(B * T, 1, -1))
        cache.k[i][:, :, s:s + T] = k.view(B, T, nkv, hd).transpose(1, 2)
        cache.v[i][:, :, s:s + T] = v.transpose(1, 2)
        kk = cache.k[i][:, :, :s + T].repeat_interleave(nh // nkv, dim=1)
        vv = cache.v[i][:, :, :s + T].repeat_interleave(nh // nkv, dim=1)
        o = F.scaled_dot_product_attention(q.view(B, T, nh, hd).transpose(1, 2), kk, vv, attn_mask=mask,
                                           scale=att.scale)
        h = h + F.linear(o.transpose(1, 2).reshape(B, T, nh * hd), att.o_proj.weight, att.o_proj.bias)
        y = _norm(layer.post_attention_layernorm, h)
        mlp = layer.mlp
        gate = F.linear(y, mlp.gate_proj.weight, mlp.gate_proj.bias)
        up = F.linear(y, mlp.up_proj.weight, mlp.up_proj.bias)
        h = h + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        if i in tap_index:
            out_taps[:, :, tap_index[i]] = h
    cache.length = s + T
    last = _norm(model.model.norm, h[:, -1])
    return F.linear(last, model.lm_head_weight).float(), out_taps


def _device_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """A generator on ``device`` seeded from ``generator`` (so a run stays reproducible), or ``generator`` itself
    when it already lives there. Sampling where the logits are avoids copying ``[B, V]`` probabilities to the host
    every step, a copy and a host multinomial that would cost far more than the greedy step itself on a GPU."""
    if generator is None or generator.device == device:
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device=device).manual_seed(seed)


@torch.inference_mode()
def generate_batch(model: TargetModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                   stop_ids: Sequence[int], taps: Sequence[int], temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> list[Generated]:
    """Continue every prompt (greedy when ``temperature`` is 0, else sampled at that temperature) for up to
    ``max_new_tokens`` or a stop token, capturing taps of every prompt and generated token."""
    if not supports_batched(model):
        raise ValueError("generate_batch needs an attention-only target loaded with merge=False")
    B = len(prompts)
    lens = torch.tensor([len(p) for p in prompts])
    width = int(lens.max())
    pad = (width - lens).to(model.device)
    ids = torch.zeros(B, width, dtype=torch.long, device=model.device)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
    cache = _BatchCache(model, B, width + max_new_tokens, pad)
    logits, prompt_taps = _forward(model, ids, cache, taps)
    tap_rows: list[torch.Tensor] = [prompt_taps]
    new = torch.zeros(B, 0, dtype=torch.long, device=model.device)
    done = torch.zeros(B, dtype=torch.bool, device=model.device)
    stops = torch.tensor(list(stop_ids) or [-1], device=model.device)
    sampler = _device_generator(generator, model.device) if temperature > 0 else None
    for step in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=sampler).view(B)
        else:
            nxt = logits.argmax(-1)
        new = torch.cat([new, nxt[:, None]], dim=1)
        done = done | torch.isin(nxt, stops)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits, step_taps = _forward(model, nxt[:, None], cache, taps)
        tap_rows.append(step_taps)
    all_taps = torch.cat(tap_rows, dim=1)                                      # [B, width + fed steps, n, H]
    out = []
    for b, p in enumerate(prompts):
        cont = new[b].tolist()
        hit = [i for i, t in enumerate(cont) if t in set(stop_ids)]
        if hit:
            cont = cont[:hit[0] + 1]
        # A token's taps exist once it has been fed: the final token (never fed) has none. It is still kept, as a
        # label (no block's context ever reaches the last token).
        fed = min(len(cont), all_taps.shape[1] - width)
        out.append(Generated(tokens=list(p) + cont, prompt_len=len(p),
                             taps=all_taps[b, width - len(p):width + fed].clone()))
    return out
