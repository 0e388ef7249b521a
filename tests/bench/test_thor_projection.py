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


# ---- measured SM budgets (--sm-runs, --stacks) -------------------------------------------------------------

def test_interpolation_is_linear_in_rate() -> None:
    # 16 SMs: 40 ms (0.025 per ms), 24 SMs: 20 ms (0.05 per ms) -> 20 SMs: 0.0375 per ms = 26.7 ms
    assert proj.interpolate_ms({16: 40.0, 24: 20.0}, 20) == pytest.approx(1 / 0.0375)
    assert proj.interpolate_ms({16: 40.0, 24: 20.0, 20: 30.0}, 20) == 30.0
    assert proj.interpolate_ms({8: 80.0, 16: 40.0, 24: 20.0, 132: 1.0}, 20) == pytest.approx(1 / 0.0375)
    with pytest.raises(ValueError, match="do not bracket 20"):
        proj.interpolate_ms({16: 40.0, 8: 80.0}, 20)


def _sm_run(tmp_path, sms: int, verify_ms: float, draft_ms: float, name: str | None = None):
    data = {"shape": "qwen3.5-27b", "format": "int4", "lm_head": "int4", "device": "test GPU", "sms": sms,
            "sm_clock_mhz": 1575 * 2, "verify_bytes": 25.9e9, "max_len": 32768, "dflash-int4_draft_bytes": 2.59e9,
            "sm_limit": {"requested": sms, "granted": sms, "device_sms": 132},
            "dflash-int4": {"verify_ms_per_cycle": verify_ms, "draft_ms_per_cycle": draft_ms,
                            "accept_rollback_ms_per_cycle": 1.0, "other_ms_per_cycle": 0.0, "peak_GB": 19.0}}
    path = tmp_path / (name or f"c{sms}.json")
    path.write_text(json.dumps(data))
    return path, data


def test_measured_sm_projection(tmp_path, capsys) -> None:
    p16, d16 = _sm_run(tmp_path, 16, verify_ms=80.0, draft_ms=4.0)
    p24, d24 = _sm_run(tmp_path, 24, verify_ms=40.0, draft_ms=2.0)
    runs = {16: {**d16["dflash-int4"], "draft_bytes": 2.59e9}, 24: {**d24["dflash-int4"], "draft_bytes": 2.59e9}}
    p = proj.project_measured(runs, {16: d16, 24: d24}, [4.0, 8.0], clock_mhz=1575)
    v, d, a = p["stages"]["verify"], p["stages"]["draft"], p["stages"]["accept"]
    # verify: 1/80 and 1/40 per ms -> 20 SMs at 3/160 per ms = 53.33 ms, x2 for the clock = 106.7 ms; its 25.9 GB
    # at 259 GB/s = 100 ms: SM-bound
    assert v["ms_20_sms"] == pytest.approx(160 / 3) and v["sm_ms"] == pytest.approx(320 / 3)
    assert v["bytes_ms"] == pytest.approx(100.0) and v["bytes_ms_spec"] == pytest.approx(25.9e9 / 273e9 * 1e3)
    assert v["bound"] == "SMs" and v["ms"] == pytest.approx(320 / 3)
    # draft: 5.33 ms of SM time against 10 ms of bytes: byte-bound
    assert d["bound"] == "bytes" and d["ms"] == pytest.approx(10.0)
    assert a["ms"] == pytest.approx(2.0)      # 1 ms at both counts, x2 clock, no bytes
    assert p["cycle_ms"] == pytest.approx(320 / 3 + 10 + 2)
    assert p["tok_s"][8.0] == pytest.approx(8.0 / p["cycle_ms"] * 1e3)
    assert p["byte_limit_tok_s"][4.0] == pytest.approx(4.0 / 110 * 1e3)
    assert proj.main(["--sm-runs", str(p16), str(p24), "--als", "4.57,6"]) == 0
    out = capsys.readouterr().out
    assert "measured SM budgets" in out and "assumptions" in out and "dflash-int4" in out and "AL 6" in out


