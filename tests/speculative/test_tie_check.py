"""``edgespec bench`` (through ``edgespec.speculative.parity.tie_check``) names why a bf16 speculative stream
left the plain one: the first differing token and its regret under the plain model, a tie flip (the runner-up,
rounding-size regret) told apart from a real error (a token far below the best)."""

from __future__ import annotations

import torch

from edgespec.arch.base import ArchHooks
from edgespec.bench.shapes import tiny_config, write_random_checkpoint
from edgespec.loading.checkpoint import load_target
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.parity import describe_divergence, lossless, stream_regrets, tie_check
from edgespec.speculative.session import SpecSession


def test_tie_flip_and_real_error_told_apart(tmp_path) -> None:
    model = load_target(write_random_checkpoint(tmp_path / "m", tiny_config("llama"), seed=5), dtype=torch.bfloat16,
                        device="cpu", max_positions=256)
    prompt = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    plain = SpecSession.with_defaults(model, ArchHooks(), None, max_len=256).generate(
        prompt, max_tokens=8, policy=StrictGreedy()).token_ids
    cache = model.new_cache(64)
    logits = model.prefill(torch.tensor(prompt + plain[:3]), cache).logits[-1].float()
    order = logits.argsort(descending=True).tolist()
    assert order[0] == plain[3]

    worst = plain[:3] + [order[-1]] + plain[4:]
    res = tie_check(model, prompt, plain, worst)
    assert res["first_divergence"] == 3 and not res["tie_flip"] and res["regret"] > 0.02
    assert describe_divergence(res).startswith("NOT A TIE at token 3 (regret ")

    gap = float(logits[order[0]] - logits[order[1]]) / float(logits.abs().max())
    runner_up = tie_check(model, prompt, plain, plain[:3] + [order[1]] + plain[4:])
    assert runner_up["first_divergence"] == 3 and abs(runner_up["regret"] - gap) < 1e-6
    assert runner_up["tie_flip"] == (gap <= 0.02)
    assert tie_check(model, prompt, plain, plain[:5])["regret"] == float("inf")      # one stream stops early


def test_lossless_checks_every_token_after_a_tie_flip(tmp_path) -> None:
    """A bf16 stream that tie-flips and then stays the model's greedy choice is lossless; one that tie-flips and then
    emits garbage (a wrong cache row after the flip, say) is not. The first-divergence check alone passed both."""
    model = load_target(write_random_checkpoint(tmp_path / "m", tiny_config("llama"), seed=5), dtype=torch.bfloat16,
                        device="cpu", max_positions=256)
    prompt = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    session = SpecSession.with_defaults(model, ArchHooks(), None, max_len=256)
    plain = session.generate(prompt, max_tokens=12, policy=StrictGreedy()).token_ids
    logits = model.prefill(torch.tensor(prompt + plain[:3]), model.new_cache(64)).logits[-1].float()
    runner_up = logits.argsort(descending=True)[1].item()
    flip = plain[:3] + [runner_up]
    # The runner-up as the flip; the tolerance is set to its regret so the flip itself counts as a tie.
    tolerance = tie_check(model, prompt, plain, flip + plain[4:])["regret"] + 1e-3
    after = session.generate(prompt + flip, max_tokens=8, policy=StrictGreedy()).token_ids
    assert lossless(model, prompt, plain, flip + after, tolerance=tolerance)
    regrets = stream_regrets(model, prompt, flip + after)
    worst = [int(t) for t in logits.argsort()[:8]]           # tokens far below the best anywhere after the flip
    garbage = flip + after[:2] + [next(t for t in worst if t != after[2])] + after[3:]
    assert max(regrets) <= tolerance and max(stream_regrets(model, prompt, garbage)) > tolerance
    assert not lossless(model, prompt, plain, garbage, tolerance=tolerance)
