"""``edgespec`` command line: serve | generate | bench | profile | distill | convert | quantize | doctor."""

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

from edgespec.config import RUN_SECTIONS, SECTIONS, load_settings, settings_parent
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
    from edgespec.doctor import report

    for key, value in report().items():
        print(f"{key:>22}: {value}")
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


def _version() -> str:
    try:
        return version("edgespec")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgespec", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    # Each verb shows only the settings it uses: the server's flags belong to `serve` alone.
    run_settings = settings_parent(RUN_SECTIONS)

    p = sub.add_parser("generate", help="answer one prompt and print telemetry", parents=[run_settings])
    p.add_argument("prompt", nargs="+", help="user message (or raw text with --raw)")
    p.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="chat template enable_thinking switch")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--image", action="append", metavar="PATH",
                   help="a PNG, JPEG or WebP file shown before the prompt (repeatable; a vision-language model)")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("serve", help="run the OpenAI-compatible agent server", parents=[settings_parent(SECTIONS)])
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("bench", help="benchmarks: prompts (default), formats, shapes, session, multi-turn, peer",
                       description="Benchmarks, one subcommand each (`edgespec bench MODE --help`); with none "
                       "named, `prompts` runs.")
    from edgespec.bench.cli import add_bench_arguments
    add_bench_arguments(p)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("profile", help="tune drafter, K, KV format, rollback, graphs on this device; write the YAML")
    from edgespec.profile.cli import add_profile_arguments
    add_profile_arguments(p)   # adds --config and the settings flags of RUN_SECTIONS itself
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("distill", help="train or adapt a DFlash drafter on the target's own outputs")
    from edgespec.distill.cli import add_distill_arguments
    add_distill_arguments(p)
    p.set_defaults(func=_cmd_distill)

    p = sub.add_parser("convert", help="convert the embedded demo model (or a Llama GGUF) to an HF folder")
    p.add_argument("--gguf", help="a Llama-architecture GGUF file (default: the embedded SmolLM2-135M)")
    p.add_argument("--out", help="output folder (default: the user cache)")
    p.add_argument("--force", action="store_true", help="convert again even if done")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("quantize", help="quantize a bf16 checkpoint to int4 (AWQ), nvfp4 (ModelOpt) or fp8 (block)")
    from edgespec.convert.quantize import add_quantize_arguments
    add_quantize_arguments(p)
    p.set_defaults(func=_cmd_quantize)

    p = sub.add_parser("doctor", help="print versions, device and detected arch (and a model's memory budget)")
    p.add_argument("--model", help="checkpoint folder: print its memory budget on this device")
    p.add_argument("--max-seq-len", type=int, default=4096, help="with --model: KV cache length")
    p.add_argument("--device", default="auto", help="with --model: cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="with --model: activation dtype")
    p.add_argument("--load", action="store_true", help="with --model: also load it and print the measured peak")
    from edgespec.doctor import add_compile_arguments, add_shape_budget_arguments
    add_shape_budget_arguments(p)
    add_compile_arguments(p)
    p.set_defaults(func=_cmd_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["bench"]:      # `edgespec bench` without a subcommand runs `prompts`
            from edgespec.bench.cli import bench_argv
            argv = ["bench", *bench_argv(argv[1:])]
        args = build_parser().parse_args(argv)
        return args.func(args)
    except EdgespecError as e:
        print(f"edgespec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
