"""``edgespec bench``: one subcommand per benchmark, each with only the options it reads.

``prompts`` (the default: ``edgespec bench --drafter ngram`` runs it) times plain against speculative decoding on
the bench prompts; ``formats`` compares weight formats on one random shape; ``shapes`` sweeps random-weight model
shapes against the bandwidth limit; ``session`` replays a stream of robot requests through every drafter;
``multi-turn`` times an agent conversation with and without prefix reuse; ``peer`` runs llama.cpp's llama-bench
beside edgespec on one GGUF. Each mode is a parser function and a runner here; the runner imports the mode's
module (which holds the measuring) when it runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from edgespec.bench.modes import COLUMNS, DEFAULT_COMPARE_HF, DEFAULT_SHAPES, FORMATS
from edgespec.config import (
    DEV_HINT,
    RUN_SECTIONS,
    Settings,
    SettingsHelpFormatter,
    choices,
    load_settings,
    settings_parent,
)
from edgespec.errors import ConfigError

DEFAULT_MODE = "prompts"
# Mode flags of the one-parser bench and the subcommand that replaced each: the old form gets an error naming it.
OLD_MODE_FLAGS = {"--formats": "formats", "--shapes": "shapes", "--session": "session", "--multi-turn": "multi-turn"}


def bench_argv(argv: Sequence[str]) -> list[str]:
    """The words after ``edgespec bench`` as the subcommand parser reads them: ``prompts`` put first where no
    subcommand is named (``bench --help`` stays the list of subcommands). An old mode flag is an error that says
    which subcommand replaced it."""
    argv = list(argv)
    if argv[:1] and (argv[0] in _MODES or argv[0] in ("-h", "--help")):
        return argv
    for word in argv:
        flag = word.split("=", 1)[0]
        if flag in OLD_MODE_FLAGS:
            raise ConfigError(f"`{flag}` is now `edgespec bench {OLD_MODE_FLAGS[flag]}`: run "
                              f"`{_new_form(argv, word)}` (`edgespec bench --help` lists the subcommands)")
    return [DEFAULT_MODE, *argv]


def _new_form(argv: list[str], word: str) -> str:
    """The old command line rewritten: the mode flag out, its subcommand (and the flag's value) first."""
    flag, _, value = word.partition("=")
    rest = list(argv)
    at = rest.index(word)
    del rest[at]
    if not value and flag in ("--formats", "--shapes") and at < len(rest) and not rest[at].startswith("-"):
        value = rest.pop(at)        # the comma list the flag took is the subcommand's positional argument
    return " ".join(["edgespec bench", OLD_MODE_FLAGS[flag], *([value] if value else []), *rest])


def add_bench_arguments(p: argparse.ArgumentParser, mode: str | None = None) -> None:
    """The subcommands of ``edgespec bench`` on its parser ``p``. Given ``mode``, only that subcommand gets its
    options (the others are listed by name), so parsing imports only that mode's option constants."""
    modes = p.add_subparsers(dest="bench_mode", metavar="MODE", required=True,
                             title="subcommands (default: prompts)")
    for name, (add, run, help_text) in _MODES.items():
        if mode is not None and name != mode:
            modes.add_parser(name, help=help_text, add_help=False)
            continue
        settings = name in _SETTINGS_MODES
        sub = modes.add_parser(name, help=help_text, description=help_text,
                               parents=[settings_parent(RUN_SECTIONS)] if settings else [],
                               formatter_class=SettingsHelpFormatter if settings else argparse.HelpFormatter,
                               epilog=DEV_HINT if settings else None)
        add(sub)
        sub.set_defaults(bench_run=run)


def run_bench(args: argparse.Namespace) -> int:
    """Run the chosen subcommand, on a green context of ``--sm-limit`` SMs where the mode takes one."""
    if getattr(args, "sm_limit", 0):
        from edgespec.bench.sm_limit import limit_sms
        try:
            print(limit_sms(args.sm_limit).describe(), flush=True)   # before anything else runs on the GPU
        except (ValueError, RuntimeError) as e:
            raise ConfigError(str(e)) from e
    return args.bench_run(args)


# ---- options several modes share ----

def _add_sm_limit(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sm-limit", type=int, default=0, help="CUDA: run the whole benchmark on a green context of "
                   "this many SMs (Thor has 20; Hopper grants multiples of 8), the granted count read back and "
                   "printed")


def _add_random_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--random-model", metavar="SHAPE", help="bench random weights of this SHAPES name instead of "
                   "--model, written on first use into the cache (edgespec.bench.random_model)")
    p.add_argument("--bench-tokenizer", default="demo", help="with --random-model: demo (the demo's BPE "
                   "tokenizer), byte, or a folder with tokenizer.json (tools/make_bench_model.py --tokenizer-only)")


