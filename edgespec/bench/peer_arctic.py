"""Snowflake's Arctic Inference suffix decoding as a proposer: the peer of our suffix drafter in ``bench session``.

Arctic Inference (``arctic-inference`` on PyPI, 0.3.0) ships SuffixDecoding (arXiv 2411.04975) as a C++ suffix tree
with a Python cache, ``arctic_inference.suffix_decoding.SuffixDecodingCache``: per request a tree over its prompt
and output, and one global tree over the outputs of earlier requests; each speculation takes the better-scoring of
the two trees' drafts. :class:`ArcticSuffixProposer` drives that cache through edgespec's proposer protocol, so the
session bench runs it on the same model, request stream and verify as our suffix drafter and prints both
acceptance lengths side by side. It is a benchmark peer only: edgespec never imports it at run time, and the
package is built from its sdist by ``tools/setup.sh`` (its suffix tree needs a C++ compiler, cmake and nanobind;
no CUDA and no vLLM).

Knobs are Arctic's own defaults as vLLM passes them (``suffix_decoding_max_tree_depth`` 24, ``max_spec_factor``
1.0, ``min_token_prob`` 0.1), the draft capped by the session's K like every column; outputs are kept per client
partition, as our suffix cache keeps them (one Arctic cache per partition).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from edgespec.drafters.base import Draft, Proposer
from edgespec.drafters.suffix_cache import partition_of
from edgespec.errors import ConfigError
from edgespec.models.decoder import ForwardOutput

INSTALL_HINT = ("build it with tools/setup.sh (pip install --no-build-isolation --no-deps arctic-inference==0.3.0 "
                "after nanobind==2.9.2, ninja and grpcio-tools; needs a C++ compiler and cmake)")


def arctic_available() -> str | None:
    """None when Arctic Inference's suffix decoding imports, else why not (for the bench to print)."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
    except Exception as e:       # an ImportError, or a compiled extension that does not load
        return f"arctic-inference suffix decoding unavailable ({type(e).__name__}: {e}); {INSTALL_HINT}"
    return None


class ArcticSuffixProposer(Proposer):
    """Arctic Inference's ``SuffixDecodingCache`` behind the proposer protocol (module docstring).

    Lifecycle: :meth:`begin` starts an Arctic request with the prompt (the previous one is stopped: its output
    stays in the global tree), :meth:`commit` appends the emitted tokens to it, :meth:`propose` speculates from the
    last ``max_depth`` tokens. :meth:`select` picks the client partition for the next request (the engine calls it
    as it calls our suffix cache's), :meth:`add_completion` has nothing to add (Arctic learnt the output while it
    was generated).
    """

    name = "arctic-suffix"
    resume_rows = 0
    default_k = 8
    sizes_drafts = True

    def __init__(self, max_depth: int = 24, factor: float = 1.0, min_prob: float = 0.1,
                 max_cached_requests: int = -1) -> None:
        reason = arctic_available()
        if reason is not None:
            raise ConfigError(reason)
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self._new_cache = lambda: SuffixDecodingCache(max_tree_depth=max_depth,
                                                      max_cached_requests=max_cached_requests)
        self.max_depth, self.factor, self.min_prob = max_depth, factor, min_prob
        self.caches: dict[str, object] = {}
        self._partition = ""
        self._cache = None
        self._ids = itertools.count()
        self._request: int | None = None
        self.history: list[int] = []

    # the engine's suffix-cache calls
    def select(self, client_key: str | None) -> None:
        self._partition = partition_of(client_key)

    def add_completion(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Nothing to do: Arctic's global tree received the output token by token (:meth:`commit`)."""

    # the proposer protocol
    def begin(self, prompt_ids: Sequence[int], prefill: ForwardOutput | None) -> None:
        self.reset()
        self._cache = self.caches.setdefault(self._partition, None) or self._new_cache()
        self.caches[self._partition] = self._cache
        self._request = next(self._ids)
        self.history = [int(t) for t in prompt_ids]
        self._cache.start_request(self._request, self.history)

    def commit(self, tokens: Sequence[int], accepted: int, verify: ForwardOutput | None, drafted: int = 0) -> None:
        new = [int(t) for t in tokens]
        self._cache.add_active_response(self._request, new)
        self.history.extend(new)

    def propose(self, last_token: int, k: int) -> Draft | None:
        draft = self._cache.speculate(self._request, self.history[-self.max_depth:], max_spec_tokens=k,
                                      max_spec_factor=self.factor, min_token_prob=self.min_prob)
        if not draft.token_ids:
            return None
        return Draft(torch.tensor(draft.token_ids[:k], dtype=torch.long))

    def reset(self) -> None:
        if self._request is not None and self._cache is not None:
            self._cache.stop_request(self._request)
        self._request = None
        self.history = []


__all__ = ["ArcticSuffixProposer", "arctic_available"]
