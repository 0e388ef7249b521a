"""The training state a killed run resumes from, and the curve plot, on their own."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest
import torch

from edgespec.distill.checkpoint import STATE_FILE, RunState, load_state, save_state
from edgespec.distill.curve import curve_svg, write_curve
from edgespec.errors import CheckpointError


def _model_and_optim(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(width)
    m = torch.nn.Linear(width, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.ones(1, width)).sum().backward()
    opt.step()
    return m, opt


def test_the_run_state_round_trips_with_weights_and_optimizer(tmp_path) -> None:
    m, opt = _model_and_optim(4)
    st = RunState(step=12, epoch=2, consumed=6, total_steps=40, first_al=1.5, curve=[[1, 3.0, 0.1], [2, 2.5, 0.2]],
                  held_out=[[0, 0, 1.5]], best_al=1.5)
    save_state(tmp_path, m, opt, st)
    m2, opt2 = _model_and_optim(4)
    assert load_state(tmp_path, m2, opt2, torch.device("cpu")) == st
    assert torch.equal(m2.weight, m.weight)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert st.last_loss == 2.5 and st.last_al == 1.5 and RunState().last_al is None
    assert load_state(tmp_path / "fresh", m2, opt2, torch.device("cpu")) == RunState()


def test_a_state_of_another_drafter_is_refused_by_name(tmp_path) -> None:
    save_state(tmp_path, *_model_and_optim(4), RunState(step=3))
    with pytest.raises(CheckpointError, match=f"(?s)cannot resume from .*{STATE_FILE}.*another drafter"):
        load_state(tmp_path, *_model_and_optim(6), torch.device("cpu"))
    (tmp_path / STATE_FILE).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot resume"):
        load_state(tmp_path, *_model_and_optim(4), torch.device("cpu"))


def test_the_curve_plot_is_svg_with_a_line_per_series(tmp_path) -> None:
    curve = [[s, 4.0 / s, 0.1] for s in range(1, 101)] + [[101, math.nan, 0.0]]
    path = write_curve(tmp_path, curve, [[0, 0, 1.2], [50, 0, 2.0], [100, 1, 2.4]], title="a & b")
    root = ET.parse(path).getroot()
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    assert len(lines) == 3 and len(lines[0].get("points").split()) == 100      # the NaN step is left out
    assert (tmp_path / "curve.json").is_file()
    ET.fromstring(curve_svg([], []))                           # no point yet: still a valid picture