def _add_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="write every figure as JSON here")


def _bench_settings(args: argparse.Namespace) -> Settings:
    """Settings from the config layers and flags, the model swapped for ``--random-model``'s when given."""
    settings = load_settings(cli=args)
    if args.random_model:
        from edgespec.bench.random_model import bench_model
        settings = settings.with_overrides(model=str(bench_model(args.random_model, args.bench_tokenizer)))
    return settings


def _speculative(settings: Settings) -> Settings:
    """A drafter to measure: n-gram where the settings name none."""
    return settings.with_overrides(drafter="ngram") if settings.drafter == "none" else settings


# ---- prompts ----

def _prompts_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", help="prompt set YAML (default: the packaged bench set)")
    p.add_argument("--tokens", type=int, default=128, help="max new tokens per prompt")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per prompt (median reported)")
    p.add_argument("--compare-hf", action="store_true", help="also run transformers plain and prompt lookup")
    p.add_argument("--hf-lookup-tokens", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    _add_out(p)
    p.add_argument("--tree", metavar="BUDGET", help="also run the drafter with tree verification of this node budget "
                   "(or auto), beside its chain, per prompt")
    _add_random_model(p)
    _add_sm_limit(p)


def _run_prompts(args: argparse.Namespace) -> int:
    import torch

    from edgespec.bench.prompt_bench import run_prompt_bench

    hf_threads = torch.get_num_threads()   # torch's default, before the engine configures its CPU path
    settings = _speculative(_bench_settings(args))
    if args.tree:
        settings = settings.with_overrides(draft_tree=args.tree)
    return run_prompt_bench(args, settings, hf_threads)


# ---- formats ----

def _formats_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("formats", nargs="?", default=",".join(FORMATS),
                   help=f"comma list of {', '.join(FORMATS)} (default: all)")
    p.add_argument("--format-shape", default="smollm2-135m", help="a SHAPES name or tiny:FAMILY")
    p.add_argument("--group-size", type=int, default=128, help="int4 group size")
    p.add_argument("--context", type=int, default=512, help="KV context of decode and verify")
    p.add_argument("--format-prefill", default="", help="comma list of prompt lengths whose whole-model prefill "
                   "rate is also timed (e.g. 512,2048)")
    p.add_argument("--format-iters", type=int, default=10, help="decode steps per timing")
    p.add_argument("--format-verify-rows", type=int, default=16, help="rows of the verify forward also timed (a "
                   "speculative cycle's; 1: none)")
    p.add_argument("--device", default="auto", help="auto (CUDA where present), cuda, cuda:N or cpu")
    _add_out(p)
    _add_sm_limit(p)


def _run_formats(args: argparse.Namespace) -> int:
    from edgespec.bench.formats import run_format_bench
    from edgespec.plan import install_kernel_options

    install_kernel_options(load_settings())   # no engine here: the kernel switches of EDGESPEC_CONFIG / EDGESPEC_*
    return run_format_bench(args)


# ---- shapes ----

def _shapes_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shapes", nargs="?", default=DEFAULT_SHAPES, help="comma list of "
                   "edgespec.bench.shapes.SHAPES names, or tiny:FAMILY test shapes (default: %(default)s)")
    p.add_argument("--compare-hf-shapes", dest="compare_hf", default=DEFAULT_COMPARE_HF,
                   metavar="SHAPES", help="shapes also run in transformers (comma list; none: no transformers run; "
                   "with --device cpu the default runs none)")
    p.add_argument("--context", type=int, default=512, help="KV context of decode and verify")
    p.add_argument("--kv", default="model,fp8", help="KV formats (none: no decode sweep)")
    p.add_argument("--attn-in-place", action="store_true", help="also time one attention call inside a decode step "
                   "at --context, FP8 vs model-dtype KV (edgespec.bench.attn_in_place)")
    p.add_argument("--rollback", choices=[c for c in choices("rollback") if c != "auto"],
                   help="verify rollback strategy (default: the arch default, as served)")
    p.add_argument("--no-graphs", action="store_true", help="time eager forwards instead of CUDA graph replays")
    p.add_argument("--device", default="auto", help="auto or cuda (the GPU sweep); cpu runs the same steps on the "
                   "host clock, eager, in fp32 (a smoke run on smollm2-135m unless shapes are named: CPU figures "
                   "say nothing of a GPU)")
    p.add_argument("--sweep-out", default=".", help="folder for gpu_bench.json")
    _add_sm_limit(p)


