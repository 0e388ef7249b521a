"""Typed settings: one flat list of every knob, read from YAML < ``EDGESPEC_*`` environment < CLI flags.

The same names are used everywhere: ``kv_dtype`` in YAML, ``EDGESPEC_KV_DTYPE`` in the environment,
``--kv-dtype`` on the command line. Unknown keys are rejected by name (a typo in a robot's service config must
not silently fall back to a default), and every value is checked against its type and allowed choices.

Two surfaces: a *user* setting (what a robot integrator sets: model, drafter, memory, server, telemetry) has a
``brief``, its one line in ``--help``; every other one is a *developer* setting (kernel switches, tuning), read
from the same three layers but left out of ``--help`` and listed by ``edgespec dev settings``. Settings are read
at the edge only (the CLI, the server's start, ``edgespec profile``); :func:`edgespec.plan.build_plan` turns them
into the runtime plan that everything below takes. This module imports no torch, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from edgespec.errors import ConfigError

ENV_PREFIX = "EDGESPEC_"
# The most drafts one cycle may verify (K; the verify forward has K + 1 rows). One bound for the setting, every
# proposer (``Proposer.max_k``) and the server's per-request ``num_draft_tokens``.
MAX_DRAFT_TOKENS = 31


def _knob(default: Any, help: str, **extra: Any) -> Any:
    """A setting: its default, its meaning, and extra metadata (``section``, ``min``/``max``, and ``brief``, the one
    ``--help`` line that makes it a user setting)."""
    return field(default=default, metadata={"help": help, **extra})


# Sections of the settings, in the order --help shows them. A knob belongs to the section named by the nearest
# ``section=`` at or above it in ``Settings`` (so a knob added under a section joins it without more edits).
SECTIONS = ("model", "speculation", "runtime", "sampling", "server")
RUN_SECTIONS = ("model", "speculation", "runtime", "sampling")  # what generate / bench / profile use


@dataclass
class Settings:
    """Every runtime setting of edgespec, with its default. See ``docs/configuration.md``."""

    # --- model -------------------------------------------------------------------------------------------------
    model: str = _knob("demo", "checkpoint folder (HF layout), a llama/qwen3 .gguf, or 'demo' (embedded SmolLM2-135M)",
                       section="model",
                       brief="checkpoint folder, a .gguf file, or demo")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _knob(
        "auto", "weight/activation dtype; auto = bfloat16 on CUDA, float32 on CPU",
        brief="weight/activation dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    gguf_weights: Literal["packed", "fp32"] = _knob(
        "packed", "GGUF models (demo, *.gguf): packed = serve the file's Q4/Q8 blocks, fp32 = convert to fp32",
        brief="GGUF models: serve the packed blocks, or convert to fp32")
    lm_head_weights: Literal["model", "fp8", "int4", "nvfp4"] = _knob(
        "model", "output projection: model = as the checkpoint; fp8, int4 or nvfp4 = quantized at load (read by "
        "every verify and DFlash draft; a tied head packs the embedding table; changes the logits by the rounding)")
    device: str = _knob("auto", "torch device: auto, cpu, cuda, cuda:N",
                        brief="auto, cpu, cuda or cuda:N")
    kv_dtype: Literal["auto", "model", "fp8"] = _knob(
        "auto", "KV cache format: model (= dtype), fp8 (e4m3 with per-token-head scales), auto = arch default",
        brief="KV cache format (fp8: half the memory of bf16)")
    max_seq_len: int = _knob(4096, "prompt + generated tokens; the KV cache is preallocated to this", min=16,
                             brief="prompt + generated tokens; sizes the KV cache")
    prefix_reuse: bool = _knob(True, "resume each request from the longest token prefix the cache still holds "
                               "(multi-turn chats prefill only their new tokens)")
    arch: Literal["auto", "base", "rtx", "thor"] = _knob(
        "auto", "hardware hook set; auto: CC 11.x -> thor, other CUDA -> rtx, no CUDA -> base")
    enable_thinking: bool = _knob(False, "default thinking switch of the chat template (per request overridable)",
                                  brief="default thinking switch of the chat template")
    # images (vision-language checkpoints: Qwen3.5/3.6 with model.visual.*; edgespec.models.multimodal)
    vision: bool = _knob(True, "load the vision tower of a vision-language checkpoint and serve images; false = "
                         "text only (the tower's memory is saved, requests with images get a 400)",
                         brief="load a vision-language model's image tower (false: text only)")
    image_max_pixels: int | None = _knob(
        None, "resize bound: larger images are scaled down to at most this many pixels (fewer tokens per frame: "
        "1024 pixels each); None = the checkpoint's preprocessor_config.json", min=1024,
        brief="scale larger images down to this many pixels")
    max_images: int = _knob(4, "images one request may send (more: 400)", min=0, max=64,
                            brief="images one request may send")
    max_image_bytes: int = _knob(8 << 20, "encoded size of one image (more: 400); images arrive inside the request "
                                 "body, so max_body_bytes bounds them too", min=1024,
                                 brief="encoded size of one image")
    max_image_pixels: int = _knob(4096 * 4096, "width x height of one decoded image before resizing (more: 400, "
                                  "checked from the header before decoding)", min=1024,
                                  brief="width x height of one decoded image")
    image_cache: int = _knob(4, "recent frames whose vision-tower tokens are kept, keyed by their pixels (a "
                             "repeated frame skips the encoder); 0 = none", min=0, max=64,
                             brief="recent frames whose vision tokens are kept")
    # --- speculation -------------------------------------------------------------------------------------------
    drafter: Literal["none", "ngram", "suffix", "dflash", "mtp"] = _knob("none", "draft proposer",
                                                                         section="speculation",
                                                                         brief="draft proposer")
    drafter_path: str | None = _knob(None, "DFlash drafter checkpoint folder (DFlash or DFlash2: its config.json's "
                                     "architectures say which)",
                                     brief="DFlash drafter checkpoint folder")
    dflash_selector: bool = _knob(True, "DFlash2 drafters: draft the candidate selector's path through each "
                                  "position's top tokens (False: each position's argmax, as a DFlash drafter)")
    drafter_weights: Literal["model", "fp8", "int4", "nvfp4"] = _knob(
        "model", "DFlash drafter linear layers: model = as the checkpoint; fp8, int4 or nvfp4 = quantized at load "
        "(fewer bytes per draft; acceptance may move, the output cannot)")
    draft_vocab: int = _knob(
        0, "DFlash drafters: the head scores only the N most frequent token ids of the drafter's draft_vocab.json "
        "(a cheaper draft step on a CPU; acceptance may move, the output cannot); 0 = the full head", min=0,
        max=1 << 20)
    num_draft_tokens: int | None = _knob(
        None, "K drafts per cycle (verify K+1 rows); None = drafter default", min=1, max=MAX_DRAFT_TOKENS,
        brief="drafts per cycle K (None: the drafter's default)")
    window_size: int | None = _knob(None, "DFlash per-token context window W; None = arch default (128)", min=1,
                                    max=4096)
    window_seed: bool | None = _knob(None, "seed the DFlash window from the prompt tail; None = arch default")
    rollback: Literal["auto", "checkpoint", "replay", "deferred"] = _knob(
        "auto", "partial-accept rollback of GDN state: per-step checkpoints, snapshot+replay, or deferred (verify "
        "keeps row inputs, accept advances the state); auto = arch default")
    acceptance: Literal["strict", "relaxed_thinking"] = _knob(
        "strict", "greedy acceptance: strict (lossless) or relaxed inside <think> blocks (opt-in, lossy)",
        brief="strict (lossless) or relaxed inside <think> (lossy, opt-in)")
    relaxed_top_k: int = _knob(3, "relaxed thinking: draft must be in the verify top-k", min=1, max=64)
    relaxed_delta: float = _knob(1.0, "relaxed thinking: max distance from the best (logits or probability)", min=0.0)
    relaxed_margin: Literal["logit", "prob"] = _knob("logit", "relaxed thinking: margin in raw logits or probs")
    ngram_max_match: int = _knob(4, "n-gram proposer: longest suffix tried first", min=1, max=64)
    ngram_min_match: int = _knob(1, "n-gram proposer: shortest suffix accepted", min=1, max=64)
    ngram_lookback: int = _knob(4096, "n-gram proposer: tokens of history searched", min=8)
    lookup_min_match: int = _knob(3, "dflash/mtp: take an n-gram draft from the request's own tokens when a suffix "
                                  "of at least this many tokens recurs, the model drafter otherwise; 0 = off", min=0,
                                  max=64)
    ngram_gate: float = _knob(0.1, "n-gram proposer: stop drafting below this accepted/drafted ratio", min=0.0, max=1.0)
    draft_tree: str = _knob("off", "verify a tree of drafts per cycle instead of a chain: off, a node budget 1..63 "
                            "(every node of that budget verified), or auto (at most the arch's budget, 16 on CPU, "
                            "31 on GPU: each tree keeps the chain and adds only the nodes worth their verify rows "
                            "by measured cost and the drafter's calibrated confidence, the chain alone when a tree "
                            "does not pay); dflash/mtp: best-first over each position's top tokens, ngram/suffix: "
                            "several earlier continuations; needs rollback deferred or auto")
    draft_tree_costs: str | None = _knob(
        None, "draft_tree auto: measured verify costs per row count (row_costs.json, written by edgespec profile "
        "for this device, weight format and model); None = measured at start-up from the captured graphs (GPU) or "
        "fitted online (CPU)")
    adaptive_k: bool | None = _knob(None, "adapt drafts per cycle to acceptance (+2 after a full accept, "
                                    "accepted+1 after a rejection, within 1..K); None = arch default (on for CPU)")
    # suffix drafter (edgespec.drafters.suffix): this request + earlier outputs of this deployment, per client
    lookup_drafter: Literal["ngram", "suffix"] = _knob(
        "ngram", "dflash/mtp: the lookup in front of the model drafter: ngram (this request's tokens) or suffix "
        "(also earlier outputs, suffix_cache_mb)")
    suffix_cache_mb: float = _knob(16.0, "suffix drafter: memory for earlier outputs (LRU over all clients, each "
                                   "client's own partition); 0 = this request only", min=0.0, max=65536.0,
                                   brief="suffix drafter: memory for earlier outputs")
    suffix_max_depth: int = _knob(24, "suffix drafter: longest substring counted (match + continuation)", min=3,
                                  max=256)
    suffix_max_match: int = _knob(12, "suffix drafter: longest context suffix matched", min=1, max=255)
    suffix_factor: float = _knob(0.5, "suffix drafter: draft tokens per matched token (capped by K)", min=0.01,
                                 max=64.0)
    suffix_min_prob: float = _knob(0.5, "suffix drafter: a draft token's minimum share of the match's occurrences",
                                   min=0.0, max=1.0)
    suffix_persist: bool = _knob(False, "keep the suffix cache across restarts in <request_log>.suffix.jsonl "
                                 "(needs request_log)",
                                 brief="keep the suffix cache across restarts (needs request_log)")
    # --- runtime -----------------------------------------------------------------------------------------------
    cuda_graphs: bool | None = _knob(None, "capture decode/verify/drafter as CUDA graphs; None = arch default",
                                     section="runtime")
    prefill_chunk: int | None = _knob(None, "prefill chunk length in tokens; None = arch default", min=16)
    graph_prefill_max: int | None = _knob(
        None, "with CUDA graphs, resumed prefills of at most this many tokens replay captured forwards instead of "
        "one eager forward (0 = off); None = arch default (128 on the GPU hooks, 0 on CPU)", min=0, max=4096)
    cpu_blas: bool = _knob(True, "CPU fp32: linears through numpy's OpenBLAS GEMV, torch intra-op threads set to 1")
    stage_timing: Literal["host", "device"] = _knob(
        "host", "telemetry stage times: host (no extra syncs) or device (sync per stage; for profiling)")
    # --- kernel options (edgespec.kernels.options.KernelOptions: installed once per process; A/B and tuning) ---
    no_triton: bool = _knob(False, "torch reference kernels even on CUDA (debugging; slow)")
    gluon: bool = _knob(True, "Gluon FP8 decode attention from 8192 cached keys on; false = the Triton program")
    pdl: bool = _knob(True, "programmatic dependent launch of the Triton kernels on SM90+")
    skinny: Literal["all", "wide"] = _knob(
        "all", "2-16-row products on the skinny GEMM: all, or wide matrices only (narrow ones on cuBLAS)")
    gdn_block_v: int | None = _knob(None, "GDN recurrence value tile, a power of two; None = tuned choice", min=4)
    gdn_warps: int | None = _knob(None, "GDN recurrence warps per program (1, 2, 4, 8); None = tuned choice", min=1,
                                  max=8)
    draft_tree_kernels: Literal["reference", "conv", "triton"] = _knob(
        "reference", "tree verify's conv and Gated DeltaNet on CUDA: torch references, the Triton conv only, or the "
        "Triton conv and GDN (slower than the reference on an H200: docs/benchmarks.md)")
    gguf_native: bool = _knob(True, "compiled GGUF CPU products (built on first use); false = torch reference")
    gguf_threads: int | None = _knob(None, "threads of one GGUF CPU product; None = every core this process may use",
                                     min=1)
    gguf_isa: Literal["auto", "avx512", "avx2", "neon", "scalar"] = _knob(
        "auto", "instruction set of the compiled CPU kernels: auto = the best this CPU runs (identical results on "
        "every one; a lesser one for A/B runs)")
    gguf_pin: bool = _knob(True, "pin the compiled CPU kernels' threads one per core; false = leave them to the "
                                 "scheduler")
    # --- generation defaults -----------------------------------------------------------------------------------
    max_tokens: int = _knob(256, "default completion length", min=1, section="sampling",
                            brief="default completion length")
    temperature: float = _knob(0.0, "default temperature; 0 = greedy", min=0.0, max=5.0,
                               brief="default temperature (0: greedy)")
    top_p: float = _knob(1.0, "default nucleus mass", min=0.0, max=1.0,
                         brief="default nucleus mass")
    top_k: int = _knob(0, "default top-k; 0 = off", min=0,
                       brief="default top-k (0: off)")
    seed: int | None = _knob(None, "default sampling seed",
                             brief="default sampling seed")
    # --- server ------------------------------------------------------------------------------------------------
    host: str = _knob("127.0.0.1", "bind address; anything but loopback requires api_key", section="server",
                      brief="bind address (beyond loopback: api_key required)")
    port: int = _knob(8000, "TCP port", min=0, max=65535,
                      brief="TCP port")
    api_key: str | None = _knob(None, "Bearer token required on /v1/* (tenant 'default')",
                                brief="Bearer token required on /v1/*")
    api_keys: str | None = _knob(None, "more tenants: NAME=sha256:HEX entries, comma-separated (hashes only; "
                                 "python -m edgespec.serving.tenants NAME makes a key); each tenant has its own "
                                 "prefix-cache namespace",
                                 brief="more tenants: NAME=sha256:HEX, comma-separated")
    api_keys_file: str | None = _knob(None, "file of tenants, one `NAME sha256:HEX` line each (hashes only)",
                                      brief="file of tenants, one NAME sha256:HEX line each")
    served_model_name: str | None = _knob(None, "model id reported by /v1/models; default = folder name",
                                          brief="model id of /v1/models (default: the folder name)")
    max_queue: int = _knob(8, "requests waiting behind the running one before 429", min=0,
                           brief="requests waiting behind the running one before 429")
    request_timeout_s: float = _knob(120.0, "per-request wall-clock limit", min=0.1,
                                     brief="per-request wall-clock limit")
    max_body_bytes: int = _knob(1 << 20, "largest accepted request body", min=1024,
                                brief="largest accepted request body")
    read_timeout_s: float = _knob(10.0, "a client must send its request headers, and then its body, within this",
                                  min=0.1,
                                  brief="time a client has to send headers, then body")
    max_connections: int = _knob(64, "open connections; when full, a client holding fewer than the biggest one "
                                 "takes the place of its oldest idle or stalled connection, others get 503", min=1,
                                 brief="open connections (when full: fair share, else 503)")
    max_client_connections: int = _knob(0, "open connections one client host may hold (more: 503); 0 = only the "
                                        "fair share of max_connections when the server is full", min=0,
                                        brief="open connections of one client host (0: fair share)")
    max_client_requests: int = _knob(4, "requests one client (tenant and host) may have queued or running (more: "
                                     "429 client_busy); 0 = no cap", min=0,
                                     brief="queued or running requests of one client (0: no cap)")
    drain_timeout_s: float = _knob(30.0, "SIGTERM: requests in flight may finish for this long; then streams end "
                                   "with finish_reason length, queued requests get 503, and the process exits",
                                   min=0.0,
                                   brief="SIGTERM: time requests in flight may finish")
    energy_meter: bool = _knob(True, "measure device energy per request (NVML on discrete GPUs, INA3221 rails on "
                               "Jetson; none on CPU): joules/token in telemetry and /metrics",
                               brief="measure joules per request (NVML, Jetson rails)")
    short_request_tokens: int = _knob(
        64, "requests with max_tokens at most this never wait behind a longer one: queued first, and a running "
        "longer one pauses at its next cycle for them (0 = arrival order)", min=0,
        brief="requests this short never wait behind longer ones")
    max_tool_calls: int = _knob(8, "tool_choice required with parallel_tool_calls true: at most this many distinct "
                                "calls (without it: exactly one)", min=1, max=64,
                                brief="most distinct calls of one required parallel tool call")
    # --- request log (opt-in; edgespec distill --from-log adapts the drafter to it; docs/drafters.md) ---------
    request_log: str | None = _knob(None, "append every request's prompt and output ids to this JSONL file",
                                    brief="append each request's prompt and output ids to this JSONL")
    request_log_max_mb: float = _knob(64.0, "rotate the request log before it passes this size", min=0.01,
                                      brief="rotate the request log past this size")
    request_log_keep: int = _knob(3, "rotated request logs kept (log.jsonl.1 ..)", min=0, max=100,
                                  brief="rotated request logs kept")

    def with_overrides(self, **values: Any) -> Settings:
        """A copy with ``values`` applied through the same validation as every other source."""
        merged = dataclasses.asdict(self)
        merged.update(_coerce_mapping(values, source="override"))
        return Settings(**merged)


_FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in fields(Settings)}


def _sections() -> dict[str, str]:
    section, out = SECTIONS[0], {}
    for f in fields(Settings):
        section = f.metadata.get("section", section)
        out[f.name] = section
    return out


SECTION_OF: dict[str, str] = _sections()
# The two surfaces (module docstring): user settings have a --help line, developer settings do not.
USER_SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(Settings) if "brief" in f.metadata)
DEV_SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(Settings) if "brief" not in f.metadata)


def choices(name: str) -> tuple[str, ...]:
    """The fixed choices of setting ``name`` (empty for a free value)."""
    _, parts = _type_parts(_HINTS[name])
    return tuple(map(str, typing.get_args(parts[0]))) if typing.get_origin(parts[0]) is Literal else ()


def _type_parts(tp: Any) -> tuple[bool, list[Any]]:
    """Split ``X | None`` into (optional, [X...])."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return len(args) != len(typing.get_args(tp)), args
    return False, [tp]


