"""``edgespec distill``: data generation, the block objective against the proposer, training, resume, torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgespec.bench.shapes import tiny_config, write_chat_tokenizer, write_random_checkpoint
from edgespec.distill.batched import generate_batch, supports_batched
from edgespec.distill.data import generate_one, load_data
from edgespec.distill.objective import BlockObjective, accepted_lengths, block_mask, make_blocks
from edgespec.distill.workload import bench_prompt_texts, load_prompt_file, robot_prompts
from edgespec.errors import CheckpointError, ConfigError
from edgespec.loading.checkpoint import load_target


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    """A tiny random Llama target with a byte-level chat tokenizer (vocab 320 >= the tokenizer's 261 ids)."""
    folder = write_random_checkpoint(tmp_path_factory.mktemp("target") / "llama", tiny_config("llama"), seed=3)
    return write_chat_tokenizer(folder)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batched_generation_matches_the_serving_model(tiny_checkpoints, family) -> None:
    """Greedy tokens and every tap row of the batched generator equal the serving path's, prompt by prompt."""
    model = load_target(tiny_checkpoints[family], merge=False, max_positions=256)
    assert supports_batched(model)
    prompts = [[5, 9, 13, 200], [7, 7, 7, 7, 7, 7, 3], [100]]      # different lengths: left padding exercised
    taps = [0, 2]
    got = generate_batch(model, prompts, max_new_tokens=12, stop_ids=[], taps=taps)
    for p, g in zip(prompts, got, strict=True):
        one = generate_one(model, p, max_new_tokens=12, stop_ids=[], taps=taps)
        assert g.tokens == one.tokens
        assert g.prompt_len == len(p)
        assert g.taps.shape == one.taps.shape == (len(g.tokens) - 1, 2, model.config.hidden_size)
        torch.testing.assert_close(g.taps, one.taps, atol=2e-5, rtol=1e-4)


def test_batched_generation_stops_per_row(tiny_checkpoints) -> None:
    model = load_target(tiny_checkpoints["llama"], merge=False, max_positions=256)
    free = generate_batch(model, [[5, 9, 13], [1, 2]], max_new_tokens=8, stop_ids=[], taps=[1])
    stop = free[0].tokens[3 + 2]                     # row 0's third generated token becomes a stop token
    got = generate_batch(model, [[5, 9, 13], [1, 2]], max_new_tokens=8, stop_ids=[stop], taps=[1])
    first = free[0].tokens[3:].index(stop)
    assert got[0].tokens == free[0].tokens[:3 + first + 1]
    assert got[0].taps.shape[0] >= len(got[0].tokens) - 1


def test_hybrid_targets_take_the_serving_path(tiny_checkpoints) -> None:
    model = load_target(tiny_checkpoints["qwen3_5"], merge=False, max_positions=256)
    assert not supports_batched(model)
    g = generate_one(model, [4, 8, 15], max_new_tokens=5, stop_ids=[], taps=[1, 3])
    assert len(g.tokens) == 8 and g.taps.shape[0] == 7


def test_block_mask_rules() -> None:
    anchors = torch.tensor([3, 5])
    m = block_mask(anchors, n_ctx=6, bs=2)
    # block 0 (anchor 3): context 0..2, own keys; block 1 (anchor 5): context 0..4, own keys
    assert m[0, :6].tolist() == [True, True, True, False, False, False]
    assert m[2, :6].tolist() == [True] * 5 + [False]
    assert m[0, 6:].tolist() == [True, True, False, False] and m[3, 6:].tolist() == [False, False, True, True]
    w = block_mask(anchors, n_ctx=6, bs=2, window=2)
    assert w[2, :6].tolist() == [False, False, False, True, True, False]
    c = block_mask(anchors, n_ctx=6, bs=2, causal=True)
    assert c[0, 6:8].tolist() == [True, False] and c[1, 6:8].tolist() == [True, True]


def test_accepted_lengths_counts_the_leading_matches() -> None:
    labels = torch.tensor([[1, 2, 3], [1, 2, 3], [4, -100, -100]])
    logits = torch.full((3, 3, 6), -1.0)
    for r, row in enumerate([[1, 2, 0], [0, 2, 3], [4, 0, 0]]):
        for k, t in enumerate(row):
            logits[r, k, t] = 1.0
    assert accepted_lengths(logits, labels).tolist() == [3, 1, 2]


@pytest.mark.parametrize("window", [None, 6])
def test_objective_equals_the_proposer_block_forward(tiny_checkpoints, tmp_path, window) -> None:
    """The training forward of one block (context = features of positions < anchor) is the proposer's draft."""
    from edgespec.bench.random_drafter import write_dflash_drafter
    from edgespec.drafters.dflash import load_dflash_checkpoint

    target = load_target(tiny_checkpoints["qwen3"], max_positions=256)
    folder = write_dflash_drafter(tmp_path / "d", tiny_checkpoints["qwen3"], num_layers=2, block_size=6,
                                  sliding_layers=1, sliding_window=5, seed=4)
    prop = load_dflash_checkpoint(folder, target, window_size=window or 64)
    prompt = [3, 17, 40, 41, 99, 120, 7, 8, 250]
    cache = target.new_cache(64)
    pre = target.forward(torch.tensor(prompt), cache, taps=prop.taps)
    prop.begin(prompt, pre)
    anchor = 77
    with torch.inference_mode():
        want = prop.block_hidden(anchor)
        logits_want = prop.logits(want[1:])

    from edgespec.distill.dflash_kind import load_drafter
    drafter = load_drafter(str(folder), target)
    obj = BlockObjective(drafter, target.model.embed_tokens.weight, target.lm_head_weight, 64, window=window)
    tokens = torch.tensor(prompt + [anchor, 1, 2, 3, 4, 5])
    b = make_blocks(tokens, len(prompt), pre.taps, torch.tensor([len(prompt)]), 6, prop.cfg.mask_token_id)
    with torch.no_grad():
        got = obj.hidden(b)[0]
        logits = obj(b)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, logits_want, atol=1e-3, rtol=1e-4)
    assert b.labels[0].tolist() == [1, 2, 3, 4, 5]