def _run_shapes(args: argparse.Namespace) -> int:
    from edgespec.bench.gpu import run_sweep
    from edgespec.plan import install_kernel_options

    install_kernel_options(load_settings())   # no engine here: the kernel switches of EDGESPEC_CONFIG / EDGESPEC_*
    return run_sweep(args)


# ---- session ----

def add_session_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``edgespec bench session`` that say which stream and which drafters."""
    p.add_argument("--session-drafters", default="ngram,suffix,dflash,dflash+suffix",
                   help=f"comma list of {', '.join(COLUMNS)} (plain always runs: the speed baseline "
                   "and the output every drafter must equal; arctic: Arctic Inference's suffix decoding, the "
                   "peer of suffix, when it is installed)")
    p.add_argument("--session-requests", type=int, default=24, help="generated requests")
    p.add_argument("--session-seed", type=int, default=0, help="seed of the generated stream")
    p.add_argument("--session-first", type=int, default=4, help="requests counted as 'first' "
                   "(the rest is steady state)")
    p.add_argument("--session-log", help="replay this request log's prompts instead")


def _session_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=128, help="max new tokens per request")
    add_session_arguments(p)
    _add_out(p)
    _add_random_model(p)
    _add_sm_limit(p)


def _run_session(args: argparse.Namespace) -> int:
    from edgespec.bench.session import run_session

    run_session(args, _bench_settings(args))
    return 0


# ---- multi-turn ----

def _multi_turn_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--turns", type=int, default=4, help="conversation turns")
    p.add_argument("--history-tokens", type=int, default=3000, help="tokens of history in turn 0")
    p.add_argument("--tokens", type=int, default=128, help="max new tokens per answer")
    p.add_argument("--prompts", help="prompt set YAML the history is built from (default: the packaged bench set)")
    _add_out(p)
    _add_random_model(p)
    _add_sm_limit(p)


def _run_multi_turn(args: argparse.Namespace) -> int:
    import json

    from edgespec.bench.multiturn import run_multi_turn
    from edgespec.engine import Engine
    from edgespec.plan import build_plan

    figures = run_multi_turn(Engine.load(build_plan(_speculative(_bench_settings(args)))), args)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


# ---- peer ----

def _peer_arguments(p: argparse.ArgumentParser) -> None:
    import os

    p.add_argument("--llama-bench", required=True, help="path of the llama-bench binary "
                   "(tools/peer_llamacpp_cpu.sh builds one)")
    p.add_argument("--gguf", required=True, type=Path, help="the GGUF both sides run")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (medians reported)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of the prefill comparison")
    p.add_argument("--tokens", type=int, default=128, help="decode tokens")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="threads of llama.cpp and of edgespec's GGUF products alike")
    _add_out(p)


def _run_peer(args: argparse.Namespace) -> int:
    from edgespec.bench.peer_llamacpp import run_peer

    return run_peer(args)


Adder = Callable[[argparse.ArgumentParser], None]
Runner = Callable[[argparse.Namespace], int]
_MODES: dict[str, tuple[Adder, Runner, str]] = {
    "prompts": (_prompts_arguments, _run_prompts, "plain vs speculative decoding on the bench prompts, per prompt "
                "(optionally beside transformers): decode tok/s, acceptance length, same-as-plain"),
    "formats": (_formats_arguments, _run_formats, "weight formats (dense, fp8, nvfp4, int4) on one random model "
                "shape: bytes read per token, peak memory, decode, verify and prefill speed"),
    "shapes": (_shapes_arguments, _run_shapes, "random-weight model shapes: decode, verify, rollback and prefill "
               "next to the bandwidth limit; writes gpu_bench.json (a GPU sweep)"),
    "session": (_session_arguments, _run_session, "a stream of robot requests through one model: AL and tok/s per "
                "drafter, first requests and steady state (edgespec.bench.session)"),
    "multi-turn": (_multi_turn_arguments, _run_multi_turn, "an agent conversation: time to first token per turn "
                   "with and without prefix reuse (edgespec.bench.multiturn)"),
    "peer": (_peer_arguments, _run_peer, "edgespec against llama.cpp's llama-bench on the same GGUF, on this CPU, "
             "interleaved (edgespec.bench.peer_llamacpp)"),
}
_SETTINGS_MODES = ("prompts", "session", "multi-turn")    # the modes that build an engine from Settings

__all__ = ["add_bench_arguments", "bench_argv", "run_bench"]
