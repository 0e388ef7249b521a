"""What the ``edgespec bench`` subcommands offer, as plain data: the option defaults and choices their parsers
show, kept apart from the measuring modules so that parsing a bench command line (and ``--help``) imports no torch.
"""

from __future__ import annotations

from typing import Any

# bench shapes: the shapes swept by default, and those also run in transformers.
DEFAULT_SHAPES = "smollm2-135m,qwen3.5-0.8b,qwen3.5-4b,qwen3-4b,qwen3.5-27b"
DEFAULT_COMPARE_HF = "qwen3.5-4b"

# bench formats: the weight formats compared.
FORMATS = ("dense", "fp8", "nvfp4", "int4")

# bench session: drafter columns, name -> settings overrides. "dflash" keeps the configured lookup (n-gram by
# default).
DRAFTERS: dict[str, dict[str, Any]] = {
    "plain": {"drafter": "none"},
    "ngram": {"drafter": "ngram"},
    "suffix": {"drafter": "suffix"},
    "dflash": {"drafter": "dflash", "lookup_drafter": "ngram"},
    "dflash+suffix": {"drafter": "dflash", "lookup_drafter": "suffix"},
}
# Peer columns: a library's proposer in the engine of one of ours (same model, cache, K and verify), for a
# side-by-side acceptance length; ``arctic`` is Arctic Inference's suffix decoding beside ``suffix``
# (edgespec.bench.peer_arctic; a test/bench-time library, built by tools/setup.sh).
PEERS: dict[str, str] = {"arctic": "suffix"}
# What --session-drafters may name (plain always runs).
COLUMNS = [d for d in DRAFTERS if d != "plain"] + list(PEERS)