def test_robot_prompts_are_seeded_distinct_and_hold_out_the_bench() -> None:
    a, b = robot_prompts(50, seed=1), robot_prompts(50, seed=1)
    assert a == b and len(set(a)) == 50
    assert not set(a) & bench_prompt_texts()
    assert robot_prompts(50, seed=2) != a


def test_prompt_files_and_their_errors(tmp_path) -> None:
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    assert load_prompt_file(tmp_path / "p.txt") == ["one", "two"]
    (tmp_path / "p.jsonl").write_text('{"user": "a"}\n{"prompt": "b"}\n')
    assert load_prompt_file(tmp_path / "p.jsonl") == ["a", "b"]
    (tmp_path / "p.yaml").write_text("- x\n- user: y\n")
    assert load_prompt_file(tmp_path / "p.yaml") == ["x", "y"]
    with pytest.raises(ConfigError, match="not found"):
        load_prompt_file(tmp_path / "missing.txt")
    (tmp_path / "bad.jsonl").write_text('{"user": "a"}\n{oops\n')
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        load_prompt_file(tmp_path / "bad.jsonl")
    (tmp_path / "bad.yaml").write_text("- 3\n")
    with pytest.raises(ConfigError, match="entry 0"):
        load_prompt_file(tmp_path / "bad.yaml")


def _distill(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "edgespec.cli", "distill", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)


def _common(target: Path, out: Path, prompts: Path) -> list[str]:
    return ["--model", str(target), "--out", str(out), "--prompts", str(prompts), "--max-new-tokens", "24",
            "--gen-batch", "4", "--layers", "1", "--block-size", "4", "--intermediate-size", "64", "--batch", "2",
            "--anchors", "4", "--eval-every", "2", "--save-every", "2", "--holdout-every", "4", "--device", "cpu"]


