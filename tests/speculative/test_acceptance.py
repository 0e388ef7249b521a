"""Acceptance policies: strict greedy, relaxed thinking (unit rules), rejection sampling (distribution test)."""

from __future__ import annotations

import math

import pytest
import torch

from edgespec.errors import RequestError
from edgespec.speculative.acceptance import RejectionSampling, RelaxedThinking, StrictGreedy
from edgespec.speculative.sampling import SamplingParams, target_probs

OPEN, CLOSE = 90, 91
V = 100


def _logits(rows: list[dict[int, float]]) -> torch.Tensor:
    """Rows of logits: -10 everywhere except the given ids."""
    x = torch.full((len(rows), V), -10.0)
    for i, row in enumerate(rows):
        for tok, val in row.items():
            x[i, tok] = val
    return x


def test_strict_greedy_prefix_and_bonus():
    logits = _logits([{5: 3.0}, {6: 3.0}, {7: 3.0}, {8: 3.0}])
    v = StrictGreedy().accept(logits, torch.tensor([5, 6, 9]), None)
    assert v.accepted == 2 and v.tokens == [5, 6, 7]
    v = StrictGreedy().accept(logits, torch.tensor([5, 6, 7]), None)
    assert v.accepted == 3 and v.tokens == [5, 6, 7, 8]


@pytest.mark.parametrize("drafts", [[5, 6, 9], [5, 6, 7], [1, 6, 7], [5]])
@pytest.mark.parametrize("pad", [0, 3])
def test_strict_greedy_reads_the_device_verdict(drafts, pad):
    """With the verify graph's verdict (edgespec.kernels.verify.argmax.greedy_verdict) the policy reads its tokens from
    it and decides exactly as from the logits, also when a static forward padded the rows: padding rows may 'match'
    (here they continue the chain on purpose), so the count is capped at the real drafts."""
    from edgespec.kernels.verify.argmax import greedy_verdict
    logits = _logits([{5: 3.0}, {6: 3.0}, {7: 3.0}, {8: 3.0}])[:len(drafts) + 1]
    rows = torch.tensor([4, *drafts, *[int(logits[-1].argmax())] * pad])
    padded = torch.cat([logits, logits[-1:].expand(pad, -1)])          # padding rows score like the last one
    greedy = greedy_verdict(padded, rows)
    want = StrictGreedy().accept(logits, torch.tensor(drafts), None)
    got = StrictGreedy().accept(logits, torch.tensor(drafts), None, greedy)
    assert (got.accepted, got.tokens) == (want.accepted, want.tokens)
    assert StrictGreedy().next_token(logits[0], greedy) == StrictGreedy().next_token(logits[0]) == 5


def _relaxed(prompt=(1, OPEN), **kw) -> RelaxedThinking:
    p = RelaxedThinking(OPEN, CLOSE, **kw)
    p.begin(list(prompt))
    return p


def test_relaxed_accepts_top_k_within_margin_inside_think():
    logits = _logits([{5: 3.0, 6: 2.5, 7: 2.2, 8: 1.0}, {9: 1.0}])
    assert _relaxed(top_k=3, delta=1.0).accept(logits, torch.tensor([6]), None).tokens == [6, 9]
    # In the top-k but outside the margin (3.0 - 1.0 > 1.0): rejected, bonus is the argmax.
    assert _relaxed(top_k=4, delta=1.0).accept(logits, torch.tensor([8]), None).tokens == [5]
    # Within the margin but outside the top-k (7 is third; top_k=2): rejected.
    assert _relaxed(top_k=2, delta=1.0).accept(logits, torch.tensor([7]), None).tokens == [5]


def test_relaxed_margin_in_probability():
    logits = _logits([{5: 3.0, 6: 2.9}, {9: 1.0}])        # probs ~0.52 / 0.47: 0.05 apart
    assert _relaxed(margin="prob", delta=0.1).accept(logits, torch.tensor([6]), None).accepted == 1
    assert _relaxed(margin="prob", delta=0.01).accept(logits, torch.tensor([6]), None).accepted == 0


def test_relaxed_is_strict_outside_think_and_after_close():
    logits = _logits([{5: 3.0, 6: 2.9}, {9: 1.0}])
    # The prompt's last marker is a close: not thinking (a non-thinking Qwen template ends with <think></think>).
    assert _relaxed(prompt=(OPEN, 3, CLOSE)).accept(logits, torch.tensor([6]), None).accepted == 0
    assert _relaxed(prompt=(CLOSE, 3, OPEN)).accept(logits, torch.tensor([6]), None).accepted == 1
    # A draft closing the block must match exactly, and everything after it is strict.
    logits = _logits([{CLOSE: 3.0}, {5: 3.0, 6: 2.9}, {7: 1.0}])
    v = _relaxed().accept(logits, torch.tensor([CLOSE, 6]), None)
    assert v.tokens == [CLOSE, 5]
    logits = _logits([{4: 3.0, CLOSE: 2.9}, {7: 1.0}])
    assert _relaxed().accept(logits, torch.tensor([CLOSE]), None).tokens == [4]


def test_relaxed_phase_follows_committed_tokens():
    p = _relaxed()
    assert p.in_think
    p.observe([3, CLOSE, 4])
    assert not p.in_think
    p.observe([OPEN])
    assert p.in_think


def test_sampling_params_validated():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(temperature=9)):
        with pytest.raises(RequestError):
            SamplingParams(**bad)


def test_tiny_temperature_is_greedy_not_nan():
    assert SamplingParams(temperature=1e-9).greedy and not SamplingParams(temperature=0.1).greedy


def test_target_probs_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p[2] == 0 and p[3] == 0 and math.isclose(p.sum().item(), 1.0, rel_tol=1e-6)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0] == 1.0


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("draft_probs", [False, True], ids=["greedy-draft", "sampled-draft"])
def test_rejection_sampling_preserves_distribution(draft_probs):
    """Over many seeds, the first two emitted tokens of speculative sampling follow the plain joint law."""
    torch.manual_seed(0)
    vocab = 6
    # Target rows: row 0 judges draft 0, row 1 judges draft 1; the bonus comes from the row after.
    logits = torch.randn(3, vocab) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    p = target_probs(logits, params)
    q = torch.softmax(torch.randn(2, vocab), -1)
    n = 8000
    counts = torch.zeros(vocab)
    second = torch.zeros(vocab)      # second token, given the first was the (greedy) draft 2
    gen = torch.Generator().manual_seed(1)
    policy = RejectionSampling(params, gen)
    for _ in range(n):
        if draft_probs:
            drafts = torch.multinomial(q, 1, generator=gen)[:, 0]
            v = policy.accept(logits, drafts, q)
        else:
            v = policy.accept(logits, torch.tensor([2, 3]), None)
            if v.tokens[0] == 2:
                second[v.tokens[1]] += 1
        counts[v.tokens[0]] += 1
    # The first emitted token must follow p[0] exactly (plain sampling of the first position).
    chi2 = _chi_square(counts, p[0])
    dof = int((p[0] > 0).sum()) - 1
    # 99.9% quantile of chi-square with <= 5 dof is 20.5.
    assert dof <= 5 and chi2 < 20.5, (chi2, counts / n, p[0])
    if not draft_probs and second.sum() > 500:
        # Given token 0 == draft 2, the next token must follow row 1 of the target.
        assert _chi_square(second, p[1]) < 20.5
