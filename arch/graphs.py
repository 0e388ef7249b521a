"""Static-shape forwards for decode and verify, captured as CUDA graphs keyed by row count (not by position).

A :class:`StaticForward` owns device buffers for its tokens and start position. ``run`` copies the new tokens
and position into them and replays the captured graph, so one graph serves every position of every request
(FlashRT keys its verify graphs by position and is cold at each new one). Without CUDA it runs the same
graph-mode forward eagerly, which is how the CPU tests prove the device-position path exact.

Each static forward also computes the strict greedy verdict of its input tokens (the argmax of every row and how
many leading drafts equal the argmax of the row before them, :func:`edgespec.kernels.verify.argmax.greedy_verdict`) in
the same graph, so a greedy accept stage is one copy of ``rows + 1`` integers instead of an argmax over
``rows x vocab`` logits and a handful of launches after the replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from edgespec.cache.model_cache import ModelCache
from edgespec.cache.state import StateMode
from edgespec.kernels.verify.argmax import greedy_verdict
from edgespec.models.decoder import ForwardOutput, TargetModel


def capture_graph(body: Callable[[], Any], warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run ``body`` ``warmups`` times on a side stream (Triton compiles, cuBLAS picks algorithms), then capture it
    as a CUDA graph. Returns the graph and what the captured call returned (its static output buffers)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    return graph, out


class StaticForward:
    """A forward of exactly ``rows`` tokens at a device-held position, optionally captured as a CUDA graph."""

    def __init__(self, model: TargetModel, cache: ModelCache, rows: int, taps: Sequence[int], mode: StateMode,
                 capture: bool) -> None:
        self.model, self.cache, self.rows = model, cache, rows
        self.taps, self.mode = tuple(taps), mode
        device = model.device
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: ForwardOutput | None = None
        if capture and device.type == "cuda":
            self._capture()

    def _forward(self) -> ForwardOutput:
        out = self.model.forward(self.tokens, self.cache, taps=self.taps, mode=self.mode, chunked=False,
                                 pos_t=self.pos)
        out.greedy = greedy_verdict(out.logits, self.tokens)
        return out

    def _capture(self) -> None:
        # The warm-up writes cache rows at position 0: callers capture before serving and reset the cache afterwards.
        self.graph, self.out = capture_graph(self._forward)

    def run(self, tokens: torch.Tensor, cache: ModelCache) -> ForwardOutput:
        """Forward ``tokens`` (exactly ``rows`` of them) at ``cache.length``; advances the cache."""
        if cache is not self.cache or tokens.shape[0] != self.rows:
            raise ValueError("StaticForward used with another cache or row count")
        start = cache.length
        cache.check_room(start, self.rows)
        self.tokens.copy_(tokens, non_blocking=True)
        self.pos.fill_(start)
        if self.mode is StateMode.CHECKPOINT:
            cache.mark_checkpointed_forward(start, self.rows)
        elif self.mode is StateMode.DEFER:
            cache.begin_deferred_forward(start, self.rows)
        if self.graph is not None:
            self.graph.replay()
            out = self.out
        else:
            out = self._forward()
        cache.length = start + self.rows
        return out
