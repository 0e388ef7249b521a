"""Images on CUDA: the tower in bf16 against its fp32 CPU reference, and captured forwards (CUDA graphs: decode,
chain verify, tree verify and commit, resumed prefills) reading the rope delta on the device -- speculative output
after an image equal to plain eager output in fp32, and a served bf16 request with a repeated frame."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    from edgespec.bench.vision_shapes import write_tiny_vl_checkpoint

    # head_dim 64: the Triton attention kernels' smallest head
    return write_tiny_vl_checkpoint(tmp_path_factory.mktemp("vl-gpu") / "vlm", seed=4, head_dim=64)


def _vision(model, folder, seed=1):
    from edgespec.bench.vision_shapes import synthetic_frame
    from edgespec.loading.images import ProcessorConfig, preprocess
    from edgespec.loading.tokenizer import ChatTokenizer
    from edgespec.models.multimodal import ImageEncoder, VisionPrompt

    image = preprocess(synthetic_frame(120, 160, seed), ProcessorConfig.from_folder(folder, model.config.vision))
    ids = ChatTokenizer.from_folder(folder).encode_chat(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Plan the grasp."}]}])
    return VisionPrompt.place(ids, [image], ImageEncoder(model.visual, model.device))


def test_tower_bf16_on_cuda_matches_fp32_reference(vl_folder):
    from edgespec.loading.checkpoint import load_target

    cpu = load_target(vl_folder, max_positions=512)
    gpu = load_target(vl_folder, dtype=torch.bfloat16, device="cuda", max_positions=512)
    v = _vision(cpu, vl_folder)
    image = v.images[0]
    ref, _ = cpu.visual(image.pixels, image.grid)
    out, _ = gpu.visual(image.pixels.cuda(), image.grid)
    rel = (out.float().cpu() - ref).norm() / ref.norm()
    assert rel < 2e-2, rel


def test_graphed_spec_after_an_image_equals_plain_fp32(vl_folder):
    from test_spec_lossless import OracleProposer
    from test_tree_lossless import OracleTree

    from edgespec.arch.detect import select_hooks
    from edgespec.arch.rollback import ROLLBACK_STRATEGIES
    from edgespec.drafters.ngram import NGramProposer
    from edgespec.loading.checkpoint import load_target
    from edgespec.speculative.acceptance import StrictGreedy
    from edgespec.speculative.session import SpecSession

    dev = torch.device("cuda")
    model = load_target(vl_folder, dtype=torch.float32, device="cuda", max_positions=512)

    def run(proposer, arch="rtx", graphs=True, **knobs):
        v = _vision(model, vl_folder)
        s = SpecSession.with_defaults(model, select_hooks(arch, dev), proposer, max_len=256, cuda_graphs=graphs,
                                      **knobs)
        s.cycle_cost = None
        return s.generate(v.ids, max_tokens=24, policy=StrictGreedy(), vision=v), s

    plain = run(None, graphs=False)[0].token_ids
    for arch in ("rtx", "thor"):
        for rollback in ROLLBACK_STRATEGIES:
            out, s = run(OracleProposer(plain, 320, seed=2), arch, k=5, rollback=rollback)
            assert s.hooks.static[6].graph is not None
            assert out.token_ids == plain, (arch, rollback)
            assert 0 < out.telemetry.accepted_tokens < out.telemetry.draft_tokens
        out, s = run(OracleTree(NGramProposer(), plain, 320, seed=5), arch, k=5, draft_tree=16)
        assert s.hooks.static_trees and out.token_ids == plain, arch
        assert out.telemetry.tree_sibling_accepts > 0


def test_served_bf16_request_with_a_repeated_frame(vl_folder):
    from edgespec.bench.vision_shapes import encode_frame, synthetic_frame
    from edgespec.config import Settings
    from edgespec.engine import Engine, Request
    from edgespec.loading.images import ImageRef
    from edgespec.plan import build_plan

    engine = Engine.load(build_plan(Settings(model=str(vl_folder), device="cuda", max_seq_len=512, drafter="ngram")))
    frame = encode_frame(synthetic_frame(240, 320, seed=3), "JPEG")
    outs = []
    for _ in range(2):
        req = Request(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where?"}]}],
                      images=[ImageRef(frame, "frame")], max_tokens=16)
        outs.append(engine.complete(req))
    assert outs[0].telemetry.vision["encoded"] == 1 and outs[1].telemetry.vision["encoded"] == 0
    assert outs[1].cached_tokens > 0 and outs[1].token_ids == outs[0].token_ids
