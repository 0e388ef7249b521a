"""The runtime plan: every choice the engine and the server run with, resolved once from Settings and frozen.

:func:`build_plan` is the one function that reads a :class:`~edgespec.config.Settings`; the edges call it (the
CLI, the server's start, ``edgespec profile``, the benches) and hand the plan down. Nothing below it sees a
Settings, an ``auto``, a None that means "the arch default", or the environment: the engine takes the plan's
:class:`ModelPlan` and :class:`RequestPlan`, the session its :class:`~edgespec.speculative.plan.SessionPlan`, the
proposer its :class:`~edgespec.drafters.plan.DrafterPlan`, the kernels its
:class:`~edgespec.kernels.options.KernelOptions` (installed by the engine), the server its :class:`ServerPlan`.
The hook set named here is instantiated once per engine (:meth:`RuntimePlan.new_hooks`). :func:`describe` renders
a plan as plain values (``edgespec doctor --plan`` and ``edgespec profile`` print it).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edgespec.arch.base import ArchDefaults, ArchHooks
from edgespec.arch.detect import detect_arch, hooks_class
from edgespec.config import Settings
from edgespec.drafters.dflash_loader import dflash_folder, is_packaged_drafter
from edgespec.drafters.plan import DrafterPlan, NGramKnobs, SuffixKnobs
from edgespec.errors import ConfigError
from edgespec.kernels import options as kernel_options
from edgespec.kernels.options import KernelOptions
from edgespec.loading.checkpoint import resolve_dtype
from edgespec.loading.images import ImageLimits
from edgespec.speculative.plan import SessionPlan
from edgespec.speculative.tree_cost import RowCosts, device_label, load_row_costs


@dataclass(frozen=True)
class ModelPlan:
    """What to load: the checkpoint and how its weights are served."""

    source: str                     # a checkpoint folder, a .gguf file, or "demo"
    gguf_weights: str               # packed | fp32 (GGUF sources)
    lm_head_weights: str            # model | fp8 | int4 | nvfp4
    kv_dtype: str                   # as asked: auto (the session plan's default; an FP8 checkpoint may ask), model, fp8
    vision: bool                    # load a vision-language checkpoint's tower
    cpu_blas: bool                  # CPU fp32: the OpenBLAS linear path
    max_seq_len: int                # prompt + generated tokens (the cache and rotary tables are sized to it)


@dataclass(frozen=True)
class AcceptanceKnobs:
    """Greedy acceptance: strict (lossless) or relaxed inside think blocks, with the relaxed test's bounds."""

    mode: str  # strict | relaxed_thinking
    top_k: int
    delta: float
    margin: str  # logit | prob


@dataclass(frozen=True)
class RequestLogKnobs:
    """The opt-in request log: its file, its rotation size and how many rotated files are kept."""

    path: str
    max_bytes: int
    keep: int


@dataclass(frozen=True)
class RequestPlan:
    """How the engine treats each request: templates, acceptance, prefix reuse, images, metering and logging."""

    enable_thinking: bool
    prefix_reuse: bool
    acceptance: AcceptanceKnobs
    image_limits: ImageLimits
    image_cache: int                # recent frames whose vision tokens are kept (0: none)
    image_max_pixels: int | None    # resize bound (None: the checkpoint's processor config)
    energy_meter: bool
    served_model_name: str | None   # None: the model folder's name
    request_log: RequestLogKnobs | None


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that names no sampling parameter gets."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None


@dataclass(frozen=True)
class ServerPlan:
    """The server's address, authentication and admission limits (the ``server`` settings of the same names,
    whose defaults and meanings are in ``edgespec.config``)."""

    host: str
    port: int
    api_key: str | None
    api_keys: str | None
    api_keys_file: str | None
    max_queue: int
    request_timeout_s: float
    max_body_bytes: int
    read_timeout_s: float
    max_connections: int
    max_client_connections: int
    max_client_requests: int
    drain_timeout_s: float
    short_request_tokens: int
    max_tool_calls: int

    @property
    def authenticated(self) -> bool:
        """True when some tenant key is set (a non-loopback bind requires one)."""
        return bool(self.api_key or self.api_keys or self.api_keys_file)