def test_measured_sm_bad_inputs(tmp_path, capsys) -> None:
    p16, _ = _sm_run(tmp_path, 16, 80.0, 4.0)
    full, _ = _bench(tmp_path)        # a full-chip file: no sm_limit
    assert proj.main(["--sm-runs", str(p16), str(full)]) == 2
    assert "not a cycle_bench.json written with --sm-limit" in capsys.readouterr().err
    assert proj.main(["--sm-runs", str(p16)]) == 2                    # one budget cannot bracket 20
    assert "do not bracket 20" in capsys.readouterr().err
    again, _ = _sm_run(tmp_path, 16, 70.0, 4.0, name="again.json")
    assert proj.main(["--sm-runs", str(p16), str(again)]) == 2
    assert "a second run of qwen3.5-27b int4 int4 on 16 SMs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        proj.main([])


def test_stack_projection(tmp_path, capsys) -> None:
    paths = []
    for sms, us in ((16, 100_000.0), (24, 50_000.0)):
        data = {"sm_clock_mhz": 1575, "sm_limit": {"requested": sms, "granted": sms},
                "shapes": {"qwen3.5-27b": {"int4": {"bytes": 20e9, "us_1": us, "us_16": 2 * us}}}}
        path = tmp_path / f"q{sms}.json"
        path.write_text(json.dumps(data))
        paths.append(str(path))
    assert proj.main(["--stacks", *paths]) == 0
    out = capsys.readouterr().out
    # 1 row: 0.01 and 0.02 per ms -> 0.015 at 20 SMs = 66.7 ms at the same clock = 300 GB/s (byte-bound: 100%);
    # 16 rows 150 GB/s, 58% of 259
    assert "1:  300 (100%)" in out and "16:  150 ( 58%)" in out
    assert proj.main(["--stacks", str(tmp_path / "none.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def _moe_run(tmp_path, sms, decode_ms, verify4_ms, name=None):
    """A tools/moe_int4_bench.py model file: bandwidth 1000 GB/s, so limit ms x 1e9 = bytes."""
    data = {"device": "test GPU", "sms": sms, "sm_clock_mhz": 1575, "sm_limit": sms, "bandwidth_GBps": 1000.0,
            "decode_ms": decode_ms, "decode_limit_ms": 1.5, "head_bytes": 0.25e9,
            "moe": {"layers": 40, "top_k": 8, "per_expert_MB": 1.5},
            "verify": {"4": {"ms": verify4_ms, "limit_ms": 3.0, "expert_union": 28.0}}}
    path = tmp_path / (name or f"moe{sms}.json")
    path.write_text(json.dumps(data))
    return str(path)


def test_moe_projection(tmp_path, capsys) -> None:
    """Decode and a K=3 MTP-class cycle of an MoE target: times interpolated to 20 SMs (rate linear), against
    bytes at 259 GB/s; the draft step's bytes are one layer's dense share, k experts and the head."""
    files = [_moe_run(tmp_path, 16, 8.0, 16.0), _moe_run(tmp_path, 24, 6.0, 12.0)]
    p = proj.moe_projection(files, [2.87], 1575, 3)
    at20 = 1 / ((1 / 8.0 + 1 / 6.0) / 2)
    assert p["decode"]["sm_ms"] == pytest.approx(at20) and p["decode"]["bound"] == "SMs"
    assert p["decode"]["bytes"] == pytest.approx(1.5e9)
    assert p["verify"]["sm_ms"] == pytest.approx(2 * at20) and p["verify"]["bytes_ms"] == pytest.approx(3e9 / 259e6)
    layer_dense = (1.5e9 - 40 * 8 * 1.5e6 - 0.25e9) / 40
    assert p["draft_bytes"] == pytest.approx(layer_dense + 8 * 1.5e6 + 0.25e9)
    assert p["cycle_ms"] == pytest.approx(2 * at20 + 3 * at20 * p["draft_bytes"] / 1.5e9)
    assert p["tok_s"][2.87] == pytest.approx(2.87 / p["cycle_ms"] * 1e3)
    assert proj.main(["--moe", *files]) == 0
    assert "expert union per layer assumed 28.0 (16), 28.0 (24)" in capsys.readouterr().out
    assert proj.main(["--moe", *files, "--mtp-k", "1"]) == 2
    assert "no verify of 2 rows" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"sms": 16}))
    assert proj.main(["--moe", str(bad)]) == 2
    assert "not a tools/moe_int4_bench.py model file" in capsys.readouterr().err


