"""Golden checks of images against Hugging Face transformers on a tiny random Qwen3.5 VLM (fp32, CPU).

The image processor (pixel values bit for bit against ``Qwen2VLImageProcessorPil``, resize rule against
``smart_resize``), the vision tower against ``Qwen3_5VisionModel``, M-RoPE positions against ``get_rope_index``,
then the whole model: prefill logits of a prompt with images within the text golden tests' tolerance, greedy tokens
equal to ``Qwen3_5ForConditionalGeneration.generate`` token for token, and an answer that depends on the image.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL")

from PIL import Image  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: E402
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize  # noqa: E402

from edgespec.bench.vision_shapes import (  # noqa: E402
    TINY_MAX_PIXELS,
    TINY_MIN_PIXELS,
    encode_frame,
    synthetic_frame,
    write_tiny_vl_checkpoint,
)
from edgespec.config import Settings  # noqa: E402
from edgespec.engine import Engine, Request  # noqa: E402
from edgespec.loading.checkpoint import load_target  # noqa: E402
from edgespec.loading.images import ImageLimits, ImageRef, ProcessorConfig, decode_image, preprocess, smart_resize  # noqa: E402
from edgespec.loading.tokenizer import ChatTokenizer  # noqa: E402
from edgespec.models.multimodal import ImageEncoder, VisionPrompt  # noqa: E402
from edgespec.plan import build_plan  # noqa: E402

TOL = 1e-4          # the text golden tests' bound (tests/models/test_golden.py)
QUESTION = "Where is the red cube?"


@pytest.fixture(autouse=True)
def _torch_matmul_on_cpu():
    """transformers' own CPU matmul, as in tests/models/test_golden.py (an engine switches to OpenBLAS)."""
    from edgespec.kernels.quant.linear import configure_cpu, cpu_blas_active

    was_active = cpu_blas_active()
    configure_cpu(False)
    yield
    if was_active:
        configure_cpu(True)


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    return write_tiny_vl_checkpoint(tmp_path_factory.mktemp("vl") / "tiny-vl", seed=3)


@pytest.fixture(scope="module")
def ours(vl_folder):
    return load_target(vl_folder, max_positions=1024, merge=False)


@pytest.fixture(scope="module")
def hf(vl_folder):
    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(vl_folder, dtype=torch.float32).eval()


def _hf_processor(**size):
    return Qwen2VLImageProcessorPil(size=size or {"shortest_edge": TINY_MIN_PIXELS, "longest_edge": TINY_MAX_PIXELS},
                                    patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3)


def _prompt(ours, vl_folder, frames, text=QUESTION):
    """The expanded prompt of one user turn with ``frames`` then ``text``, and its VisionPrompt."""
    proc = ProcessorConfig.from_folder(vl_folder, ours.config.vision)
    images = [preprocess(f, proc) for f in frames]
    content = [{"type": "image"} for _ in frames] + [{"type": "text", "text": text}]
    ids = ChatTokenizer.from_folder(vl_folder).encode_chat([{"role": "user", "content": content}])
    vision = VisionPrompt.place(ids, images, ImageEncoder(ours.visual, torch.device("cpu")))
    vision.encode_from(0)
    return vision, images


def _hf_inputs(vision, images):
    ids = torch.tensor(vision.ids)[None]
    return dict(input_ids=ids, pixel_values=torch.cat([im.pixels for im in images]),
                image_grid_thw=torch.tensor([im.grid for im in images]),
                mm_token_type_ids=(ids == vision.encoder.config.image_token_id).int())


def test_resize_rule_matches_transformers():
    sizes = [(480, 640), (720, 1280), (1080, 1920), (48, 64), (31, 33), (17, 3000), (999, 1001), (2000, 1500)]
    for h, w in sizes:
        for lo, hi in ((TINY_MIN_PIXELS, TINY_MAX_PIXELS), (65536, 16777216), (3136, 1003520)):
            assert smart_resize(h, w, 32, lo, hi) == hf_smart_resize(h, w, 32, lo, hi), (h, w, lo, hi)


@pytest.mark.parametrize("shape,fmt,size", [
    ((90, 130), "PNG", None),                       # resized up (min_pixels), odd sides
    ((300, 420), "JPEG", None),                     # resized down (max_pixels)
    ((480, 640), "WEBP", {"shortest_edge": 65536, "longest_edge": 16777216}),   # Qwen3.5's bounds: kept as it is
])
def test_pixel_values_match_transformers(shape, fmt, size):
    frame = synthetic_frame(*shape, seed=4)
    rgb = decode_image(encode_frame(frame, fmt), ImageLimits(), "image")
    size = size or {"shortest_edge": TINY_MIN_PIXELS, "longest_edge": TINY_MAX_PIXELS}
    ours = preprocess(rgb, ProcessorConfig(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]))
    ref = _hf_processor(**size)(images=[Image.fromarray(rgb)], return_tensors="pt")
    assert list(ref["image_grid_thw"][0]) == list(ours.grid)
    assert torch.equal(ref["pixel_values"], ours.pixels)


