"""Speculation with images stays lossless: greedy speculative output on a prompt with camera frames equals plain
greedy output, on the tiny random Qwen3.5 VLM in fp32, for every drafter (n-gram, suffix, MTP, DFlash) and tree,
every hook set and rollback strategy; and the prefix cache keys image rows by their pixels.

Random targets accept little from real drafters, so the oracle proposers of the text gates (a known continuation
with one corrupted token; trees of it) force partial accepts of every depth after the image: the rows they verify
and roll back sit at cache index + the rope delta, which is what these tests pin down.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_spec_lossless import OracleProposer
from test_tree_lossless import OracleTree

from edgespec.arch.detect import select_hooks
from edgespec.arch.rollback import ROLLBACK_STRATEGIES
from edgespec.bench.random_drafter import write_dflash_drafter
from edgespec.bench.vision_shapes import encode_frame, synthetic_frame, write_tiny_vl_checkpoint
from edgespec.cache.prefix import PrefixCache
from edgespec.config import Settings
from edgespec.drafters.mtp import MTPProposer
from edgespec.drafters.ngram import NGramProposer
from edgespec.engine import Engine, Request
from edgespec.loading.checkpoint import load_target
from edgespec.loading.images import ImageRef, ProcessorConfig, preprocess
from edgespec.loading.tokenizer import ChatTokenizer
from edgespec.models.multimodal import ImageEncoder, VisionPrompt
from edgespec.plan import build_plan
from edgespec.speculative.acceptance import StrictGreedy
from edgespec.speculative.session import SpecSession

pytest.importorskip("PIL")
CPU = torch.device("cpu")
QUESTION = "Plan: pick up the red cube. Answer in JSON."


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """The tiny hybrid VLM (GDN + attention, MTP head), a DFlash drafter for it, the model as served (merged)."""
    root = tmp_path_factory.mktemp("vl-spec")
    folder = write_tiny_vl_checkpoint(root / "vlm", seed=11)
    drafter = write_dflash_drafter(root / "dflash", folder, seed=2, num_layers=2, block_size=6,
                                   target_layer_ids=[1, 3, 5])
    return folder, drafter, load_target(folder, max_positions=512)


def _vision(model, folder, seeds=(1,), text=QUESTION):
    """A fresh VisionPrompt of one user turn with the frames of ``seeds`` then ``text``."""
    proc = ProcessorConfig.from_folder(folder, model.config.vision)
    images = [preprocess(synthetic_frame(90, 130, s), proc) for s in seeds]
    content = [{"type": "image"} for _ in seeds] + [{"type": "text", "text": text}]
    ids = ChatTokenizer.from_folder(folder).encode_chat([{"role": "user", "content": content}])
    return VisionPrompt.place(ids, images, ImageEncoder(model.visual, CPU))


def _generate(model, folder, proposer, n, arch="base", seeds=(1,), **knobs):
    vision = _vision(model, folder, seeds)
    session = SpecSession.with_defaults(model, select_hooks(arch, CPU), proposer, max_len=256, **knobs)
    session.cycle_cost = None      # trees: every node verified (the oracle's sibling accepts are the point)
    return session.generate(vision.ids, max_tokens=n, policy=StrictGreedy(), vision=vision), session


def test_oracle_partial_accepts_after_an_image_equal_plain(vl):
    """Every hook set (the GPU ones run their graph-mode forwards eagerly on CPU: device-held position + delta) x
    rollback strategy, two images before the question."""
    folder, _, model = vl
    plain = _generate(model, folder, None, 24, seeds=(1, 2))[0].token_ids
    for arch, rollback in itertools.product(("base", "rtx", "thor"), ROLLBACK_STRATEGIES):
        out, session = _generate(model, folder, OracleProposer(plain, 320, seed=7), 24, arch, seeds=(1, 2), k=5,
                                 rollback=rollback)
        assert out.token_ids == plain, (arch, rollback)
        assert 0 < out.telemetry.accepted_tokens < out.telemetry.draft_tokens
        assert session.cache.rope_delta == _vision(model, folder, (1, 2)).delta < 0


def test_trees_after_an_image_equal_plain(vl):
    folder, drafter, model = vl
    plain = _generate(model, folder, None, 20)[0].token_ids
    for arch in ("base", "thor"):
        for inner in (NGramProposer(), MTPProposer(model, max_len=256)):
            tree = OracleTree(inner, plain, 320, seed=3)
            out, session = _generate(model, folder, tree, 20, arch, k=5, draft_tree=8)
            assert out.token_ids == plain, (arch, inner.name)
            assert out.telemetry.tree_sibling_accepts > 0


@pytest.mark.parametrize("drafter,tree", [("ngram", "off"), ("suffix", "off"), ("mtp", "off"), ("dflash", "off"),
                                          ("ngram", "8"), ("mtp", "8"), ("dflash", "8")])
def test_every_drafter_with_images_equals_plain_through_the_engine(vl, drafter, tree):
    """The served path: image_url-style parts, Engine.check placing the frames, each real drafter (and trees)."""
    folder, dflash, _ = vl
    frames = [encode_frame(synthetic_frame(90, 130, 1)), encode_frame(synthetic_frame(70, 100, 4), "JPEG")]

    def answer(**settings):
        eng = Engine.load(build_plan(Settings(model=str(folder), device="cpu", max_seq_len=512, prefix_reuse=False,
                                            **settings)))
        content = [{"type": "image"}, {"type": "text", "text": "Left camera, then right:"}, {"type": "image"},
                   {"type": "text", "text": QUESTION}]
        req = Request(messages=[{"role": "user", "content": content}], max_tokens=20,
                      images=[ImageRef(frames[0], "left"), ImageRef(frames[1], "right")])
        return eng.complete(req)

    plain = answer().token_ids
    extra = {"drafter_path": str(dflash)} if drafter == "dflash" else {}
    out = answer(drafter=drafter, draft_tree=tree, num_draft_tokens=5, **extra)
    assert out.token_ids == plain
    assert out.telemetry.vision["images"] == 2 and out.telemetry.vision["encoded"] == 2


def test_repeated_frame_skips_the_encoder_and_another_frame_shares_no_image_rows(vl):
    """Through the engine with prefix reuse: the same frame again resumes past the image (no encoder run), a
    different frame is encoded and answered as without the cache; the encoder cache serves a frame seen lately
    whose rows the prefix cache no longer holds."""
    folder, _, _ = vl
    eng = Engine.load(build_plan(Settings(model=str(folder), device="cpu", max_seq_len=512, drafter="ngram")))
    fresh = Engine.load(build_plan(Settings(model=str(folder), device="cpu", max_seq_len=512, prefix_reuse=False)))

    def ask(engine, seed, text=QUESTION):
        content = [{"type": "image"}, {"type": "text", "text": text}]
        req = Request(messages=[{"role": "user", "content": content}], max_tokens=12,
                      images=[ImageRef(encode_frame(synthetic_frame(90, 130, seed)), "frame")])
        return engine.complete(req)

    first, again, other, back = ask(eng, 1), ask(eng, 1), ask(eng, 2), ask(eng, 1, "Is the cube red?")
    assert first.telemetry.vision["encoded"] == 1 and first.cached_tokens == 0
    assert again.telemetry.vision == {**again.telemetry.vision, "encoded": 0, "prefix_reused": 1}
    assert again.cached_tokens > 0 and again.token_ids == first.token_ids
    assert other.telemetry.vision["encoded"] == 1 and other.token_ids == ask(fresh, 2).token_ids
    assert back.telemetry.vision["encoder_cache_hits"] == 1 and back.telemetry.vision["encoded"] == 0
    assert back.token_ids == ask(fresh, 1, "Is the cube red?").token_ids


def test_prefix_keys_stop_at_a_different_frame(tmp_path):
    """An attention-only VLM resumes at any row: a different frame resumes exactly up to the image's first row,
    the same frame past it, and the answers equal fresh prefills."""
    folder = write_tiny_vl_checkpoint(tmp_path / "attn-vl", seed=5, full_attention_interval=1)
    model = load_target(folder, max_positions=512)
    session = SpecSession.with_defaults(model, select_hooks("base", CPU), None, max_len=256)
    prefix = PrefixCache(session.cache)

    def run(seeds, use_prefix=True):
        vision = _vision(model, folder, seeds)
        out = session.generate(vision.ids, max_tokens=10, policy=StrictGreedy(), prefix=prefix if use_prefix
                               else None, vision=vision)
        return out, vision, prefix.last_reused

    a, va, _ = run((1,))
    b, vb, reused_b = run((2,))
    assert reused_b == vb.starts[0]                               # text before the image only
    c, vc, reused_c = run((2,))
    assert reused_c == len(vc.ids) - 1 and c.telemetry.vision["prefix_reused"] == 1
    assert c.token_ids == b.token_ids
    assert b.token_ids == run((2,), use_prefix=False)[0].token_ids
    assert a.token_ids != b.token_ids