def _tree_cost(tmp_path, chain_ms: float = 40.0) -> tuple:
    data = {"shape": "qwen3.5-27b", "format": "int4", "lm_head": "int4", "device": "test GPU", "sms": 132,
            "sm_clock_mhz": 3150, "graphs": True, "sm_limit": {"requested": 16, "granted": 16},
            "chain_base_ms": chain_ms,
            "trees": [{"rows": 33, "budget": 32, "tree_ms": 48.0, "commit_ms": 2.0, "tree_over_chain_base": 1.2},
                      {"rows": 64, "budget": 63, "tree_ms": 60.0, "commit_ms": 2.0, "tree_over_chain_base": 1.5}]}
    path = tmp_path / "tree16.json"
    path.write_text(json.dumps(data))
    return path, data


def test_tree_cycle_projection(tmp_path, capsys) -> None:
    """The DFlash chain cycle of --sm-runs with its verify scaled by the measured tree/chain ratio and its rollback
    replaced by the commit, scaled like the verify."""
    p16, d16 = _sm_run(tmp_path, 16, verify_ms=80.0, draft_ms=4.0)
    p24, d24 = _sm_run(tmp_path, 24, verify_ms=40.0, draft_ms=2.0)
    tree, _ = _tree_cost(tmp_path)
    cycles = dict(proj.tree_cycles([str(tree)], [str(p16), str(p24)], clock_mhz=1575))
    verify, draft = 320 / 3, 10.0             # the chain projection of test_measured_sm_projection
    scale = verify / 40.0                      # Thor ms per measured chain-verify ms
    (b32, ms32), (b63, ms63) = cycles.items()
    assert "B=32" in b32 and "16 SMs" in b32 and "B=63" in b63
    assert ms32 == pytest.approx(draft + verify * 1.2 + 2.0 * scale)
    assert ms63 == pytest.approx(draft + verify * 1.5 + 2.0 * scale)
    assert proj.main(["--sm-runs", str(p16), str(p24), "--tree-cost", str(tree), "--als", "4.57,8"]) == 0
    out = capsys.readouterr().out
    assert "Tree cycle on Thor" in out and f"{8.0 / ms63 * 1e3:.1f}" in out
    assert proj.main(["--tree-cycle-ms", "40", "--als", "4,8"]) == 0
    out = capsys.readouterr().out
    assert "100.0" in out and "200.0" in out