def test_distill_trains_saves_resumes_and_the_result_loads(tiny_target, tmp_path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"move box {i} to shelf {i % 3}" for i in range(8)))
    out = tmp_path / "drafter"
    r = _distill(*_common(tiny_target, out, prompts), "--steps", "4")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["steps"] == 4 and res["loss"] > 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"]["target_layer_ids"] == [1]
    meta, seqs = load_data(out / "data")
    assert len(seqs) == 16                         # 8 prompts x (greedy + 1 sampled)
    # the draft vocabulary's ranking: token counts of the training sequences' answers (held-out ones excluded)
    answers = {t for s in seqs for t in s.tokens[s.prompt_len:].tolist()}
    ranking = json.loads((out / "draft_vocab.json").read_text())
    ids = ranking["ids"]
    assert ids and len(set(ids)) == len(ids) and set(ids) <= answers and "edgespec distill" in ranking["source"]
    # resume: a longer run continues from step 4 (its log starts there) and reuses the data cache
    r2 = _distill(*_common(tiny_target, out, prompts), "--steps", "6")
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout.strip().splitlines()[-1])["steps"] == 6
    assert "data shards" in r.stderr and "data shards" not in r2.stderr and " 4/6 " in r2.stderr
    # the result is a drafter the runtime loads and runs losslessly
    from edgespec.config import Settings
    from edgespec.engine import Engine
    from edgespec.plan import build_plan

    plain = Engine.load(build_plan(Settings(model=str(tiny_target), drafter="none", max_tokens=20)))
    spec = Engine.load(build_plan(Settings(model=str(tiny_target), drafter="dflash", drafter_path=str(out),
                                         max_tokens=20, draft_vocab=len(ids))))
    from edgespec.engine import Request
    for text in ("move box 2 to shelf 1", "hello"):
        req = Request(messages=[{"role": "user", "content": text}], max_tokens=20)
        assert spec.complete(req).token_ids == plain.complete(req).token_ids


def test_distill_refuses_bad_inputs(tiny_target, tmp_path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\n")
    out = tmp_path / "d"
    r = _distill(*_common(tiny_target, out, tmp_path / "none.txt"), "--steps", "1")
    assert r.returncode == 2 and "prompt file not found" in r.stderr
    r = _distill(*_common(tiny_target, out, prompts), "--taps", "0,9", "--steps", "1")
    assert r.returncode == 2 and "outside the target's layers" in r.stderr
    r = _distill(*_common(tiny_target, out, prompts), "--init", str(tmp_path / "nothing"), "--steps", "1")
    assert r.returncode == 2 and "--init drafter folder not found" in r.stderr
    r = _distill(*_common(tiny_target, out, prompts), "--pack", "0", "--steps", "1")
    assert r.returncode == 2 and "--pack 0: sequences per forward must be 1 or more" in r.stderr
    r = _distill(*_common(tiny_target, out, prompts), "--time-budget", "-1", "--steps", "1")
    assert r.returncode == 2 and "--time-budget -1.0: minutes of training must be more than 0" in r.stderr
    r = _distill(*_common(tiny_target, out, prompts), "--steps", "1", "--data-only")
    assert r.returncode == 0, r.stderr
    # the same data folder with another recipe is refused, not mixed
    r = _distill(*_common(tiny_target, out, prompts), "--steps", "1", "--temperature", "0.3")
    assert r.returncode == 2 and "different recipe (temperature differ)" in r.stderr
    with pytest.raises(ConfigError, match="robot:N"):
        from edgespec.distill.cli import _prompts
        _prompts("robot:many")
    (out / "data" / "shard-00000.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read data shard"):
        load_data(out / "data")


def test_distill_under_torchrun_with_two_cpu_processes(tiny_target, tmp_path) -> None:
    """DDP over gloo: both ranks generate their shards, train in step, rank 0 writes the drafter."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"pick cube {i}" for i in range(8)))
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29613",
           "-m", "edgespec.cli", "distill", *_common(tiny_target, out, prompts), "--steps", "3"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["steps"] == 3
    assert json.loads((out / "distill.json").read_text())["world"] == 2
    _, seqs = load_data(out / "data")
    assert len(seqs) == 16                          # shards from both ranks


def test_target_init_copies_the_last_layer_when_shapes_match(tiny_checkpoints) -> None:
    import argparse

    from edgespec.distill.dflash_kind import random_drafter, target_init

    target = load_target(tiny_checkpoints["llama"], merge=False)
    cfg = target.config
    args = argparse.Namespace(taps="0,2", layers=1, heads=None, kv_heads=None, intermediate_size=None,
                              block_size=4, mask_token_id=None)
    d = random_drafter(args, cfg, 0)
    assert target_init(d, target)
    last = target.model.layers[-1]
    assert torch.equal(d.layers[0].mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert torch.equal(d.norm.weight, target.model.norm.weight)
    H = cfg.hidden_size
    # the context path starts near the identity on the last tap (plus a tenth of the random init)
    assert (d.fc.weight[:, -H:].diagonal() > 0.9).all() and d.fc.weight[:, -H:].abs().mean() < 0.1
    args.intermediate_size = cfg.intermediate_size // 2
    assert not target_init(random_drafter(args, cfg, 0), target)          # shapes differ: nothing copied