_HINTS = typing.get_type_hints(Settings)


def _coerce(name: str, raw: Any, source: str) -> Any:
    """Convert ``raw`` (a YAML value or a string from env/CLI) to the type of knob ``name`` and check its range."""
    f = _FIELDS[name]
    optional, parts = _type_parts(_HINTS[name])
    where = f"{name} (from {source})"
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("none", "null") and optional):
        if optional:
            return None
        raise ConfigError(f"{where}: a value is required")
    tp = parts[0]
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        value = str(raw)
        if value not in choices:
            raise ConfigError(f"{where}: {raw!r} is not one of {', '.join(map(str, choices))}")
        return value
    try:
        if tp is bool:
            if isinstance(raw, bool):
                value = raw
            elif str(raw).strip().lower() in ("1", "true", "yes", "on"):
                value = True
            elif str(raw).strip().lower() in ("0", "false", "no", "off"):
                value = False
            else:
                raise ValueError(raw)
        elif tp is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(raw)
            value = int(raw)
        elif tp is float:
            if isinstance(raw, bool):
                raise ValueError(raw)
            value = float(raw)
        else:
            value = str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {raw!r} is not a valid {tp.__name__}") from None
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if lo is not None and value < lo:
        raise ConfigError(f"{where}: {value!r} is below the minimum {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{where}: {value!r} is above the maximum {hi}")
    return value


