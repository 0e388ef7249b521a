"""``edgespec distill --drafter-kind dflash2`` on tiny random targets (CPU), against z-lab's ``dflash`` package.

The objective's blocks, with the convolutions and the selector, draft what the package drafts from the same
context (a package-written checkpoint with sliding, causal and full layers and a scaled, soft-capped head); a few
steps on a tiny fixed data set lower both losses and lengthen the selector path's accepted run; the CLI writes a
checkpoint that resumes, loads in edgespec's runtime and in the package's ``DFlash2DraftModel.from_pretrained`` with
identical proposals, and keeps speculative output equal to plain; two gloo processes follow one process with
twice the batch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest
import test_distributed
import torch
from test_dflash2 import _Target, reference_draft, write_reference_drafter
from test_distributed import _curve, _run, _same_as_plain

from edgespec.distill.data import Sequence_
from edgespec.distill.kinds import drafter_kind
from edgespec.distill.objective import accepted_drafts, make_blocks, pack_blocks, sampled_vocab
from edgespec.distill.train import TrainOptions, train
from edgespec.drafters.dflash2_loader import load_dflash2_checkpoint
from edgespec.drafters.dflash2_proposer import DFlash2Proposer
from edgespec.errors import CheckpointError
from edgespec.loading.checkpoint import load_target

dflash_model = pytest.importorskip("dflash.model")

KIND = drafter_kind("dflash2")
# The DFlash kind's distributed-test fixtures: its tiny Llama target (vocab 320, hidden 64, 3 layers, a byte-level
# chat tokenizer) and its 12 prompts.
tiny_target, prompts = test_distributed.tiny_target, test_distributed.prompts


def _args(target: Path, out: Path, prompts: Path, *extra: str) -> list[str]:
    """The DFlash kind's distributed-test flags (tiny drafter, 4 anchors, 20 new tokens) for a DFlash2 drafter."""
    return test_distributed._args(target, out, prompts, "--drafter-kind", "dflash2", "--selector-rank", "8",
                                  "--selector-top-k", "8", *extra)