def test_transparent_png_is_composited_on_white_as_transformers_does():
    rgba = synthetic_frame(64, 96, seed=2)
    alpha = (torch.arange(96).repeat(64, 1) * 2).clamp(max=255).numpy().astype("uint8")
    img = Image.fromarray(rgba).convert("RGBA")
    img.putalpha(Image.fromarray(alpha))
    import io
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    ours = preprocess(decode_image(buf.getvalue(), ImageLimits(), "image"), ProcessorConfig(TINY_MIN_PIXELS,
                                                                                            TINY_MAX_PIXELS))
    ref = _hf_processor()(images=[Image.open(io.BytesIO(buf.getvalue()))], return_tensors="pt")
    assert torch.equal(ref["pixel_values"], ours.pixels)


def test_tower_matches_transformers(ours, hf, vl_folder):
    proc = ProcessorConfig.from_folder(vl_folder, ours.config.vision)
    for shape in ((90, 130), (256, 200)):
        im = preprocess(synthetic_frame(*shape, seed=5), proc)
        tokens, deep = ours.visual(im.pixels, im.grid)
        with torch.no_grad():
            ref = hf.model.get_image_features(im.pixels, torch.tensor([im.grid])).pooler_output[0]
        assert tokens.shape == ref.shape and not deep
        assert (tokens - ref).abs().max().item() < 1e-5


def test_positions_match_transformers(ours, hf, vl_folder):
    """Two images with text between and after: every row's (t, h, w) and the delta after the prompt."""
    vision, images = _prompt(ours, vl_folder, [synthetic_frame(90, 130, 1), synthetic_frame(130, 70, 2)])
    inputs = _hf_inputs(vision, images)
    pos, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                         image_grid_thw=inputs["image_grid_thw"])
    assert torch.equal(pos[:, 0].T, vision.positions)
    assert int(delta) == vision.delta < 0


@pytest.mark.parametrize("n_images", [1, 2])
def test_prefill_logits_with_images_match_transformers(ours, hf, vl_folder, n_images):
    """One image: logits of every row, end to end (pixels in), within TOL. Two images: the same with transformers
    given our tower's tokens (``mm_encoder_outputs``; the towers are compared on their own above): end to end,
    transformers' tower runs both images through each product at once and ours one image at a time, and the
    random text model amplifies that 2e-6 rounding to ~1.3e-4."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    frames = [synthetic_frame(90, 130, 1), synthetic_frame(120, 160, 6)][:n_images]
    vision, images = _prompt(ours, vl_folder, frames)
    T = len(vision.ids)
    rows = vision.rows(0, T)
    out = ours.forward(torch.tensor(vision.ids), ours.new_cache(256), images=rows)
    inputs = _hf_inputs(vision, images)
    if n_images > 1:
        del inputs["pixel_values"]
        tokens = BaseModelOutputWithPooling(pooler_output=tuple(torch.split(rows.embeds, vision.counts)))
        inputs["mm_encoder_outputs"] = {"image": tokens}
    with torch.no_grad():
        ref = hf(**inputs).logits[0]
    assert (out.logits - ref).abs().max().item() < TOL
    # Chunked so that chunks split the images: the same logits (positions and tokens sliced per chunk).
    cache = ours.new_cache(256)
    last = ours.prefill(torch.tensor(vision.ids), cache, chunk=5, images=vision.rows(0, T)).logits[-1]
    assert (last - ref[-1]).abs().max().item() < TOL


def test_greedy_tokens_with_an_image_match_transformers_generate(hf, vl_folder):
    """The engine's plain greedy answer to a prompt with an image equals transformers' generate token for token
    (decode steps after the image run at cache index + the rope delta)."""
    frame = synthetic_frame(90, 130, seed=1)
    engine = Engine.load(build_plan(Settings(model=str(vl_folder), device="cpu", max_seq_len=512, cpu_blas=False)))
    req = Request(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                  images=[ImageRef(encode_frame(frame), "frame")], max_tokens=16)
    out = engine.complete(req)
    vision = req.vision
    images = vision.images
    with torch.no_grad():
        ref = hf.generate(**_hf_inputs(vision, images), max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert out.token_ids == ref[0, len(vision.ids):].tolist()


def test_the_answer_depends_on_the_image(ours, vl_folder):
    """Another frame (same prompt text) moves the logits well beyond rounding and changes the greedy answer."""
    logits, answers = [], []
    for seed in (1, 2):
        vision, _ = _prompt(ours, vl_folder, [synthetic_frame(90, 130, seed)])
        out = ours.forward(torch.tensor(vision.ids), ours.new_cache(256), images=vision.rows(0, len(vision.ids)))
        logits.append(out.logits[-1])
        answers.append(int(out.logits[-1].argmax()))
    assert (logits[0] - logits[1]).abs().max().item() > 100 * TOL
    engine = Engine.load(build_plan(Settings(model=str(vl_folder), device="cpu", max_seq_len=512, cpu_blas=False)))
    outs = []
    for seed in (1, 2):
        req = Request(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                      images=[ImageRef(encode_frame(synthetic_frame(90, 130, seed)), "frame")], max_tokens=8)
        outs.append(engine.complete(req).token_ids)
    assert outs[0] != outs[1]


def test_text_rows_get_plain_rope_from_multimodal_positions(ours):
    """Three equal positions give exactly the 1-D table's angles (text rows of an image prompt, and why the
    rows after it only need cache index + delta)."""
    pos = torch.arange(40, 60)
    cs = ours.rope.angles(40, 20, None, torch.float32)
    cm = ours.rope.angles_mrope(pos[:, None].expand(20, 3), torch.float32)
    assert torch.equal(cs[0], cm[0]) and torch.equal(cs[1], cm[1])
