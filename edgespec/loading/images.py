"""Images into vision-tower patches: ``data:`` URLs and files decoded (PNG, JPEG, WebP) and preprocessed exactly as
the checkpoint's image processor does.

The rules are those of transformers' ``Qwen2VLImageProcessorPil`` (the image processor Qwen3.5/3.6 and Qwen3-VL
checkpoints name, on its Pillow backend), read from ``preprocessor_config.json``:

* RGB, transparency composited onto white;
* resized (Pillow bicubic) to the nearest multiple of ``patch_size * merge_size`` (32) per side, scaled so the pixel
  count lies within ``[min_pixels, max_pixels]`` (:func:`smart_resize`: aspect kept, at most 200:1);
* ``x / 255`` in float64, then ``(x - mean) / std`` in float32 (mean = std = 0.5 for Qwen3.5);
* cut into ``patch_size`` squares in 2 x 2 merge blocks, each repeated over ``temporal_patch_size`` frames and
  flattened channel, frame, row, column -- the vision tower's input (:class:`edgespec.models.vision.VisionTower`).

A request's images are decoded here before any device work, so every bad image is a :class:`ImageError` (a 400 from
the server) that names the field: not a data URL, a remote URL (a robot service does not fetch from the network), a
format other than PNG/JPEG/WebP, a truncated file, or a size over the limits of :class:`ImageLimits`. The image's
identity for the caches is the SHA-256 of its decoded pixels (:attr:`PromptImage.digest`): two encodings of the
same frame are the same image, two different frames never are.

Pillow is imported on first use (a runtime dependency of edgespec, needed only by requests with images).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgespec.errors import CheckpointError, ImageError
from edgespec.loading.hf_config import read_json
from edgespec.models.config import VisionConfig
from edgespec.models.multimodal import PromptImage

FORMATS = ("PNG", "JPEG", "WEBP")
MIME_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send (Settings ``max_images``, ``max_image_bytes``, ``max_image_pixels``)."""

    max_images: int = 4
    max_bytes: int = 8 << 20          # encoded size of one image
    max_pixels: int = 4096 * 4096      # width x height of one decoded image (before resizing)


@dataclass(frozen=True)
class ProcessorConfig:
    """The image processor's parameters (``preprocessor_config.json``; defaults: Qwen3.5's)."""

    min_pixels: int = 65536
    max_pixels: int = 16777216
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        """Side lengths are multiples of this (a merged token covers factor x factor pixels)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_folder(cls, folder: Path, vision: VisionConfig, max_pixels: int | None = None) -> ProcessorConfig:
        """Read ``folder/preprocessor_config.json`` (absent: Qwen3.5's defaults with the tower's patch sizes);
        ``max_pixels`` lowers the resize bound (Settings ``image_max_pixels``: fewer tokens per frame)."""
        path = folder / "preprocessor_config.json"
        raw: dict[str, Any] = read_json(path) if path.is_file() else {}
        size = raw.get("size") or {}
        lo = int(raw.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels)
        hi = int(raw.get("max_pixels") or size.get("longest_edge") or cls.max_pixels)
        cfg = cls(min_pixels=lo, max_pixels=hi if max_pixels is None else min(hi, max_pixels),
                  patch_size=int(raw.get("patch_size", vision.patch_size)),
                  merge_size=int(raw.get("merge_size", vision.spatial_merge_size)),
                  temporal_patch_size=int(raw.get("temporal_patch_size", vision.temporal_patch_size)),
                  image_mean=tuple(float(x) for x in raw.get("image_mean", cls.image_mean)),
                  image_std=tuple(float(x) for x in raw.get("image_std", cls.image_std)),
                  rescale_factor=float(raw.get("rescale_factor", cls.rescale_factor)))
        if (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size) != (
                vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size):
            raise CheckpointError(f"{path}: patch {cfg.patch_size} / merge {cfg.merge_size} / temporal "
                                  f"{cfg.temporal_patch_size} differ from the vision_config's")
        if not 0 < cfg.min_pixels <= cfg.max_pixels:
            raise CheckpointError(f"{path}: min_pixels {cfg.min_pixels} and max_pixels {cfg.max_pixels} (after "
                                  "image_max_pixels) must satisfy 0 < min <= max")
        return cfg


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The processor's target size: both sides multiples of ``factor``, ``min_pixels <= h * w <= max_pixels``, the
    aspect ratio kept as far as that allows (transformers' ``smart_resize``, Python's round-half-even included).

    Example: 640 x 480 at factor 32 -> (480, 640) as it is; 1280 x 720 -> (704, 1280); 64 x 48 with
    min_pixels 65536 -> (224, 320)."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image of {width}x{height} pixels: the aspect ratio must be below 200:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def data_url_bytes(url: str, limits: ImageLimits, where: str) -> bytes:
    """The encoded image of a ``data:image/...;base64,`` URL; remote and other URLs are refused by name."""
    head, sep, payload = url.partition(",")
    scheme = head.split(":", 1)[0].lower() if ":" in head else ""
    if scheme in ("http", "https", "ftp", "file") or (not sep and "://" in url):
        raise ImageError(f"{where}: remote image URLs are not fetched (a robot service does not reach the network); "
                         "send the image inline as a data:image/png|jpeg|webp;base64,... URL", where)
    if scheme != "data" or not sep:
        raise ImageError(f"{where}: the image URL must be a data: URL (data:image/jpeg;base64,...)", where)
    meta = head[len("data:"):].split(";")
    mime = meta[0].lower()
    if mime not in MIME_TYPES:
        raise ImageError(f"{where}: data URL of type {mime or 'none'!r}; images must be image/png, image/jpeg or "
                         "image/webp", where)
    if "base64" not in (m.lower() for m in meta[1:]):
        raise ImageError(f"{where}: the data URL must be base64-encoded (;base64,)", where)
    if len(payload) > 4 * (limits.max_bytes // 3 + 2):
        raise ImageError(f"{where}: image of more than {limits.max_bytes} bytes (max_image_bytes)", where)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: the data URL's base64 payload is not valid base64", where) from None
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: image of {len(data)} bytes is over max_image_bytes {limits.max_bytes}", where)
    return data


def decode_image(data: bytes, limits: ImageLimits, where: str) -> np.ndarray:
    """Decode PNG / JPEG / WebP bytes to RGB ``uint8 [H, W, 3]`` (transparency over white, as the processor does).
    The pixel count is checked from the header, before decoding; a truncated or corrupt file is refused."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: image of {len(data)} bytes is over max_image_bytes {limits.max_bytes}", where)
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageError(f"{where}: not a PNG, JPEG or WebP image", where) from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{where}: the image cannot be read: {e}", where) from None
    w, h = img.size
    if w < 1 or h < 1 or w * h > limits.max_pixels:
        raise ImageError(f"{where}: image of {w}x{h} pixels is over max_image_pixels {limits.max_pixels}", where)
    try:
        img.load()                       # decodes now: a truncated file fails here, not later
        has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
        if has_alpha:
            rgba = img.convert("RGBA")
            rgb = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
        else:
            rgb = img.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageError(f"{where}: the {img.format} image is truncated or corrupt: {e}", where) from None
    return np.asarray(rgb)


