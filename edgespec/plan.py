"""The runtime plan: the settings, the arch defaults, the kernel options and the device resolved once, frozen.

``Engine.from_settings`` builds it before loading anything; the layers below take its plain fields (a
:class:`~edgespec.speculative.plan.SessionPlan` for the session, a :class:`~edgespec.drafters.plan.DrafterPlan`
for the proposer) and never see a Settings, an ``auto`` or a None that means "the arch default". The hook set
named here is instantiated once per engine (:meth:`RuntimePlan.new_hooks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from edgespec.arch.base import ArchDefaults, ArchHooks
from edgespec.arch.detect import detect_arch, hooks_class
from edgespec.config import Settings
from edgespec.drafters.dflash_loader import dflash_folder, is_packaged_drafter
from edgespec.drafters.plan import DrafterPlan, NGramKnobs, SuffixKnobs
from edgespec.errors import ConfigError
from edgespec.kernels.options import KernelOptions
from edgespec.loading.checkpoint import resolve_dtype
from edgespec.speculative.plan import SessionPlan
from edgespec.speculative.tree_cost import RowCosts, device_label, load_row_costs


@dataclass(frozen=True)
class RuntimePlan:
    """Everything the engine serves with, resolved: device, dtype, hook set, session and drafter knobs."""

    settings: Settings              # what the plan was resolved from (request-level knobs: acceptance, logging)
    device: torch.device
    dtype: torch.dtype
    arch: str                       # base | rtx | thor (never auto)
    defaults: ArchDefaults          # that arch's defaults, which the fields below already applied
    session: SessionPlan
    drafter: DrafterPlan
    kernels: KernelOptions          # fixed for the process when the engine builds (edgespec.kernels.options)

    @classmethod
    def from_settings(cls, settings: Settings) -> RuntimePlan:
        """The plan of ``settings`` on the device they name (``auto``: CUDA when present)."""
        return cls.for_device(settings, resolve_device(settings.device))

    @classmethod
    def for_device(cls, settings: Settings, device: torch.device) -> RuntimePlan:
        """The plan of ``settings`` for a model on ``device`` (one already loaded, for tools that reuse it)."""
        arch = detect_arch(device) if settings.arch == "auto" else settings.arch
        defaults = hooks_class(arch).make_defaults()
        kv = settings.kv_dtype
        session = SessionPlan.resolve(
            defaults, kv_fp8=None if kv == "auto" else kv == "fp8", rollback=settings.rollback,
            prefill_chunk=settings.prefill_chunk, max_len=settings.max_seq_len, cuda_graphs=settings.cuda_graphs,
            adaptive_k=settings.adaptive_k, graph_prefill_max=settings.graph_prefill_max,
            stage_timing=settings.stage_timing, draft_tree=settings.draft_tree,
            tree_costs=_tree_costs(settings, device))
        return cls(settings=settings, device=device, dtype=resolve_dtype(settings.dtype, device), arch=arch,
                   defaults=defaults, session=session, drafter=drafter_plan(settings, defaults),
                   kernels=KernelOptions.from_settings(settings))

    def new_hooks(self) -> ArchHooks:
        """The hook set of this plan (one per engine: it owns the captured graphs of that engine's cache)."""
        return hooks_class(self.arch)()


def _tree_costs(settings: Settings, device: torch.device) -> RowCosts | None:
    """The measured row costs ``draft_tree_costs`` names, checked against this device and model; None when unset."""
    if not settings.draft_tree_costs:
        return None
    return load_row_costs(settings.draft_tree_costs, {"device": device_label(device)})


def drafter_plan(settings: Settings, defaults: ArchDefaults) -> DrafterPlan:
    """The proposer ``settings`` name, with the arch ``defaults`` for the DFlash knobs left at None."""
    def pick(value, default):
        return default if value is None else value

    return DrafterPlan(
        name=settings.drafter, max_seq_len=settings.max_seq_len, num_draft_tokens=settings.num_draft_tokens,
        dflash_path=dflash_folder(settings), dflash_packaged=is_packaged_drafter(settings),
        weights=settings.drafter_weights, dflash_selector=settings.dflash_selector,
        window_size=pick(settings.window_size, defaults.window_size),
        window_seed=pick(settings.window_seed, defaults.window_seed),
        cuda_graphs=pick(settings.cuda_graphs, defaults.cuda_graphs),
        ngram=NGramKnobs(max_match=settings.ngram_max_match, min_match=settings.ngram_min_match,
                         lookback=settings.ngram_lookback, gate=settings.ngram_gate),
        lookup_min_match=settings.lookup_min_match, lookup_drafter=settings.lookup_drafter,
        suffix=suffix_knobs(settings))


def suffix_knobs(settings: Settings) -> SuffixKnobs:
    """The suffix drafter's knobs; its cache persists next to the request log with ``suffix_persist``."""
    if settings.suffix_persist and not settings.request_log:
        raise ConfigError("suffix_persist keeps the suffix cache next to the request log: set request_log too")
    path = None
    if settings.suffix_persist:
        log = Path(settings.request_log).expanduser()
        path = log.with_name(log.name + ".suffix.jsonl")
    return SuffixKnobs(cache_mb=settings.suffix_cache_mb, max_depth=settings.suffix_max_depth,
                       max_match=settings.suffix_max_match, factor=settings.suffix_factor,
                       min_prob=settings.suffix_min_prob, persist_path=path)


def resolve_device(name: str) -> torch.device:
    """The torch device a ``device`` setting names (``auto``: CUDA when present, else CPU)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device {name!r} is not a torch device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for but CUDA is not available")
    return device