@dataclass(frozen=True)
class RuntimePlan:
    """Everything the engine and server run with, resolved: device, dtype, hook set, model, session, drafter,
    kernels, request handling, sampling defaults and server limits."""

    device: torch.device
    dtype: torch.dtype
    arch: str                       # base | rtx | thor (never auto)
    defaults: ArchDefaults          # that arch's defaults, which the fields below already applied
    model: ModelPlan
    session: SessionPlan
    drafter: DrafterPlan
    kernels: KernelOptions          # installed for the process by the engine (edgespec.kernels.options)
    requests: RequestPlan
    sampling: SamplingDefaults
    server: ServerPlan

    def new_hooks(self) -> ArchHooks:
        """The hook set of this plan (one per engine: it owns the captured graphs of that engine's cache)."""
        return hooks_class(self.arch)()


def build_plan(settings: Settings, device: torch.device | None = None) -> RuntimePlan:
    """The plan of ``settings`` on ``device`` (None: the device the ``device`` setting names, ``auto`` = CUDA when
    present; a tool that reuses a loaded model passes that model's device)."""
    device = resolve_device(settings.device) if device is None else device
    arch = detect_arch(device) if settings.arch == "auto" else settings.arch
    defaults = hooks_class(arch).make_defaults()
    kv = settings.kv_dtype
    session = SessionPlan.resolve(
        defaults, kv_fp8=None if kv == "auto" else kv == "fp8", rollback=settings.rollback,
        prefill_chunk=settings.prefill_chunk, max_len=settings.max_seq_len, cuda_graphs=settings.cuda_graphs,
        adaptive_k=settings.adaptive_k, graph_prefill_max=settings.graph_prefill_max,
        stage_timing=settings.stage_timing, draft_tree=settings.draft_tree, tree_costs=_tree_costs(settings, device))
    model = ModelPlan(source=settings.model, gguf_weights=settings.gguf_weights,
                      lm_head_weights=settings.lm_head_weights, kv_dtype=kv, vision=settings.vision,
                      cpu_blas=settings.cpu_blas, max_seq_len=settings.max_seq_len)
    sampling = SamplingDefaults(max_tokens=settings.max_tokens, temperature=settings.temperature,
                                top_p=settings.top_p, top_k=settings.top_k, seed=settings.seed)
    server = ServerPlan(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(ServerPlan)})
    return RuntimePlan(device=device, dtype=resolve_dtype(settings.dtype, device), arch=arch, defaults=defaults,
                       model=model, session=session, drafter=drafter_plan(settings, defaults),
                       kernels=KernelOptions.from_settings(settings), requests=request_plan(settings),
                       sampling=sampling, server=server)


def install_kernel_options(settings: Settings) -> KernelOptions:
    """For an edge that runs kernels without an engine (a kernel benchmark, a shape sweep): install the kernel
    options of ``settings`` for the process, as an engine installs its plan's (``edgespec.kernels.options``)."""
    return kernel_options.install(KernelOptions.from_settings(settings))


def request_plan(settings: Settings) -> RequestPlan:
    """How the engine of ``settings`` treats each request."""
    log = None
    if settings.request_log:
        log = RequestLogKnobs(settings.request_log, int(settings.request_log_max_mb * (1 << 20)),
                              settings.request_log_keep)
    acceptance = AcceptanceKnobs(settings.acceptance, settings.relaxed_top_k, settings.relaxed_delta,
                                 settings.relaxed_margin)
    limits = ImageLimits(settings.max_images, settings.max_image_bytes, settings.max_image_pixels)
    return RequestPlan(enable_thinking=settings.enable_thinking, prefix_reuse=settings.prefix_reuse,
                       acceptance=acceptance, image_limits=limits, image_cache=settings.image_cache,
                       image_max_pixels=settings.image_max_pixels, energy_meter=settings.energy_meter,
                       served_model_name=settings.served_model_name, request_log=log)


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
        dflash_path=dflash_folder(settings.model, settings.drafter_path),
        dflash_packaged=is_packaged_drafter(settings.model, settings.drafter_path),
        weights=settings.drafter_weights, dflash_selector=settings.dflash_selector,
        draft_vocab=settings.draft_vocab,
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


def describe(plan: RuntimePlan) -> dict[str, Any]:
    """The plan as plain values (nested mappings of str, numbers, bools and None), secrets masked: what
    ``edgespec doctor --plan`` and ``edgespec profile`` print."""
    data = _plain(plan)
    for key in ("api_key", "api_keys"):
        if data["server"][key]:
            data["server"][key] = "(set)"
    return data


def _plain(value: Any) -> Any:
    """``value`` as YAML-safe plain data: dataclasses by field, enums by value, devices, dtypes and paths by name."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)        # torch.device, torch.dtype, Path, and any other value by its name


def format_plan(plan: RuntimePlan) -> str:
    """The plan as YAML text, one section per part."""
    import yaml

    return yaml.safe_dump(describe(plan), sort_keys=False)