def pixel_digest(rgb: np.ndarray) -> str:
    """SHA-256 of an RGB frame's size and pixels: its identity for the encoder and prefix caches."""
    h = hashlib.sha256(f"{rgb.shape[0]}x{rgb.shape[1]}:".encode())
    h.update(np.ascontiguousarray(rgb).tobytes())
    return h.hexdigest()


def preprocess(rgb: np.ndarray, cfg: ProcessorConfig, source: str = "") -> PromptImage:
    """RGB ``uint8 [H, W, 3]`` -> the tower's patches (see the module doc for each step)."""
    from PIL import Image

    height, width = rgb.shape[:2]
    h_bar, w_bar = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    resized = np.asarray(Image.fromarray(rgb).resize((w_bar, h_bar), resample=Image.Resampling.BICUBIC))
    x = (resized.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = (x - np.array(cfg.image_mean, dtype=np.float32)) / np.array(cfg.image_std, dtype=np.float32)
    x = x.transpose(2, 0, 1)                                                      # [C, H, W]
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = h_bar // p, w_bar // p
    patches = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)   # [gh/m, gw/m, m, m, C, p, p]
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    flat = np.ascontiguousarray(patches).reshape(gh * gw, 3 * t * p * p)
    return PromptImage(torch.from_numpy(flat), (1, gh, gw), pixel_digest(rgb), source)


def load_image(source: str | bytes | Path, cfg: ProcessorConfig, limits: ImageLimits, where: str = "image"
               ) -> PromptImage:
    """One image from a ``data:`` URL (str), encoded bytes, or a file path, preprocessed."""
    if isinstance(source, Path):
        try:
            data = source.read_bytes()
        except OSError as e:
            raise ImageError(f"{where}: cannot read image file {source}: {e.strerror or e}", where) from None
    elif isinstance(source, str):
        data = data_url_bytes(source, limits, where)
    else:
        data = source
    return preprocess(decode_image(data, limits, where), cfg, where)


@dataclass(frozen=True)
class ImageRef:
    """One image of a request before decoding: a ``data:`` URL, encoded bytes or a file path, and the request field
    it came from (named by every error about it)."""

    data: str | bytes | Path
    where: str = "image"