def test_tree_projection_bad_inputs(tmp_path, capsys) -> None:
    tree, _ = _tree_cost(tmp_path)
    assert proj.main(["--tree-cost", str(tree)]) == 2
    assert "--tree-cost needs --sm-runs" in capsys.readouterr().err
    p16, _ = _sm_run(tmp_path, 16, 80.0, 4.0)
    p24, _ = _sm_run(tmp_path, 24, 40.0, 2.0)
    assert proj.main(["--sm-runs", str(p16), str(p24), "--tree-cost", str(p16)]) == 2
    assert "not a tools/tree_cost.py --json file" in capsys.readouterr().err
    assert proj.main(["--tree-cycle-ms", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err


# ---- block-scaled formats: byte-bound estimate and sm_110a SASS counts (--sass) ---------------------------------

def _sass_row(fmt: str, kernel: str, stage: str, ipw: float, block_scaled: bool = False, target: str = "sm_110a"):
    # one kernel as tools/compile_targets.py --json writes it (the keys thor_projection reads, and some it does not)
    return {"target": target, "shape": "qwen3.5-27b", "format": fmt, "kernel": kernel, "stage": stage,
            "launch": "", "error": "", "registers": 64, "spill_bytes": 0, "mma": {},
            "block_scaled": block_scaled, "instructions_per_weight": ipw}


def _sass_file(tmp_path, rows):
    path = tmp_path / "sass.json"
    path.write_text(json.dumps(rows))
    return path


SASS_ROWS = [_sass_row("nvfp4", "_block_scaled_kernel", "verify16", 1.08, True),
             _sass_row("nvfp4", "_block_scaled_kernel", "verify16", 1.09, True),
             _sass_row("nvfp4", "_block_scaled_kernel", "decode", 1.12, True),
             _sass_row("nvfp4", "_block_scaled_kernel", "verify64", 9.0, False),      # emulated: not counted
             _sass_row("nvfp4", "_block_scaled_kernel", "verify32", 7.0, True, target="sm_120a"),
             _sass_row("nvfp4", "_attn_split_kernel", "verify16", 344.0),               # not a product
             _sass_row("int4", "_int4_pair_dot_kernel", "verify16", 3.73),
             _sass_row("nvfp4", "_int4_pair_dot_kernel", "verify16", 2.84),            # compiled first by nvfp4's run
             _sass_row("int4", "_int4_gemv_h2_kernel", "decode", 4.09),
             _sass_row("int4", "_gemv_kernel", "decode", 4.56)]                         # a bf16 product


def test_sass_counts_read_the_products_of_each_format(tmp_path) -> None:
    counts = proj.sass_counts(str(_sass_file(tmp_path, SASS_ROWS)))
    assert counts["nvfp4"] == {"decode": (1.12, 1.12), "verify16": (1.08, 1.09)}
    assert counts["int4"] == {"decode": (4.09, 4.09), "verify16": (2.84, 3.73)}
    assert "mxfp4" not in counts
    line = proj.sass_line(counts, "nvfp4")
    assert "decode 1.12 / 4.09, verify16 1.08-1.09 / 2.84-3.73" in line and "sm_110a" in line
    with pytest.raises(ValueError, match="no mxfp4 product compiled for sm_110a"):
        proj.sass_line(counts, "mxfp4")


def test_block_scaled_estimate(tmp_path, capsys) -> None:
    paths, data = [], {}
    for sms, verify_ms, draft_ms in ((16, 80.0, 4.0), (24, 40.0, 2.0)):
        path, d = _sm_run(tmp_path, sms, verify_ms, draft_ms)
        d = {**d, "format": "nvfp4", "lm_head": "nvfp4", "dflash-nvfp4": d.pop("dflash-int4"),
             "dflash-nvfp4_draft_bytes": d.pop("dflash-int4_draft_bytes")}
        path.write_text(json.dumps(d))
        paths.append(str(path))
        data[sms] = d
    runs = {n: {**d["dflash-nvfp4"], "draft_bytes": 2.59e9} for n, d in data.items()}
    p = proj.project_measured(runs, data, [4.0], clock_mhz=1575)
    stages = proj.block_scaled_stages("nvfp4", "dflash-nvfp4")
    assert stages == {"verify": "nvfp4", "draft": "nvfp4"}
    assert proj.block_scaled_stages("nvfp4", "ngram") == {"verify": "nvfp4"}
    assert proj.block_scaled_stages("int4", "dflash-int4") == {}
    e = proj.block_scaled_estimate(p["stages"], stages, [4.0])
    # verify 25.9 GB and draft 2.59 GB at 259 GB/s (100 + 10 ms), accept as projected (2 ms): SM time 106.7 ms gone
    assert e["cycle_ms"] == pytest.approx(112.0) and e["tok_s"][4.0] == pytest.approx(4.0 / 0.112)
    assert p["cycle_ms"] > e["cycle_ms"]
    sass = _sass_file(tmp_path, SASS_ROWS)
    assert proj.main(["--sm-runs", *paths, "--als", "4", "--sass", str(sass)]) == 0
    out = capsys.readouterr().out
    assert "ESTIMATE on Thor's block-scaled MMA: verify and draft at their bytes (259 GB/s)" in out
    assert "cycle 112.0 ms, tok/s AL 4: 35.7" in out
    assert "nvfp4 (block-scaled MMA) / int4: decode 1.12 / 4.09, verify16 1.08-1.09 / 2.84-3.73" in out
    assert proj.main(["--sm-runs", *paths, "--als", "4"]) == 0                # no --sass: how to get the counts
    assert "pass --sass" in capsys.readouterr().out


def test_block_scaled_estimate_bad_inputs(tmp_path, capsys) -> None:
    p16, _ = _sm_run(tmp_path, 16, 80.0, 4.0)
    p24, _ = _sm_run(tmp_path, 24, 40.0, 2.0)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    assert proj.main(["--sm-runs", str(p16), str(p24), "--sass", str(bad)]) == 2
    assert "not a tools/compile_targets.py --json file" in capsys.readouterr().err
    hopper = _sass_file(tmp_path, [_sass_row("int4", "_int4_gemv_h2_kernel", "decode", 4.0, target="sm_90a")])
    assert proj.main(["--sm-runs", str(p16), str(p24), "--sass", str(hopper)]) == 2
    assert "no packed product compiled for sm_110a" in capsys.readouterr().err
    full, data = _bench(tmp_path, format="nvfp4")
    int4_only = _sass_file(tmp_path, [_sass_row("int4", "_int4_gemv_h2_kernel", "decode", 4.0)])
    assert proj.main([str(full), "--sass", str(int4_only)]) == 2
    assert "no nvfp4 product compiled for sm_110a" in capsys.readouterr().err