def _coerce_mapping(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    unknown = sorted(k for k in values if k not in _FIELDS)
    if unknown:
        raise ConfigError(f"unknown setting(s) in {source}: {', '.join(unknown)}")
    return {k: _coerce(k, v, source) for k, v in values.items()}


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a settings YAML file; errors name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of settings, not {type(data).__name__}")
    return _coerce_mapping(data, source=str(p))


def read_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Settings from ``EDGESPEC_<NAME>`` variables. Unknown EDGESPEC_ variables are rejected by name."""
    environ = os.environ if environ is None else environ
    picked = {}
    for key, value in environ.items():
        if key.startswith(ENV_PREFIX) and key not in _ENV_IGNORED:
            picked[key[len(ENV_PREFIX):].lower()] = value
    return _coerce_mapping(picked, source="environment EDGESPEC_*")


# Variables with the prefix that are not settings, with what they do (docs/configuration.md lists them).
ENV_NOT_SETTINGS: dict[str, str] = {
    "EDGESPEC_CONFIG": "the YAML settings file (as --config)",
    "EDGESPEC_CACHE_DIR": "where the demo model and converted GGUF folders are kept (default: "
                          "$XDG_CACHE_HOME/edgespec, else ~/.cache/edgespec)",
    "EDGESPEC_REQUIRE_DEMO": "tests: fail instead of skip when the demo model cannot be fetched",
    "EDGESPEC_PEER_DIR": "tools/peer_llamacpp_cpu.sh: where the llama.cpp build is cached",
}
_ENV_IGNORED = frozenset(ENV_NOT_SETTINGS)


# Metavars of the free-valued settings whose type alone would say too little.
_METAVARS = {"model": "PATH", "drafter_path": "PATH", "api_keys_file": "PATH", "request_log": "PATH",
             "draft_tree_costs": "PATH", "host": "ADDR", "device": "DEVICE", "api_key": "KEY", "api_keys": "LIST"}
# What every run verb's --help ends with: where the settings it does not show are.
DEV_HINT = ("Developer settings (kernel switches, tuning) take the same --flags, YAML keys and EDGESPEC_* variables; "
            "`edgespec dev settings` lists them, `edgespec dev plan` prints the runtime plan the settings resolve to.")


def _metavar(name: str) -> str:
    """``{a,b,c}`` for a knob with fixed choices (checked by :func:`_coerce`, so errors name the source), else a
    short word for its type."""
    _, parts = _type_parts(_HINTS[name])
    if typing.get_origin(parts[0]) is Literal:
        return "{" + ",".join(map(str, typing.get_args(parts[0]))) + "}"
    if parts[0] is bool:
        return "{true,false}"
    return _METAVARS.get(name) or {int: "N", float: "X"}.get(parts[0], "TEXT")


def flag_of(name: str) -> str:
    """The command-line flag of setting ``name``."""
    return "--" + name.replace("_", "-")


def add_settings_arguments(parser: argparse.ArgumentParser, only: Sequence[str] | None = None,
                           sections: Sequence[str] = SECTIONS) -> None:
    """Add ``--config`` and one ``--knob-name`` flag per setting of ``sections`` (and in ``only`` if given), one
    help group per section. User settings show their one-line brief and default in ``--help``; developer settings
    are accepted the same way but not shown (``edgespec dev settings`` lists them). A flag's default is "not
    given", so the lower layers (YAML, environment) win."""
    parser.add_argument("--config", metavar="FILE", help="YAML settings file (EDGESPEC_CONFIG)")
    for section in sections:
        group = parser.add_argument_group(f"{section} settings")
        for f in fields(Settings):
            if SECTION_OF[f.name] != section or (only is not None and f.name not in only):
                continue
            brief = f.metadata.get("brief")
            shown = argparse.SUPPRESS if brief is None else f"{brief} [{f.default}]"
            group.add_argument(flag_of(f.name), dest=f"setting_{f.name}", default=None, metavar=_metavar(f.name),
                               help=shown)


class SettingsHelpFormatter(argparse.HelpFormatter):
    """One line per flag at a fixed width, so ``--help`` is as long on every terminal (the briefs fit it)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=120)


def settings_parent(sections: Sequence[str] = SECTIONS) -> argparse.ArgumentParser:
    """A parent parser (``parents=[...]``) holding the settings flags of ``sections``."""
    parent = argparse.ArgumentParser(add_help=False)
    add_settings_arguments(parent, sections=sections)
    return parent


def load_settings(
    config_path: str | os.PathLike | None = None,
    cli: Mapping[str, Any] | argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build settings from the three layers: YAML file < environment < CLI values (None means 'not given')."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    if isinstance(cli, argparse.Namespace):
        cli_vals = {k[len("setting_"):]: v for k, v in vars(cli).items() if k.startswith("setting_")}
        config_path = config_path or getattr(cli, "config", None)
    else:
        cli_vals = dict(cli or {})
    config_path = config_path or environ.get("EDGESPEC_CONFIG")
    if config_path:
        values.update(read_yaml(config_path))
    values.update(read_env(environ))
    values.update(_coerce_mapping({k: v for k, v in cli_vals.items() if v is not None}, source="command line"))
    return Settings(**values)


def dump_yaml(settings: Settings, only_changed: bool = False) -> str:
    """Render settings as YAML that ``read_yaml`` accepts (used by ``edgespec profile``)."""
    data = dataclasses.asdict(settings)
    if only_changed:
        default = Settings()
        data = {k: v for k, v in data.items() if getattr(default, k) != v}
    return yaml.safe_dump(data, sort_keys=False)
