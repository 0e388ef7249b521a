"""Greedy parity between two token streams, with the regret check that low-precision numerics need.

In fp32 speculative output must equal plain output token for token. In bf16/fp16 a verify of K+1 rows and a decode
of one row run different kernel shapes (different accumulation order), so a near-tie between the two best tokens
can flip. The check then is the regret at the first divergence: under the plain model and the shared prefix, how
far below the plain argmax is the token the other stream picked, relative to the logit scale. A tie flip has a
regret of rounding size; a real bug (wrong cache row, wrong rollback) picks a token far below the best.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edgespec.models.decoder import TargetModel

# Relative regret accepted at a first divergence in bf16/fp16 (bf16 has an 8-bit mantissa: 2^-8 = 0.4% per value).
TIE_REGRET = 0.02


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or of the end of the shorter stream); None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence_regret(model: TargetModel, prompt: Sequence[int], plain: Sequence[int], other: Sequence[int],
                      kv_fp8: bool = False) -> float | None:
    """Relative regret of ``other``'s pick at the first divergence from ``plain`` (None when equal, inf when one
    stream simply stops earlier). 0 means a perfect tie."""
    i = first_divergence(plain, other)
    if i is None:
        return None
    if i >= len(plain) or i >= len(other):
        return float("inf")
    ids = torch.tensor(list(prompt) + list(plain[:i]), device=model.device)
    cache = model.new_cache(ids.shape[0] + 1, kv_fp8=kv_fp8)
    logits = model.prefill(ids, cache).logits[-1].float()
    gap = (logits[plain[i]] - logits[other[i]]).item()
    return max(gap, 0.0) / max(logits.abs().max().item(), 1e-6)


def stream_regrets(model: TargetModel, prompt: Sequence[int], stream: Sequence[int], kv_fp8: bool = False,
                   chunk: int = 256) -> list[float]:
    """Relative regret (see :func:`divergence_regret`) of every token of ``stream`` under the model fed the prompt
    and the stream's own earlier tokens: 0 where the token is the argmax, rounding size where it is a near-tie.
    One teacher-forced pass of ``chunk`` rows at a time (every row's logits, bounded memory)."""
    ids = list(prompt) + list(stream[:-1])
    if not stream:
        return []
    cache = model.new_cache(len(ids) + 1, kv_fp8=kv_fp8)
    first = len(prompt) - 1                        # the row whose logits pick stream[0]
    regrets: list[float] = []
    for s in range(0, len(ids), chunk):
        rows = model.forward(torch.tensor(ids[s:s + chunk], device=model.device), cache, logits="all").logits
        lo = max(first - s, 0)
        if lo >= rows.shape[0]:
            continue
        logits = rows[lo:].float()
        picked = torch.tensor(stream[s + lo - first:s + lo - first + logits.shape[0]], device=logits.device)
        gap = logits.max(dim=-1).values - logits.gather(1, picked[:, None])[:, 0]
        scale = logits.abs().max(dim=-1).values.clamp_min(1e-6)
        regrets.extend((gap.clamp_min(0.0) / scale).tolist())
    return regrets


def lossless(model: TargetModel, prompt: Sequence[int], plain: Sequence[int], other: Sequence[int],
             kv_fp8: bool = False, tolerance: float = TIE_REGRET) -> bool:
    """Exact equality in fp32. In lower precision, equality, or a tie flip at the first divergence after which
    ``other`` stays a greedy stream of the model: every token from the divergence on within ``tolerance`` of the
    argmax given ``other``'s own prefix (a tie flip changes the path, so the tokens after it cannot be compared
    with ``plain``'s, but each must still be the model's choice; a wrong cache row or rollback after a flip
    shows up there)."""
    if list(plain) == list(other):
        return True
    if model.dtype == torch.float32:
        return False
    i = first_divergence(plain, other)
    if i >= len(plain) or i >= len(other):
        return False                               # one stream stopped early: not a tie
    return max(stream_regrets(model, prompt, other, kv_fp8)[i:]) <= tolerance


def tie_check(model: TargetModel, prompt: Sequence[int], plain: Sequence[int], other: Sequence[int],
              kv_fp8: bool = False) -> dict[str, object]:
    """Where ``other`` leaves ``plain`` and why, for reports: ``first_divergence`` (index), ``regret`` (see
    :func:`divergence_regret`) and ``tie_flip`` (the regret is of rounding size, :data:`TIE_REGRET`)."""
    regret = divergence_regret(model, prompt, plain, other, kv_fp8)
    return {"first_divergence": first_divergence(plain, other), "regret": regret,
            "tie_flip": regret is not None and regret <= TIE_REGRET}


def describe_divergence(check: dict[str, object]) -> str:
    """One line for a :func:`tie_check` result: ``tie flip at token 23 (regret 0.00%)`` or ``NOT A TIE ...``."""
    kind = "tie flip" if check["tie_flip"] else "NOT A TIE"
    return f"{kind} at token {check['first_divergence']} (regret {check['regret']:.2%})"
