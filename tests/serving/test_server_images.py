"""Images on /v1/chat/completions: data: URLs (PNG, JPEG, WebP) answered, a repeated frame served without the
encoder, and every bad image a 400 that names the problem and the field -- no traceback logged, the server still
serving -- on the tiny random Qwen3.5 VLM and, for "an image to a text-only model", the tiny chat Llama.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from serving_helpers import ServerThread, app_for, write_tiny_chat_model

from edgespec.bench.vision_shapes import data_url, encode_frame, synthetic_frame, write_tiny_vl_checkpoint
from edgespec.config import Settings

pytest.importorskip("PIL")
MODEL = "tiny-vl"
LIMITS = dict(max_images=2, max_image_bytes=150_000, max_image_pixels=400 * 400)


def _settings(folder: Path, **extra) -> Settings:
    return Settings(model=str(folder), device="cpu", max_seq_len=1024, drafter="ngram", served_model_name=MODEL,
                    max_tokens=8, max_body_bytes=4 << 20, **LIMITS, **extra)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerThread]:
    folder = write_tiny_vl_checkpoint(tmp_path_factory.mktemp("srv-vl") / "vlm", seed=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    settings = _settings(folder)
    with ServerThread(app_for(settings)) as s:
        yield s
    torch.set_num_threads(threads)


def _chat(s: ServerThread, *urls: str, text: str = "Where is the red cube?") -> httpx.Response:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    return httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120)


def _frame_url(seed: int = 1, fmt: str = "PNG", shape=(90, 130)) -> str:
    return data_url(encode_frame(synthetic_frame(*shape, seed=seed), fmt), fmt)


def test_png_jpeg_webp_frames_are_answered_and_a_repeat_skips_the_encoder(server):
    for fmt in ("PNG", "JPEG", "WEBP"):
        r = _chat(server, _frame_url(3, fmt))
        assert r.status_code == 200, r.text
        vision = r.json()["edgespec"]["vision"]
        assert vision["images"] == 1 and vision["image_tokens"] > 0
    first = _chat(server, _frame_url(5)).json()
    again = _chat(server, _frame_url(5)).json()
    assert first["edgespec"]["vision"]["encoded"] == 1
    assert again["edgespec"]["vision"]["encoded"] == 0          # prefix cache (or encoder cache): no tower run
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    two = _chat(server, _frame_url(6), _frame_url(7, "JPEG"))
    assert two.status_code == 200 and two.json()["edgespec"]["vision"]["images"] == 2


def _truncated_png() -> str:
    data = encode_frame(synthetic_frame(90, 130, seed=8))
    return "data:image/png;base64," + base64.b64encode(data[: len(data) // 2]).decode()


BAD = [
    ("truncated", _truncated_png, "truncated or corrupt"),
    ("not-an-image", lambda: "data:image/png;base64," + base64.b64encode(b"hello robot" * 20).decode(),
     "not a PNG, JPEG or WebP"),
    ("text-data-url", lambda: "data:text/plain;base64," + base64.b64encode(b"hi").decode(), "image/png"),
    ("bad-base64", lambda: "data:image/png;base64,@@@not-base64@@@", "not valid base64"),
    ("remote", lambda: "https://example.com/frame.jpg", "remote image URLs are not fetched"),
    ("too-many-pixels", lambda: _frame_url(1, "JPEG", (420, 420)), "max_image_pixels"),
    ("too-many-bytes", lambda: data_url(b"\x89PNG" + b"\0" * 200_000), "max_image_bytes"),
]


@pytest.mark.parametrize("name,url,words", BAD, ids=[b[0] for b in BAD])
def test_bad_image_is_a_400_naming_it_and_the_server_keeps_serving(server, caplog, name, url, words):
    with caplog.at_level(logging.INFO):
        r = _chat(server, url())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_image" and words in err["message"], err
    assert err["param"] == "messages[0].content[0]"
    assert not [rec for rec in caplog.records if rec.exc_info or "Traceback" in rec.getMessage()]
    assert _chat(server, _frame_url(1)).status_code == 200


def test_more_images_than_max_images_is_a_400(server):
    r = _chat(server, _frame_url(1), _frame_url(2), _frame_url(3))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_image" and "at most 2 (max_images)" in err["message"]


def test_image_part_without_url_and_unknown_part_types_are_400s(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]"
    body["messages"][0]["content"] = [{"type": "input_audio", "input_audio": {}}]
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content"


def test_an_image_to_a_text_only_model_is_a_400(tmp_path, caplog):
    folder = write_tiny_chat_model(tmp_path / "text")
    settings = Settings(model=str(folder), max_seq_len=256, served_model_name=MODEL, max_tokens=4)
    with ServerThread(app_for(settings)) as s, caplog.at_level(logging.INFO):
        r = _chat(s, _frame_url(1))
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "invalid_image" and "text-only model" in err["message"]
        ok = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert ok.status_code == 200
    assert not [rec for rec in caplog.records if rec.exc_info]
