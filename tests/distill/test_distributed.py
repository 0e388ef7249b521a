"""``edgespec distill`` under torchrun (gloo, 2 CPU processes) against one process, and a killed run resumed.

The targets of issue 52 on a tiny target: the distributed loss curve equals the single-process one (same global
batch; within the rounding of the gradient all-reduce), sharded feature extraction writes the same data as one
process, a run killed with SIGKILL resumes from its last checkpoint and continues the same curve, and the trained
drafters keep speculative output equal to plain.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from edgespec.bench.shapes import tiny_config, write_chat_tokenizer, write_random_checkpoint
from edgespec.distill.data import load_data
from edgespec.errors import ConfigError

STEPS = 8


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    folder = write_random_checkpoint(tmp_path_factory.mktemp("target") / "llama", tiny_config("llama"), seed=5)
    return write_chat_tokenizer(folder)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.txt"
    path.write_text("\n".join(f"carry crate {i} to bay {i % 4}" for i in range(12)))
    return path


def _args(target: Path, out: Path, prompts: Path, *extra: str) -> list[str]:
    return ["-m", "edgespec.cli", "distill", "--model", str(target), "--out", str(out), "--prompts", str(prompts),
            "--max-new-tokens", "20", "--gen-batch", "4", "--layers", "1", "--block-size", "4",
            "--intermediate-size", "64", "--anchors", "4", "--holdout-every", "6", "--device", "cpu",
            "--lr", "3e-3", "--warmup", "2", *extra]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _curve(folder: Path) -> list[list[float]]:
    return json.loads((folder / "curve.json").read_text())["loss"]


def _same_as_plain(target: Path, drafter: Path) -> None:
    from edgespec.config import Settings
    from edgespec.engine import Engine, Request
    from edgespec.plan import build_plan

    plain = Engine.load(build_plan(Settings(model=str(target), drafter="none", max_tokens=16)))
    spec = Engine.load(build_plan(Settings(model=str(target), drafter="dflash", drafter_path=str(drafter),
                                         max_tokens=16)))
    for text in ("carry crate 3 to bay 1", "what is a robot?"):
        req = Request(messages=[{"role": "user", "content": text}], max_tokens=16)
        assert spec.complete(req).token_ids == plain.complete(req).token_ids, text


def test_two_processes_follow_the_single_process_curve(tiny_target, prompts, tmp_path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    common = ("--steps", str(STEPS), "--eval-every", "4", "--save-every", "4")
    _run([sys.executable, *_args(tiny_target, one, prompts, "--batch", "4", *common)])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29617"]
    r = _run([*torchrun, *_args(tiny_target, two, prompts, "--batch", "2", *common)])
    assert json.loads(r.stdout.strip().splitlines()[-1])["steps"] == STEPS
    assert json.loads((two / "distill.json").read_text())["world"] == 2
    # Feature extraction sharded over the ranks wrote what one process wrote.
    (_, a), (_, b) = load_data(one / "data"), load_data(two / "data")
    assert [s.tokens.tolist() for s in a] == [s.tokens.tolist() for s in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.taps, y.taps, atol=0, rtol=0)
    # Same global batch (4 sequences a step) and anchors: the same loss at every step, up to the all-reduce's
    # rounding; the loss moved, so the comparison is not of two flat lines.
    c1, c2 = _curve(one), _curve(two)
    assert [p[0] for p in c1] == [p[0] for p in c2] == list(range(1, STEPS + 1))
    for p, q in zip(c1, c2, strict=True):
        assert q[1] == pytest.approx(p[1], rel=1e-3, abs=1e-3), (p, q)
    assert c1[-1][1] < c1[0][1]
    held = [json.loads((f / "distill.json").read_text())["held_out_history"] for f in (one, two)]
    assert [h[2] for h in held[0]] == pytest.approx([h[2] for h in held[1]], abs=1e-3)
    # The plot: an SVG with the loss and the AL lines.
    svg = ET.parse(two / "curve.svg").getroot()
    assert len([e for e in svg.iter() if e.tag.endswith("polyline")]) == 3
    for folder in (one, two):
        _same_as_plain(tiny_target, folder)


def test_a_killed_run_resumes_from_its_last_checkpoint(tiny_target, prompts, tmp_path) -> None:
    steps = "200"
    data = tmp_path / "data"
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    common = ("--steps", steps, "--batch", "2", "--eval-every", "100", "--save-every", "5", "--data", str(data))
    _run([sys.executable, *_args(tiny_target, whole, prompts, *common)])
    proc = subprocess.Popen([sys.executable, *_args(tiny_target, killed, prompts, *common)], text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for line in proc.stderr:                 # a progress line per step; the checkpoint of step 10 follows it
            if f" 12/{steps} " in line:
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=60)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    saved = torch.load(killed / "train_state.pt", weights_only=True)["run"]
    assert 10 <= saved["step"] < int(steps) and saved["step"] % 5 == 0
    r = _run([sys.executable, *_args(tiny_target, killed, prompts, *common)])
    progress = [line for line in r.stderr.splitlines() if f"/{steps} " in line]
    assert f" {saved['step']}/{steps} " in progress[0]           # it started where the checkpoint stood
    assert json.loads(r.stdout.strip().splitlines()[-1])["steps"] == int(steps)
    # The whole curve, before and after the kill, is the uninterrupted run's.
    assert _curve(killed) == _curve(whole)
    a = json.loads((whole / "distill.json").read_text())
    b = json.loads((killed / "distill.json").read_text())
    assert b["held_out_history"] == a["held_out_history"] and b["loss"] == a["loss"]


def test_an_unknown_drafter_kind_is_refused(tiny_target, prompts, tmp_path) -> None:
    from edgespec.distill.kinds import drafter_kind

    assert drafter_kind("dflash").name == "dflash"
    with pytest.raises(ConfigError, match="--drafter-kind 'eagle' is not one of dflash"):
        drafter_kind("eagle")
    r = subprocess.run([sys.executable, *_args(tiny_target, tmp_path / "x", prompts, "--drafter-kind", "eagle")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--drafter-kind 'eagle'" in r.stderr