def _tokens(seed: int, n: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_objective_drafts_what_the_dflash_package_drafts(tiny_models, tmp_path) -> None:
    """Blocks at several anchors of one sequence in one forward: every block's selector path and every row's argmax
    equal the package's draft of that anchor from the context features of the tokens before it."""
    model = tiny_models["qwen3_5"]
    H, V = model.config.hidden_size, model.config.vocab_size
    folder = write_reference_drafter(tmp_path / "ref", H, V, seed=3, layer_types=["sliding_attention",
                                     "full_attention"], window=5, multiplier=1.3, softcap=6.0)
    drafter = KIND.load(str(folder), model)
    obj = KIND.objective(drafter, model.model.embed_tokens.weight, model.lm_head_weight, 64, None, 7.0)
    tokens = _tokens(1, 30, V)
    taps = model.prefill(tokens, model.new_cache(40), taps=drafter.cfg.target_layer_ids).taps
    anchors = torch.tensor([4, 9, 15, 22])
    b = make_blocks(tokens, 4, taps, anchors, drafter.cfg.block_size, drafter.cfg.mask_token_id)
    with torch.no_grad():
        drafts, argmax = obj.drafts(b), obj(b).logits.argmax(-1)
    ref = dflash_model.DFlash2DraftModel.from_pretrained(str(folder)).eval()
    target = _Target(model)
    differ = 0
    for j, a in enumerate(anchors.tolist()):
        path, ref_argmax = reference_draft(ref, target, taps[:a], 0, int(tokens[a]))
        assert drafts[j].tolist() == path and argmax[j].tolist() == ref_argmax, a
        differ += path != ref_argmax
    assert differ           # the selector changed some path: an argmax-only objective would fail
    # A sampled softmax keeps every label's path score: the same logit and the same teacher-forced pair term.
    vocab, _ = sampled_vocab(b.labels, V, 40, torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, sampled = obj(b), obj(b, vocab)
    valid = b.labels >= 0
    assert valid.sum() > 8 and (sampled.path_labels >= 0).equal(valid)
    score = [o.path_scores.gather(-1, o.path_labels.clamp(min=0)[..., None])[..., 0][valid] for o in (full, sampled)]
    torch.testing.assert_close(score[0], score[1])


def _fixed_set(target, taps: list[int], n: int = 4) -> list[Sequence_]:
    """``n`` sequences of the target's own greedy continuations (as distill's data): 6 prompt tokens, 18 more."""
    out = []
    for i in range(n):
        ids = _tokens(100 + i, 6, target.config.vocab_size).tolist()
        cache = target.new_cache(40)
        res = target.prefill(torch.tensor(ids), cache)
        while len(ids) < 24:
            ids.append(int(res.logits[-1].argmax()))
            res = target.forward(torch.tensor(ids[-1:]), cache)
        # clone: a tensor made in inference mode cannot enter autograd
        full = target.prefill(torch.tensor(ids), target.new_cache(40), taps=taps).taps.clone()
        out.append(Sequence_(torch.tensor(ids), 6, full))
    return out


@pytest.fixture
def one_thread():
    """One torch thread, as ``edgespec distill`` runs on a CPU (a shared CPU's extra threads mostly wait)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_few_steps_lower_both_losses_and_lengthen_the_path(tiny_target, tmp_path, one_thread) -> None:
    target = load_target(tiny_target, merge=False)
    args = argparse.Namespace(taps="1", layers=1, heads=None, kv_heads=None, intermediate_size=64, block_size=4,
                              mask_token_id=None, conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                              selector_top_k=8, target_init=True)
    drafter = KIND.new(args, target, 0)
    seqs = _fixed_set(target, drafter.cfg.target_layer_ids)
    obj = KIND.objective(drafter, target.model.embed_tokens.weight, target.lm_head_weight, 64, None, 7.0)
    b = pack_blocks([make_blocks(s.tokens, s.prompt_len, s.taps, torch.arange(6, 22), 4, drafter.cfg.mask_token_id)
                     for s in seqs])

    def figures() -> tuple[float, float, float]:
        from edgespec.distill.objective import decay_weighted_ce
        with torch.no_grad():
            out = obj(b)
            return (float(decay_weighted_ce(out.logits, b.labels, 7.0)[0]),
                    float(decay_weighted_ce(out.path_scores, out.path_labels, 7.0)[0]),
                    float(accepted_drafts(obj.drafts(b), b.labels).float().mean()))

    before = figures()
    opts = TrainOptions(steps=20, batch=4, anchors=16, lr=3e-3, warmup=2, eval_every=20, save_every=20)
    res = train(obj, seqs, [], opts, tmp_path / "run", KIND.published_config(drafter.cfg, target.config),
                torch.device("cpu"), {"kind": "dflash2"})
    after = figures()
    assert res["steps"] == 20
    assert after[0] < 0.7 * before[0] and after[1] < 0.7 * before[1], (before, after)
    assert after[2] > before[2] + 0.3, (before, after)
    for conv in (drafter.layers[0].attention_conv, drafter.layers[0].mlp_conv):   # the convolutions trained
        assert conv.kernel_projection.weight.abs().sum() > 0 and conv.base_kernel[:, 1].abs().sum() > 0


def test_bad_dflash2_arguments_and_init_folders_are_named(tiny_target, tmp_path) -> None:
    from edgespec.bench.random_drafter import write_dflash_drafter

    target = load_target(tiny_target, merge=False)
    args = argparse.Namespace(taps="1", layers=1, heads=None, kv_heads=None, intermediate_size=64, block_size=4,
                              mask_token_id=None, conv_kernel_size=2, conv_group_size=24, selector_rank=8,
                              selector_top_k=8, target_init=False)
    with pytest.raises(CheckpointError, match=r"--conv-group-size.*hidden_size 64 is not a multiple of "
                                              r"conv_group_size 24"):
        KIND.new(args, target, 0)
    args.conv_group_size, args.selector_top_k = 16, 400
    with pytest.raises(CheckpointError, match="selector_top_k 400 exceeds vocab_size 320"):
        KIND.new(args, target, 0)
    # --init with a DFlash (not DFlash2) drafter, or with none
    dflash = write_dflash_drafter(tmp_path / "dflash", tiny_target, num_layers=1, block_size=4, seed=1)
    with pytest.raises(CheckpointError, match="a DFlash2 drafter needs conv_kernel_size"):
        KIND.load(str(dflash), target)
    with pytest.raises(CheckpointError, match="--init drafter folder not found"):
        KIND.load(str(tmp_path / "none"), target)


def _package_drafts_equal_ours(target_dir: Path, drafter_dir: Path) -> None:
    """Every propose of edgespec's loaded drafter over a greedy session equals the package's draft of the same
    block, from its own ``from_pretrained`` of the folder (fp32), and the session's output is plain decoding's."""
    from edgespec.arch.detect import select_hooks
    from edgespec.speculative.acceptance import StrictGreedy
    from edgespec.speculative.session import SpecSession

    model = load_target(target_dir, max_positions=256)
    prop = load_dflash2_checkpoint(drafter_dir, model, window_size=64)
    assert isinstance(prop, DFlash2Proposer)
    ref = dflash_model.DFlash2DraftModel.from_pretrained(str(drafter_dir), dtype=torch.float32).eval()
    target, real_propose, seen = _Target(model), prop.propose, []

    def propose(last_token: int, k: int):
        draft = real_propose(last_token, k)
        end = prop.window.end
        taps = model.prefill(torch.tensor(prop.history[:end]), model.new_cache(end + 8), taps=prop.taps).taps
        path, _ = reference_draft(ref, target, taps, 0, last_token)
        assert draft.tokens.tolist() == path[:draft.tokens.shape[0]], end
        seen.append(end)
        return draft

    prop.propose = propose
    prompt = _tokens(7, 11, model.config.vocab_size).tolist()
    plain = SpecSession.with_defaults(model, select_hooks("base", torch.device("cpu")), None, max_len=128).generate(
        prompt, max_tokens=16, policy=StrictGreedy()).token_ids
    spec = SpecSession.with_defaults(model, select_hooks("base", torch.device("cpu")), prop, max_len=128)
    assert spec.generate(prompt, max_tokens=16, policy=StrictGreedy()).token_ids == plain
    assert len(seen) >= 3


@pytest.fixture(scope="module")
def single_run(tiny_target, prompts, tmp_path_factory) -> tuple[Path, list[str]]:
    """One process, 8 steps of 4 sequences (the DFlash kind's distributed test): the folder and its flags."""
    root = tmp_path_factory.mktemp("single")
    common = ["--batch", "4", "--eval-every", "4", "--save-every", "4", "--data", str(root / "data")]
    r = _run([sys.executable, *_args(tiny_target, root / "one", prompts, "--steps", "8", *common)])
    assert "data shards" in r.stderr
    return root / "one", common


def test_two_processes_follow_one_with_twice_the_batch(tiny_target, prompts, single_run, tmp_path) -> None:
    one, common = single_run
    two = tmp_path / "two"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29631"]
    _run([*torchrun, *_args(tiny_target, two, prompts, "--steps", "8", *common, "--batch", "2")])  # last --batch wins
    assert json.loads((two / "distill.json").read_text())["world"] == 2
    c1, c2 = _curve(one), _curve(two)
    assert [p[0] for p in c1] == [p[0] for p in c2] == list(range(1, 9))
    for p, q in zip(c1, c2, strict=True):
        assert q[1] == pytest.approx(p[1], rel=1e-3, abs=1e-3), (p, q)
    assert c1[-1][1] < c1[0][1]
    held = [json.loads((f / "distill.json").read_text())["held_out_history"] for f in (one, two)]
    assert [h[2] for h in held[0]] == pytest.approx([h[2] for h in held[1]], abs=1e-3)


def test_distill_resumes_and_both_runtimes_load_the_checkpoint(tiny_target, prompts, single_run, tmp_path) -> None:
    one, common = single_run
    out = tmp_path / "resumed"
    shutil.copytree(one, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["block_size"] == 4
    assert {k: cfg["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                 "selector_top_k", "block_size")} == {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 8, "block_size": 4}
    r = _run([sys.executable, *_args(tiny_target, out, prompts, "--steps", "10", *common)])
    assert " 8/10 " in r.stderr and "data shards" not in r.stderr            # resumed at step 8, data reused
    assert json.loads(r.stdout.strip().splitlines()[-1])["steps"] == 10
    assert _curve(out)[:8] == _curve(one)
    _package_drafts_equal_ours(tiny_target, out)
    _same_as_plain(tiny_target, out)                   # --drafter dflash picks DFlash2 from the checkpoint
