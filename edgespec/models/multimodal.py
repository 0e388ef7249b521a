"""Images inside a prompt: where their tokens sit, their multimodal RoPE positions, and their features.

A prompt with an image holds ``<|vision_start|>``, one ``<|image_pad|>`` per merged patch (``t*h*w/4`` of them),
``<|vision_end|>``. The text model replaces the pad rows' embeddings by the vision tower's tokens and gives every row
a (temporal, height, width) position (M-RoPE, as transformers' ``get_rope_index``):

* a text row at offset ``p`` from the last position handed out takes ``(p, p, p)``;
* an image starting at position ``s`` takes ``(s + frame, s + row, s + column)`` over its merged grid, and the text
  after it continues from ``s + max(h, w) / merge`` -- not from ``s + tokens``.

So after the prompt a row's position is its cache index plus a constant, the *rope delta*
(:attr:`VisionPrompt.delta`; negative after an image): decode, verify, draft trees and rollbacks keep using cache
indices and the model adds the delta (:meth:`edgespec.cache.model_cache.ModelCache.set_rope_delta`), and a text row's
three positions being equal makes its angles plain RoPE's at that position.

:class:`VisionPrompt` ties one request's images to its prompt ids: the expanded ids, every row's position, the prefix
cache's keys (image rows keyed by a digest of the decoded pixels, so a repeated frame resumes from the cache and two
different frames never share a prefix), and the features of the rows a prefill still computes, taken from the
:class:`ImageEncoder` (the tower behind a small cache of recent frames: a repeated frame skips the encoder).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from edgespec.errors import ImageError
from edgespec.models.config import VisionConfig
from edgespec.models.mrope import prompt_positions
from edgespec.models.vision import VisionTower


@dataclass
class PromptImage:
    """One preprocessed image (:func:`edgespec.loading.images.preprocess`): patches in the processor's layout."""

    pixels: torch.Tensor               # [t*h*w, patch_dim] float32, normalised
    grid: tuple[int, int, int]         # (t, h, w) in patches
    digest: str                        # sha256 of the decoded RGB pixels and their size: the image's identity
    source: str = ""                   # where it came from (request field or file), for messages

    def tokens(self, merge: int) -> int:
        """Prompt rows (``<|image_pad|>`` tokens) of this image."""
        t, h, w = self.grid
        return t * (h // merge) * (w // merge)


@dataclass
class ImageRows:
    """What a forward needs of the images among its rows: every row's M-RoPE position and the tower's tokens for
    the rows that are image tokens (their embeddings replace the pad token's)."""

    positions: torch.Tensor            # [T, 3] int64: (t, h, w) of every row of the forward
    rows: torch.Tensor                 # [n] int64: forward rows that are image tokens
    embeds: torch.Tensor               # [n, hidden] the tower's tokens for them
    deepstack: list[torch.Tensor] = field(default_factory=list)   # per deepstack layer: [n, hidden]

    def piece(self, start: int, stop: int) -> ImageRows:
        """The rows ``start:stop`` of this forward (a prefill chunk), renumbered from 0."""
        keep = (self.rows >= start) & (self.rows < stop)
        return ImageRows(self.positions[start:stop], self.rows[keep] - start, self.embeds[keep],
                         [d[keep] for d in self.deepstack])


class ImageEncoder:
    """The vision tower behind a cache of the last ``max_cached`` images' tokens, keyed by pixel digest: a robot
    that sends the same frame again (a retry, a follow-up question) does not pay for the encoder twice."""

    def __init__(self, tower: VisionTower, device: torch.device, max_cached: int = 4) -> None:
        self.tower, self.device, self.max_cached = tower, device, max_cached
        self._cache: OrderedDict[str, tuple[torch.Tensor, list[torch.Tensor]]] = OrderedDict()

    @property
    def config(self) -> VisionConfig:
        return self.tower.config

    def lookup(self, image: PromptImage) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        hit = self._cache.get(image.digest)
        if hit is not None:
            self._cache.move_to_end(image.digest)
        return hit

    def encode(self, image: PromptImage) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tower's tokens (and deepstack features) of ``image``, computed now and cached."""
        out = self.tower(image.pixels.to(self.device), image.grid)
        if self.max_cached > 0:
            self._cache[image.digest] = out
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return out


@dataclass
class VisionStats:
    """What the images of one request cost (telemetry): rows, and how each image's tokens were obtained."""

    images: int = 0
    image_tokens: int = 0
    encoded: int = 0                 # images run through the tower for this request
    encoder_cache_hits: int = 0      # images whose tokens the encoder cache held (same pixels seen lately)
    prefix_reused: int = 0           # images whose rows the prefix cache already held (no tokens needed)
    encode_ms: float = 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {"images": self.images, "image_tokens": self.image_tokens, "encoded": self.encoded,
                "encoder_cache_hits": self.encoder_cache_hits, "prefix_reused": self.prefix_reused,
                "encode_ms": round(self.encode_ms, 3)}


class VisionPrompt:
    """One request's images placed in its prompt ids (see the module doc). Build with :meth:`place`."""

    def __init__(self, ids: list[int], images: list[PromptImage], starts: list[int], encoder: ImageEncoder) -> None:
        self.ids, self.images, self.starts, self.encoder = ids, images, starts, encoder
        merge = encoder.config.spatial_merge_size
        self.merge_unit = encoder.config.merge_unit
        self.counts = [im.tokens(merge) for im in images]
        self.positions, self.delta = prompt_positions(len(ids), list(zip(starts, (im.grid for im in images),
                                                                          strict=True)), merge)
        self.stats = VisionStats(len(images), sum(self.counts))
        self._features: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    @classmethod
    def place(cls, ids: Sequence[int], images: list[PromptImage], encoder: ImageEncoder) -> VisionPrompt:
        """Expand the ``<|image_pad|>`` of each image in ``ids`` (one per image, in order, as the chat template
        renders them) to the image's rows. Raises :class:`ImageError` when the counts differ."""
        pad = encoder.config.image_token_id
        merge = encoder.config.spatial_merge_size
        slots = [i for i, t in enumerate(ids) if t == pad]
        if len(slots) != len(images):
            raise ImageError(f"the prompt has {len(slots)} image placeholder(s) for {len(images)} image(s): the chat "
                             "template must render each image part once (and text must not contain image tokens)")
        out: list[int] = []
        starts: list[int] = []
        prev = 0
        for slot, image in zip(slots, images, strict=True):
            out.extend(ids[prev:slot])
            starts.append(len(out))
            out.extend([pad] * image.tokens(merge))
            prev = slot + 1
        out.extend(ids[prev:])
        return cls(out, images, starts, encoder)

    def keys(self, ids: Sequence[int]) -> list[int | tuple[str, int]]:
        """The prefix cache's key of every row of ``ids`` (this prompt, possibly with generated tokens after it):
        token ids, except image rows, which are ``(pixel digest, row of the image)``."""
        keys: list[int | tuple[str, int]] = list(ids)
        for start, n, image in zip(self.starts, self.counts, self.images, strict=True):
            keys[start:start + n] = [(image.digest, r) for r in range(n)]
        return keys

    def encode_from(self, start: int) -> VisionStats:
        """Get the tokens of every image with rows at or after ``start`` (the rows a prefill still computes): from
        the encoder's cache or the tower. Images wholly before ``start`` are in the prefix cache already."""
        t0 = time.perf_counter()
        for i, (first, n, image) in enumerate(zip(self.starts, self.counts, self.images, strict=True)):
            if first + n <= start:
                self.stats.prefix_reused += 1
                continue
            hit = self.encoder.lookup(image)
            if hit is not None:
                self.stats.encoder_cache_hits += 1
            else:
                hit = self.encoder.encode(image)
                self.stats.encoded += 1
            self._features[i] = hit
        self.stats.encode_ms += (time.perf_counter() - t0) * 1000.0
        return self.stats

    def rows(self, start: int, stop: int) -> ImageRows | None:
        """What a forward of prompt rows ``start:stop`` needs (None when no image row is among them: the rows then
        sit at cache index + the delta of the image before them, see :meth:`delta_at`)."""
        parts = [(i, first, n) for i, (first, n) in enumerate(zip(self.starts, self.counts, strict=True))
                 if first < stop and first + n > start]
        if not parts:
            return None
        rows, embeds, deep = [], [], []
        for i, first, n in parts:
            if i not in self._features:
                raise RuntimeError(f"image {i} has no tokens: call encode_from({start}) before the prefill")
            tokens, deepstack = self._features[i]
            lo, hi = max(first, start), min(first + n, stop)
            rows.append(torch.arange(lo, hi) - start)
            embeds.append(tokens[lo - first:hi - first])
            deep.append([d[lo - first:hi - first] for d in deepstack])
        device = embeds[0].device
        n_deep = len(deep[0])
        return ImageRows(self.positions[start:stop].to(device), torch.cat(rows).to(device), torch.cat(embeds),
                         [torch.cat([d[k] for d in deep]) for k in range(n_deep)])

    def delta_at(self, row: int) -> int:
        """The rope delta of text row ``row``: position minus cache index (that of the last image before it)."""
        if row >= len(self.ids):
            return self.delta
        return int(self.positions[row, 0]) - row
