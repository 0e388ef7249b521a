"""``edgespec bench MODE``: every subcommand run end to end on a tiny random model on the CPU (its printed table and
its JSON keys), ``prompts`` when none is named, the old mode flags refused with the subcommand that replaced them,
and each mode's help listing only its own options."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from edgespec.cli import main

TWO_PROMPTS = """\
- id: robot_json_plan
  user: "Output a compact JSON action list for a robot to pick up the red cube."
- id: repeated_text_stress
  user: "Repeat exactly: the robot arm moves the blue box to the left shelf."
"""


@pytest.fixture
def random_model_args(tmp_path: Path, monkeypatch) -> list[str]:
    """The flags that bench a tiny random llama with the byte tokenizer, written into a per-test cache."""
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    return ["--random-model", "tiny:llama", "--bench-tokenizer", "byte", "--max-seq-len", "512"]


def _help(capsys, *words: str) -> str:
    with pytest.raises(SystemExit) as done:
        main(["bench", *words, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_prompts_is_the_default_mode(tmp_path, random_model_args, capsys):
    prompts = tmp_path / "p.yaml"
    prompts.write_text(TWO_PROMPTS)
    outs = {}
    for mode in (["prompts"], []):
        out = tmp_path / f"prompts{len(mode)}.json"
        assert main(["bench", *mode, *random_model_args, "--drafter", "ngram", "--prompts", str(prompts),
                     "--tokens", "8", "--out", str(out)]) == 0
        outs[len(mode)] = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert "edgespec plain" in text and "edgespec ngram" in text and "measured peak" in text
    for figures in outs.values():
        assert set(figures) == {"meta", "rows"}
        assert {"device", "threads", "model", "settings", "tokens", "peak_memory_bytes"} <= set(figures["meta"])
        rows = figures["rows"]
        assert [(r["prompt"], r["runner"]) for r in rows] == [
            (p, r) for p in ("robot_json_plan", "repeated_text_stress") for r in ("edgespec plain", "edgespec ngram")]
        assert all(r["same_as_plain"] and r["tok_s"] > 0 and 0 < r["tokens"] <= 8 for r in rows)
        assert all(r["al"] >= 1.0 for r in rows if r["runner"] == "edgespec ngram")
    # the same greedy answers with and without the subcommand named
    assert [r["tokens"] for r in outs[0]["rows"]] == [r["tokens"] for r in outs[1]["rows"]]


def test_prompts_with_tree_runs_the_drafter_as_chains_and_as_trees(tmp_path, random_model_args):
    """``--tree``: one tree session, its drafter run as chains (its chain strategy) and as trees, both lossless."""
    prompts = tmp_path / "p.yaml"
    prompts.write_text(TWO_PROMPTS)
    out = tmp_path / "tree.json"
    assert main(["bench", "prompts", *random_model_args, "--drafter", "ngram", "--prompts", str(prompts),
                 "--tokens", "16", "--tree", "8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    runners = ("edgespec plain", "edgespec ngram", "edgespec ngram tree8")
    assert [(r["prompt"], r["runner"]) for r in rows] == [
        (p, r) for p in ("robot_json_plan", "repeated_text_stress") for r in runners]
    assert all(r["same_as_plain"] for r in rows)
    chains = [r["telemetry"] for r in rows if r["runner"] == "edgespec ngram"]
    trees = [r["telemetry"] for r in rows if r["runner"] == "edgespec ngram tree8"]
    assert all("tree_cycles" not in t for t in chains) and any(t["drafts"] for t in chains)
    assert all(t.get("tree_cycles", 0) == t["drafts"] for t in trees) and any(t["drafts"] for t in trees)


def test_shapes_sweep_runs_on_the_cpu(tmp_path, capsys):
    """The sweep that failed with ``Namespace has no attribute rollback``: every shape now measured, none an
    error, on a tiny shape on the host clock (128-row prefills: a CPU smoke run)."""
    assert main(["bench", "shapes", "tiny:llama", "--kv", "model", "--device", "cpu", "--context", "16",
                 "--compare-hf-shapes", "none", "--sweep-out", str(tmp_path)]) == 0
    assert "tiny:llama" in capsys.readouterr().out
    sweep = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert set(sweep) == {"bandwidth_GBps", "results", "attention_in_place"} and sweep["bandwidth_GBps"] > 0
    (r,) = sweep["results"]
    assert "error" not in r, r["error"]
    assert r["shape"] == "tiny:llama" and r["device"] == "cpu" and r["kv"] == "model" and r["dtype"] == "float32"
    assert r["decode_ms"] > 0 and r["decode_limit_ms"] > 0 and r["rollback"] in ("checkpoint", "replay", "deferred")
    assert {int(rows) for rows in r["verify"]} == {2, 4, 8, 16}
    assert all(v["ms"] > 0 and v["rollback_ms"] >= 0 for v in r["verify"].values())
    assert {int(n) for n in r["prefill"]} == {128} and all(p["tok_s"] > 0 for p in r["prefill"].values())


def test_a_failed_shape_run_fails_the_sweep(tmp_path, capsys):
    """A shape that cannot run (here its KV cache does not fit) is an ERROR row and exit status 1, not a quiet 0."""
    assert main(["bench", "shapes", "tiny:llama", "--kv", "model", "--device", "cpu", "--context", "100000000",
                 "--compare-hf-shapes", "none", "--sweep-out", str(tmp_path)]) == 1
    assert "1 of 1 shape runs failed: tiny:llama (model)" in capsys.readouterr().out
    (r,) = json.loads((tmp_path / "gpu_bench.json").read_text())["results"]
    assert "MemoryBudgetError" in r["error"]


def test_session_through_the_command_line(tmp_path, random_model_args, capsys):
    out = tmp_path / "session.json"
    assert main(["bench", "session", *random_model_args, "--session-drafters", "ngram", "--session-requests", "3",
                 "--session-first", "1", "--tokens", "8", "--out", str(out)]) == 0
    assert "steady (2 requests)" in capsys.readouterr().out
    figures = json.loads(out.read_text())["session"]
    assert set(figures) == {"rows", "first", "steady", "suffix", "peers"} and len(figures["rows"]) == 3
    assert set(figures["steady"]) == {"plain", "ngram"} and figures["steady"]["ngram"]["same_as_plain"] == "2/2"


def test_multi_turn_through_the_command_line(tmp_path, random_model_args):
    out = tmp_path / "mt.json"
    assert main(["bench", "multi-turn", *random_model_args, "--max-seq-len", "2048", "--history-tokens", "60",
                 "--turns", "2", "--tokens", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["multi_turn"]
    assert [r["turn"] for r in rows] == [0, 1] and all(r["same_output"] for r in rows)
    assert {"prompt_tokens", "new_tokens", "ttft_reuse_ms", "ttft_fresh_ms"} <= set(rows[1])


def _llama_bench() -> Path | None:
    """The llama-bench that tools/peer_llamacpp_cpu.sh builds (under EDGESPEC_PEER_DIR), if it was built."""
    peer = Path(os.environ.get("EDGESPEC_PEER_DIR", Path.home() / ".cache" / "edgespec" / "peer"))
    binary = peer / "llama.cpp-build" / "bin" / "llama-bench"
    return binary if binary.is_file() else None


def test_peer_refuses_missing_inputs_by_name(tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    assert main(["bench", "peer", "--llama-bench", "/bin/true", "--gguf", str(gguf)]) == 2
    assert f"--gguf {gguf}: no such file" in capsys.readouterr().err
    gguf.write_bytes(b"GGUF")
    assert main(["bench", "peer", "--llama-bench", str(tmp_path / "nowhere"), "--gguf", str(gguf)]) == 2
    assert "--llama-bench" in (err := capsys.readouterr().err) and "nowhere" in err
    assert main(["bench", "peer", "--llama-bench", "/bin/true", "--gguf", str(gguf), "--repeats", "0"]) == 2
    assert "--repeats 0 must be 1 or more" in capsys.readouterr().err


@pytest.mark.skipif(_llama_bench() is None, reason="llama-bench not built (bash tools/peer_llamacpp_cpu.sh, "
                    "PEER_BUILD_ONLY=1)")
def test_peer_against_a_built_llama_bench(tmp_path, capsys):
    pytest.importorskip("gguf")
    from gguf_files import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    out = tmp_path / "peer.json"
    assert main(["bench", "peer", "--llama-bench", str(_llama_bench()), "--gguf", str(gguf), "--repeats", "1",
                 "--prompt", "16", "--tokens", "8", "--threads", "1", "--out", str(out)]) == 0
    assert "llama.cpp decode (tg8)" in capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert set(figures) == {"runs", "medians", "bandwidth_gbs", "step_bytes", "threads"}
    assert set(figures["medians"]["llama.cpp"]) == {"pp", "tg"} and figures["medians"]["edgespec"]["pp"] > 0
    assert all(figures["medians"]["edgespec"][f"{p}/{n}"] > 0 for p in ("robot_navigation_plan",
                                                                         "repeated_text_stress")
               for n in ("plain", "ngram"))


@pytest.mark.parametrize("old, new", [
    (["--formats", "dense,int4", "--format-shape", "tiny:llama"],
     "edgespec bench formats dense,int4 --format-shape tiny:llama"),
    (["--shapes=qwen3.5-4b", "--kv", "none"], "edgespec bench shapes qwen3.5-4b --kv none"),
    (["--session", "--session-requests", "3"], "edgespec bench session --session-requests 3"),
    (["--tokens", "16", "--multi-turn"], "edgespec bench multi-turn --tokens 16"),
])
def test_old_mode_flags_name_their_subcommand(capsys, old, new):
    assert main(["bench", *old]) == 2
    err = capsys.readouterr().err
    flag = next(w for w in old if w.startswith("--") and w.split("=")[0] in (
        "--formats", "--shapes", "--session", "--multi-turn")).split("=")[0]
    assert f"`{flag}` is now `edgespec bench {new.split()[2]}`" in err and f"run `{new}`" in err


def test_each_mode_lists_only_its_options(capsys):
    text = _help(capsys)
    for mode in ("prompts", "formats", "shapes", "session", "multi-turn", "peer"):
        assert mode in text
    assert "--drafter {none,ngram,suffix,dflash,mtp}" in _help(capsys, "prompts")
    formats = _help(capsys, "formats")
    assert "--format-shape" in formats and "--drafter" not in formats and "--session-drafters" not in formats
    shapes = _help(capsys, "shapes")
    assert "--rollback {checkpoint,replay,deferred}" in shapes and "--format-shape" not in shapes
    assert "--tree" not in shapes and "--turns" not in shapes
    peer = _help(capsys, "peer")
    assert "--llama-bench" in peer and "--sm-limit" not in peer and "--drafter" not in peer
    session = _help(capsys, "session")
    assert "--session-drafters" in session and "--tree" not in session and "--compare-hf" not in session


def test_every_bench_command_in_the_docs_parses():
    """The reproduce commands users copy (a docs line that starts with ``edgespec bench``) name a subcommand and
    options that exist."""
    import shlex

    from edgespec.bench.cli import bench_argv
    from edgespec.cli import build_parser

    root = Path(__file__).resolve().parents[2]
    parser = build_parser()
    seen = 0
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if line.startswith("edgespec bench"):
                words = shlex.split(line.split("#")[0])[2:]
                try:
                    parser.parse_args(["bench", *bench_argv(words)])
                except SystemExit:
                    pytest.fail(f"{doc.name}:{n}: {line}")
                seen += 1
    assert seen >= 10


@pytest.mark.parametrize("mode", ["prompts", "formats", "shapes", "session", "multi-turn"])
def test_sm_limit_is_an_option_of_every_cuda_mode(capsys, monkeypatch, mode):
    """Each mode that runs on CUDA takes --sm-limit and applies it before any work (here: no CUDA, named)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", mode, "--sm-limit", "16"]) == 2
    assert "--sm-limit needs a CUDA device" in capsys.readouterr().err
