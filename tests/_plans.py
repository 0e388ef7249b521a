"""Proposers built from Settings the way the engine builds them: through its runtime plan (``edgespec.plan``)."""

from __future__ import annotations

from edgespec.config import Settings
from edgespec.drafters.base import Proposer
from edgespec.drafters.dflash import DFlashProposer, load_dflash
from edgespec.drafters.factory import build_proposer
from edgespec.models.decoder import TargetModel
from edgespec.plan import build_plan


def proposer_from(settings: Settings, target: TargetModel) -> Proposer | None:
    """``build_proposer`` of the drafter plan ``settings`` resolve to on ``target``'s device."""
    return build_proposer(build_plan(settings, target.device).drafter, target)


def dflash_from(settings: Settings, target: TargetModel) -> DFlashProposer:
    """``load_dflash`` of the drafter plan ``settings`` resolve to on ``target``'s device."""
    return load_dflash(build_plan(settings, target.device).drafter, target)
