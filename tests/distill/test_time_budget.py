"""``edgespec distill --time-budget``: the step count is fitted to the remaining seconds once steps are timed."""

from __future__ import annotations

from edgespec.distill.train import TrainOptions, fit_steps


def test_no_budget_keeps_the_step_count() -> None:
    assert fit_steps(TrainOptions(steps=400), step=10, elapsed_s=5.0, step_s=0.5, eval_s=1.0) == 400


def test_budget_cuts_steps_to_what_fits() -> None:
    opts = TrainOptions(steps=10_000, eval_every=100, time_budget_s=120.0)
    # 120 s budget, 20 s gone, 2 s for the final evaluation: 98 s left at 0.5 s + 2 s / 100 per step.
    assert fit_steps(opts, step=10, elapsed_s=20.0, step_s=0.5, eval_s=2.0) == 10 + int(98.0 / 0.52)


def test_budget_never_raises_the_step_count_or_goes_below_done_steps() -> None:
    assert fit_steps(TrainOptions(steps=50, time_budget_s=1e6), 10, 1.0, 0.1, 0.1) == 50
    assert fit_steps(TrainOptions(steps=50, time_budget_s=1.0), 10, 30.0, 0.1, 0.1) == 10
