"""Sampling parameters and the target distribution they define (temperature, top-k, top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgespec.errors import RequestError

# Temperatures below this are greedy (as in vLLM): logits / temperature overflow to inf and softmax gives NaN; the
# limit of sampling is argmax. The server reads it from here too.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 5.0):
            raise RequestError(f"temperature {self.temperature} out of range [0, 5]")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p {self.top_p} out of range (0, 1]")
        if self.top_k < 0:
            raise RequestError(f"top_k {self.top_k} must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generator(self, device: torch.device) -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[..., V]`` that plain sampling draws from: softmax(logits / T) cut by top-k then top-p."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses the threshold stays).
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        # The most likely token always stays: a top_p below float32's smallest value (1e-46) rounds to 0 in the
        # comparison and would drop every token (then the draw divides 0 by 0).
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """One token id (0-dim long tensor) from ``logits [V]``: argmax when greedy, else a draw from target_probs."""
    if params.greedy:
        return logits.argmax(-1)
    return torch.multinomial(target_probs(logits, params), 1, generator=gen)[0]
