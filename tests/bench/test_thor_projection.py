"""tools/thor_projection.py: each stage takes the slower of its byte time on Thor and its SM-scaled measured time;
bad inputs are refused by name."""

from __future__ import annotations

import json

import pytest
from _tools import load_tool

proj = load_tool("thor_projection")


def _bench(tmp_path, **over):
    # A GPU with 10x Thor's SM-clock product: 200 SMs at 1575 MHz.
    data = {"shape": "qwen3.5-27b", "format": "int4", "device": "test GPU", "sms": 200, "sm_clock_mhz": 1575,
            "verify_bytes": 27.3e9, "max_len": 2048, "dflash-int4_draft_bytes": 2.73e9,
            "dflash-int4": {"verify_ms_per_cycle": 20.0, "draft_ms_per_cycle": 0.5, "accept_rollback_ms_per_cycle": 0.1,
                            "other_ms_per_cycle": 0.0, "peak_GB": 21.0},
            "ngram": {"verify_ms_per_cycle": 1.0}}
    data.update(over)
    path = tmp_path / "cycle_bench.json"
    path.write_text(json.dumps(data))
    return path, data


def test_stage_bounds_and_rate(tmp_path, capsys):
    path, data = _bench(tmp_path)
    p = proj.project({**data["dflash-int4"], "draft_bytes": 2.73e9}, data, al=4.0, clock_mhz=1575)
    v, d, a = p["stages"]["verify"], p["stages"]["draft"], p["stages"]["accept"]
    assert v["bytes_ms"] == pytest.approx(100.0) and v["sm_ms"] == pytest.approx(200.0) and v["bound"] == "SMs"
    assert d["bytes_ms"] == pytest.approx(10.0) and d["sm_ms"] == pytest.approx(5.0) and d["bound"] == "bytes"
    assert a["ms"] == pytest.approx(1.0)
    assert p["cycle_ms"] == pytest.approx(211.0) and p["tok_s"] == pytest.approx(4.0 / 0.211)
    assert p["byte_limit_tok_s"] == pytest.approx(4.0 / 0.110)
    assert proj.main([str(path), "--al", "4.0"]) == 0
    out = capsys.readouterr().out
    assert "PROJECTION" in out and "dflash-int4" in out and "ngram" not in out.split("measured on")[0]


def test_full_chip_kernel_estimate(tmp_path, capsys):
    path, data = _bench(tmp_path, **{"dflash-int4_drafter_bytes": 0.273e9, "dflash-int4_head_bytes": 2.457e9})
    # 5 bytes per SM-clock for int4, 10 for bf16: Thor does 20 x 1575e6 = 31.5e9 SM-clocks per second.
    stack = tmp_path / "quant_bench.json"
    stack.write_text(json.dumps({"shapes": {"qwen3.5-27b": {
        "int4": {"filled": {"bytes_per_sm_clock_16": 5.0}}, "bf16": {"filled": {"bytes_per_sm_clock_16": 10.0}}}}}))
    run = {**data["dflash-int4"], "draft_bytes": 2.73e9, "drafter_bytes": 0.273e9, "head_bytes": 2.457e9,
           "drafter_weights": "int4"}
    p = proj.project(run, data, al=4.0, clock_mhz=1575, rates=proj.stack_rates(str(stack), "qwen3.5-27b"))
    v, d = p["stages"]["verify"], p["stages"]["draft"]
    # the verify's head (no head_bytes in the file: the draft's, 2.457 GB) at the bf16 rate, the rest at int4's
    assert v["kernel_ms"] == pytest.approx(((27.3e9 - 2.457e9) / 5 + 2.457e9 / 10) / 31.5e9 * 1e3)
    assert v["kernel_bound"] == "SMs"
    assert d["kernel_ms"] == pytest.approx(10.0) and d["kernel_bound"] == "bytes"    # 2.73 GB at 273 GB/s
    assert p["kernel_tok_s"] > p["tok_s"]
    assert proj.main([str(path), "--stack-json", str(stack)]) == 0
    assert "full-chip" in capsys.readouterr().out
    stack.write_text(json.dumps({"shapes": {}}))
    assert proj.main([str(path), "--stack-json", str(stack)]) == 2
    assert "no full-chip rate" in capsys.readouterr().err


def test_bad_inputs(tmp_path, capsys):
    assert proj.main([str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    path, _ = _bench(tmp_path, sms=None)
    assert proj.main([str(path)]) == 2
    assert "no sms" in capsys.readouterr().err
