"""DFlash block-diffusion drafter (public z-lab checkpoint format): one import point for its three parts.

* :mod:`edgespec.drafters.dflash_net` -- the network and its config (what a checkpoint holds);
* :mod:`edgespec.drafters.dflash_proposer` -- the proposer that drafts from a per-token context window;
* :mod:`edgespec.drafters.dflash_loader` -- loading a checkpoint folder for a target.
"""

from __future__ import annotations

from edgespec.drafters.dflash_loader import (
    WindowTooSmallError,
    check_window,
    demo_drafter_path,
    load_dflash,
    load_dflash_checkpoint,
)
from edgespec.drafters.dflash_net import (
    DFlashAttention,
    DFlashConfig,
    DFlashDraftModel,
    DFlashLayer,
    default_target_layer_ids,
    parse_dflash_config,
)
from edgespec.drafters.dflash_proposer import DFlashProposer

__all__ = ["DFlashAttention", "DFlashConfig", "DFlashDraftModel", "DFlashLayer", "DFlashProposer",
           "WindowTooSmallError", "check_window", "default_target_layer_ids", "demo_drafter_path", "load_dflash",
           "load_dflash_checkpoint", "parse_dflash_config"]
