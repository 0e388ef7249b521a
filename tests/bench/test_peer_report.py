"""tools/peer_report.py (the llama.cpp peer table) on hand-made llama-bench and quant_bench outputs: which rows
it reads as decode and prefill, and the ratios it prints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _tools import load_tool


def write_run(d: Path) -> None:
    bench = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 10000.0}, {"n_prompt": 2048, "n_gen": 0, "avg_ts": 8000.0},
             {"n_prompt": 0, "n_gen": 128, "avg_ts": 400.0}]
    for f in ("f16", "Q8_0", "Q4_0", "Q4_K_M"):
        (d / f"llamacpp_{f}.json").write_text(json.dumps(bench))
    ours = {"device": "test GPU", "bandwidth_GBps": 3000.0,
            "shapes": {"llama": {"int4": {"us_1": 1250.0}, "bf16": {"us_1": 5000.0}}},
            "prefill": {"llama": {"int4": {"512": {"tok_s": 5000.0}, "2048": {"tok_s": 4000.0}},
                                  "cublas": {"512": {"tok_s": 20000.0}}}}}
    (d / "quant_bench.json").write_text(json.dumps(ours))


def test_llamacpp_rows_by_kind(tmp_path: Path) -> None:
    write_run(tmp_path)
    figs = load_tool("peer_report").llamacpp_figures(tmp_path / "llamacpp_Q4_0.json")
    assert figs == {"pp512": 10000.0, "pp2048": 8000.0, "decode": 400.0}


def test_table_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    write_run(tmp_path)
    monkeypatch.setattr(sys, "argv", ["peer_report", str(tmp_path)])
    assert load_tool("peer_report").main() == 0
    lines = capsys.readouterr().out.splitlines()
    q4 = [ln for ln in lines if ln.strip().startswith("Q4_0")]
    assert len(q4) == 1 and "int4" in q4[0]
    # edgespec int4: 1e6 / 1250 us = 800 tok/s against 400 -> 2.00; prefill 5000 / 10000 = 0.50, 4000 / 8000
    assert q4[0].split()[-3:] == ["2.00", "0.50", "0.50"]
    f16 = [ln for ln in lines if ln.strip().startswith("f16")][0]
    assert f16.split()[-3:] == ["0.50", "2.00", "-"]          # bf16 decode 200 tok/s; prefill from cuBLAS
    assert not [ln for ln in lines if ln.strip().startswith("Q8_0")]   # no fp8 figures in this run: no row


def test_whole_model_gguf_row(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """edgespec on llama.cpp's own Q4_K_M file (gguf_Q4_K_M.json) is the "gguf" row against llama.cpp's Q4_K_M."""
    write_run(tmp_path)
    row = {"format": "int4", "decode_tok_s": 600.0, "prefill_tok_s": {"512": 5000.0}, "peak_bytes": 2e9}
    (tmp_path / "formats_peer.json").write_text(json.dumps({"rows": [row]}))
    gguf_row = {"format": "gguf:Q4_K_M.gguf", "decode_tok_s": 520.0, "prefill_tok_s": {"512": 2500.0,
                                                                                        "2048": 16000.0},
                "peak_bytes": 2.5e9}
    (tmp_path / "gguf_Q4_K_M.json").write_text(json.dumps(gguf_row))
    monkeypatch.setattr(sys, "argv", ["peer_report", str(tmp_path)])
    assert load_tool("peer_report").main() == 0
    lines = capsys.readouterr().out.splitlines()
    gguf = [ln for ln in lines if ln.split()[:1] == ["Q4_K_M"] and "gguf" in ln]
    assert len(gguf) == 1
    assert gguf[0].split()[-3:] == ["1.30", "0.25", "2.00"]     # 520 / 400, 2500 / 10000, 16000 / 8000
