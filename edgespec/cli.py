"""``edgespec`` command line: serve | generate | bench | profile | distill | convert | quantize | doctor | dev.

Importing this module, ``--help`` and ``--version`` import no torch: each verb's own module is imported when
that verb is parsed or run."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

if sys.argv[1:2] == ["serve"]:
    # Before the imports below load torch: SIGTERM while the server starts exits 0 with a line.
    from edgespec.serving import startup
    startup.install()

from edgespec.config import DEV_HINT, RUN_SECTIONS, SECTIONS, SettingsHelpFormatter, load_settings, settings_parent
from edgespec.errors import EdgespecError


def _cmd_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from edgespec.engine import Engine, Request
    from edgespec.loading.images import ImageRef
    from edgespec.plan import build_plan
    from edgespec.speculative.sampling import SamplingParams

    plan = build_plan(load_settings(cli=args))
    engine = Engine.load(plan)
    prompt = " ".join(args.prompt)
    defaults = plan.sampling
    sampling = SamplingParams(temperature=defaults.temperature, top_p=defaults.top_p, top_k=defaults.top_k,
                              seed=defaults.seed)
    req = Request(max_tokens=defaults.max_tokens, sampling=sampling, stop=args.stop or (),
                  on_text=None if args.json else (lambda t: print(t, end="", flush=True)))
    if args.raw:
        if args.image:
            raise EdgespecError("--image needs the chat template (leave out --raw)")
        req.prompt = prompt
    else:
        # Images first, then the question (the order the Qwen-VL cards show).
        content = [{"type": "image"} for _ in args.image or ()] + [{"type": "text", "text": prompt}]
        req.messages = [{"role": "user", "content": content if args.image else prompt}]
        req.images = [ImageRef(Path(p), f"--image {p}") for p in args.image or ()]
        req.enable_thinking = args.thinking
    out = engine.complete(req)
    if args.json:
        print(json.dumps({"text": out.text, "finish_reason": out.finish_reason, "prompt_tokens": out.prompt_tokens,
                          "completion_tokens": out.completion_tokens, "telemetry": out.telemetry.to_dict()}))
    else:
        print()
        print(f"[{out.finish_reason}] prompt={out.prompt_tokens} {out.telemetry.summary()}", file=sys.stderr)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from edgespec.convert.gguf import convert_demo, convert_gguf

    if args.gguf:
        if not args.out:
            raise EdgespecError("--out is required with --gguf")
        path = convert_gguf(args.gguf, args.out, force=args.force)
    else:
        path = convert_demo(args.out, force=args.force)
    print(path)
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from edgespec.doctor import host_report, report

    for key, value in (host_report() if args.host_only else report()).items():
        print(f"{key:>22}: {value}")
    if args.plan:
        from edgespec.plan import build_plan, format_plan
        print("runtime plan (of EDGESPEC_CONFIG and EDGESPEC_* here):")
        print(format_plan(build_plan(load_settings())), end="")
    if args.model:
        from edgespec.doctor import model_budget
        print("\n".join(model_budget(args.model, args.max_seq_len, args.device, args.dtype, args.load)))
    if args.shape:
        from edgespec.doctor import shape_budget_report
        lines, budget = shape_budget_report(args)
        print("\n".join(lines))
        budget.check()          # does not fit: refused with the numbers (exit 2)
        print("fits")
    if args.compile:
        from edgespec.doctor import compile_report
        lines, problems = compile_report(args.compile, args.compile_shape, args.compile_format)
        print("\n".join(lines + [f"PROBLEM: {p}" for p in problems]))
        return 1 if problems else 0
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from edgespec.plan import build_plan
    from edgespec.serving.app import run_server

    return run_server(build_plan(load_settings(cli=args)), log_level=args.log_level)


def _cmd_profile(args: argparse.Namespace) -> int:
    from edgespec.profile.cli import run_profile

    return run_profile(args)


def _cmd_distill(args: argparse.Namespace) -> int:
    from edgespec.distill.cli import run_distill

    return run_distill(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from edgespec.bench.cli import run_bench

    return run_bench(args)


def _cmd_quantize(args: argparse.Namespace) -> int:
    from edgespec.convert.quantize import run_quantize

    return run_quantize(args)


def _cmd_dev(args: argparse.Namespace) -> int:
    from edgespec.dev import run_dev

    return run_dev(args)


def _version() -> str:
    try:
        return version("edgespec")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _settings_verb(sub, name: str, help_text: str, sections: Sequence[str]) -> argparse.ArgumentParser:
    """A verb that reads the settings of ``sections``: their user flags shown one line each, the developer ones
    accepted but left to ``edgespec dev settings``."""
    return sub.add_parser(name, help=help_text, description=help_text, parents=[settings_parent(sections)],
                          formatter_class=SettingsHelpFormatter, epilog=DEV_HINT,
                          usage=f"edgespec {name} [--config FILE] [--SETTING VALUE ...] [options]")


def _add_generate(sub) -> None:
    p = _settings_verb(sub, "generate", VERBS["generate"], RUN_SECTIONS)
    p.add_argument("prompt", nargs="+", help="user message (or raw text with --raw)")
    p.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="chat template enable_thinking switch")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--image", action="append", metavar="PATH",
                   help="a PNG, JPEG or WebP file shown before the prompt (repeatable)")
    p.set_defaults(func=_cmd_generate)


def _add_serve(sub) -> None:
    p = _settings_verb(sub, "serve", VERBS["serve"], SECTIONS)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level")
    p.set_defaults(func=_cmd_serve)


def _add_bench(sub, argv: Sequence[str]) -> None:
    p = sub.add_parser("bench", help=VERBS["bench"], description="Benchmarks, one subcommand each (`edgespec "
                       "bench MODE --help`); with none named, `prompts` runs.")
    from edgespec.bench.cli import add_bench_arguments
    add_bench_arguments(p, argv[1] if len(argv) > 1 else None)
    p.set_defaults(func=_cmd_bench)


def _add_profile(sub) -> None:
    p = sub.add_parser("profile", help=VERBS["profile"], formatter_class=SettingsHelpFormatter, epilog=DEV_HINT,
                       usage="edgespec profile [options] [--config FILE] [--SETTING VALUE ...]")
    from edgespec.profile.cli import add_profile_arguments
    add_profile_arguments(p)   # adds --config and the settings flags of RUN_SECTIONS itself
    p.set_defaults(func=_cmd_profile)


def _add_distill(sub) -> None:
    p = sub.add_parser("distill", help=VERBS["distill"], description=VERBS["distill"],
                       formatter_class=SettingsHelpFormatter, usage="edgespec distill --out DIR [options]")
    from edgespec.distill.cli import add_distill_arguments
    add_distill_arguments(p)
    p.set_defaults(func=_cmd_distill)


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help=VERBS["convert"])
    p.add_argument("--gguf", help="a Llama-architecture GGUF file (default: the embedded SmolLM2-135M)")
    p.add_argument("--out", help="output folder (default: the user cache)")
    p.add_argument("--force", action="store_true", help="convert again even if done")
    p.set_defaults(func=_cmd_convert)


def _add_quantize(sub) -> None:
    p = sub.add_parser("quantize", help=VERBS["quantize"])
    from edgespec.convert.quantize_args import add_quantize_arguments
    add_quantize_arguments(p)
    p.set_defaults(func=_cmd_quantize)


def _add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help=VERBS["doctor"])
    p.add_argument("--host-only", action="store_true",
                   help="versions, platform and packages only: no torch import, no device query")
    p.add_argument("--plan", action="store_true",
                   help="also print the runtime plan the settings (EDGESPEC_CONFIG, EDGESPEC_*) resolve to here")
    p.add_argument("--model", help="checkpoint folder: print its memory budget on this device")
    p.add_argument("--max-seq-len", type=int, default=4096, help="with --model: KV cache length")
    p.add_argument("--device", default="auto", help="with --model: cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="with --model: activation dtype")
    p.add_argument("--load", action="store_true", help="with --model: also load it and print the measured peak")
    from edgespec.doctor import add_compile_arguments, add_shape_budget_arguments
    add_shape_budget_arguments(p)
    add_compile_arguments(p)
    p.set_defaults(func=_cmd_doctor)


def _add_dev(sub) -> None:
    p = sub.add_parser("dev", help=VERBS["dev"], description=VERBS["dev"])
    from edgespec.dev import add_dev_arguments
    add_dev_arguments(p)
    p.set_defaults(func=_cmd_dev)


# The verbs, in the order `edgespec --help` lists them, with their one-line help.
VERBS: dict[str, str] = {
    "serve": "run the OpenAI-compatible agent server",
    "generate": "answer one prompt and print telemetry",
    "bench": "benchmarks: prompts (default), formats, shapes, session, multi-turn, peer",
    "profile": "tune drafter, K, KV format, rollback, graphs on this device; write the YAML",
    "distill": "train or adapt a DFlash drafter on the target's own outputs",
    "convert": "convert the embedded demo model (or a Llama GGUF) to an HF folder",
    "quantize": "quantize a bf16 checkpoint to int4 (AWQ), nvfp4 (ModelOpt) or fp8 (block)",
    "doctor": "print versions, device and detected arch (and a model's memory budget)",
    "dev": "developer surface: every developer setting, and the runtime plan settings resolve to",
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command-line parser. Given ``argv``, only the verb it names gets its arguments (the other verbs are
    listed by name and help), so ``--help`` and ``--version`` import only what that verb's flags need: never
    torch. Without ``argv`` every verb is complete (tests, the docs check)."""
    parser = argparse.ArgumentParser(prog="edgespec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = VERBS if argv is None else {v for v in argv[:1] if v in VERBS}
    adders = {"generate": _add_generate, "serve": _add_serve, "profile": _add_profile, "distill": _add_distill,
              "convert": _add_convert, "quantize": _add_quantize, "doctor": _add_doctor, "dev": _add_dev,
              "bench": lambda s: _add_bench(s, argv or ())}
    for name, help_text in VERBS.items():
        if name in wanted:
            adders[name](sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["bench"]:      # `edgespec bench` without a subcommand runs `prompts`
            from edgespec.bench.cli import bench_argv
            argv = ["bench", *bench_argv(argv[1:])]
        args = build_parser(argv).parse_args(argv)
        return args.func(args)
    except EdgespecError as e:
        print(f"edgespec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
