"""Acceptance policies: which draft tokens a verify forward accepts, and the token that follows them.

A verify forward scores K+1 rows ``[current, d_1 .. d_K]``; row i predicts the token after row i's input, so draft
``d_{i+1}`` is judged against row i. Every policy returns the accepted count n and the committed tokens
``d_1 .. d_n, t`` where t (the "bonus") comes from row n.

* :class:`StrictGreedy` (default): accept while the draft equals the argmax. Output equals plain greedy decoding.
* :class:`RelaxedThinking` (opt-in, lossy): inside a ``<think>`` block accept a draft that is in the verify top-k
  and within a margin of the best (in logits, or in probability after softmax); strict from the first draft that
  closes the block. The phase is tracked from committed tokens, starting at the LAST think marker of the prompt.
* :class:`RejectionSampling` (temperature > 0): accept d with probability min(1, p(d) / q(d)); on rejection draw
  from normalise(max(p - q, 0)). The output has exactly the plain-sampling distribution.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgespec.errors import ConfigError
from edgespec.speculative.sampling import SamplingParams, sample_token, target_probs


@dataclass
class Verdict:
    """Outcome of one verify: ``accepted`` drafts, then ``tokens`` = accepted drafts + the next token."""

    accepted: int
    tokens: list[int]


class AcceptancePolicy(ABC):
    """Chooses tokens from target logits; may keep per-request state (seeded in :meth:`begin`)."""

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Reset per-request state from the prompt."""

    def observe(self, tokens: Sequence[int]) -> None:
        """Called with every batch of committed tokens (phase tracking)."""

    @abstractmethod
    def next_token(self, logits: torch.Tensor, greedy: torch.Tensor | None = None) -> int:
        """Pick the token after a row with ``logits [V]`` (prefill and plain decode steps). ``greedy``: the
        forward's device-side greedy verdict (see :class:`~edgespec.models.decoder.ForwardOutput`), when it has
        one and no constraint changed the logits; greedy policies read their token from it."""

    @abstractmethod
    def accept(self, logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
               greedy: torch.Tensor | None = None) -> Verdict:
        """Judge ``drafts [K]`` against verify ``logits [K+1, V]``; ``greedy`` as in :meth:`next_token`."""


class StrictGreedy(AcceptancePolicy):
    """Lossless greedy acceptance: longest prefix of drafts equal to the target argmax."""

    def next_token(self, logits: torch.Tensor, greedy: torch.Tensor | None = None) -> int:
        return int(logits.argmax(-1)) if greedy is None else int(greedy[1])

    def accept(self, logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
               greedy: torch.Tensor | None = None) -> Verdict:
        K = drafts.shape[0]
        if greedy is not None:
            # The verdict the verify graph computed: one host copy. Its count may include padding rows of a
            # static forward longer than K + 1: cap it at K.
            host = greedy[:K + 2].tolist()
            n = min(host[0], K)
            return Verdict(n, host[1:2 + n])
        targets = logits.argmax(-1)                                     # [K+1]
        match = (drafts == targets[:-1]).int()
        n = match.cumprod(0).sum()
        # One host transfer per cycle: the count and all target ids together (accepted drafts equal their targets).
        host = torch.cat([n.view(1), targets]).tolist()
        n = host[0]
        return Verdict(n, host[1:2 + n])


class RelaxedThinking(StrictGreedy):
    """Greedy acceptance relaxed inside think blocks (see module doc). Opt-in: output can differ from greedy."""

    def __init__(self, think_open: int, think_close: int, top_k: int = 3, delta: float = 1.0,
                 margin: str = "logit") -> None:
        if margin not in ("logit", "prob"):
            raise ConfigError(f"relaxed_margin {margin!r} must be 'logit' or 'prob'")
        self.think_open, self.think_close = think_open, think_close
        self.top_k, self.delta, self.margin = top_k, delta, margin
        self.in_think = False
        self.relaxed_accepts = 0  # drafts accepted only because of the relaxation (telemetry)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.in_think = False
        self.relaxed_accepts = 0
        self.observe(prompt_ids)

    def observe(self, tokens: Sequence[int]) -> None:
        # The last marker decides: a non-thinking Qwen prompt ends with "<think>\n\n</think>".
        for t in reversed(tokens):
            if t == self.think_open:
                self.in_think = True
                return
            if t == self.think_close:
                self.in_think = False
                return

    def accept(self, logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
               greedy: torch.Tensor | None = None) -> Verdict:
        if not self.in_think:
            return super().accept(logits, drafts, draft_probs, greedy)
        K = drafts.shape[0]
        scores = logits.float() if self.margin == "logit" else torch.softmax(logits.float(), dim=-1)
        top_vals, top_ids = scores.topk(self.top_k, dim=-1)             # [K+1, k]
        draft_scores = scores[:-1].gather(1, drafts.view(-1, 1))[:, 0]
        in_top = (top_ids[:-1] == drafts.view(-1, 1)).any(-1)
        close = (top_vals[:-1, 0] - draft_scores) <= self.delta
        # One host transfer: drafts, their relaxed verdicts and the best ids of every row.
        host = torch.cat([drafts, (in_top & close).long(), top_ids[:, 0]]).tolist()
        host_drafts, host_ok, host_best = host[:K], host[K:2 * K], host[2 * K:]
        n = 0
        thinking = True
        for i in range(K):
            d = host_drafts[i]
            exact = d == host_best[i]
            # Strict from the first draft that closes the think block (and for everything after it).
            ok = exact if (not thinking or d == self.think_close) else host_ok[i]
            if not ok:
                break
            if not exact:
                self.relaxed_accepts += 1
            if d == self.think_close:
                thinking = False
            n += 1
        return Verdict(n, host_drafts[:n] + [host_best[n]])


class RejectionSampling(AcceptancePolicy):
    """Speculative sampling that preserves the target distribution (temperature > 0)."""

    def __init__(self, params: SamplingParams, generator: torch.Generator) -> None:
        self.params = params
        self.gen = generator

    def next_token(self, logits: torch.Tensor, greedy: torch.Tensor | None = None) -> int:
        return int(sample_token(logits, self.params, self.gen))

    def accept(self, logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
               greedy: torch.Tensor | None = None) -> Verdict:
        p = target_probs(logits, self.params)                           # [K+1, V]
        K = drafts.shape[0]
        rows = torch.arange(K, device=p.device)
        p_d = p[rows, drafts]
        if draft_probs is None:                                        # deterministic draft: q is one-hot
            q_d = torch.ones_like(p_d)
        else:
            q_d = draft_probs[rows, drafts]
        u = torch.rand(K, generator=self.gen, device=p.device)
        ok = (u * q_d <= p_d).int()                                      # u < min(1, p/q)
        n = int(ok.cumprod(0).sum())
        if n == K:
            bonus = torch.multinomial(p[K], 1, generator=self.gen)
        else:
            q_row = (torch.nn.functional.one_hot(drafts[n], p.shape[-1]).to(p.dtype) if draft_probs is None
                     else draft_probs[n])
            residual = (p[n] - q_row).clamp_min(0.0)
            total = residual.sum()
            # total == 0 only when p == q exactly, where rejection has probability 0; guard rounding anyway.
            residual = residual / total if total > 0 else p[n]
            bonus = torch.multinomial(residual, 1, generator=self.gen)
        return Verdict(n, drafts[:n].tolist() + [int(bonus)])
