"""``edgespec profile``: measure candidate configurations on this device and write the winning YAML.

Wiring (edgespec/cli.py): ``add_profile_arguments(parser)`` adds the profile flags *and* the settings flags
(``--config``, ``--model``, ...); ``run_profile(args)`` runs it and returns the exit status. ``main(argv)`` does
both for ``python -m edgespec.profile``.
"""

from __future__ import annotations

import argparse
import platform
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgespec.config import RUN_SECTIONS, add_settings_arguments, load_settings
from edgespec.errors import ConfigError, EdgespecError
from edgespec.profile.space import GROUPS, TUNED_KNOBS, parse_groups, parse_values

if TYPE_CHECKING:       # the run's heavy modules load only when a profile runs
    from edgespec.config import Settings
    from edgespec.profile.measure import Bench, PromptCase
    from edgespec.profile.results import ResultStore
    from edgespec.profile.search import ProfileOptions, SearchOutcome

DEFAULT_OUT = "edgespec-profile"
EXIT_INTERRUPTED = 130
EXIT_NOTHING_MEASURED = 3

_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([hms])")


def parse_budget(text: str | None) -> float | None:
    """``"10m"``, ``"90s"``, ``"1h30m"``, ``"600"`` (seconds) -> seconds; ``"none"`` -> no limit."""
    if text is None:
        return None
    t = text.strip().lower()
    if t in ("none", "off", "inf", "unlimited"):
        return None
    try:
        seconds = float(t)
    except ValueError:
        pos, seconds = 0, 0.0
        for m in _DURATION.finditer(t):
            if m.start() != pos:
                break
            seconds += float(m.group(1)) * _UNITS[m.group(2)]
            pos = m.end()
        if pos != len(t) or not t:
            raise ConfigError(f"--budget {text!r} is not a duration like 90s, 10m, 1h30m, 600 (seconds) "
                              "or none") from None
    if seconds <= 0:
        raise ConfigError(f"--budget {text!r} must be positive (or none for no limit)")
    return seconds


def _positive_int(name: str, minimum: int = 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} {text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} {value} must be >= {minimum}")
        return value
    return parse


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``edgespec profile`` flags, then the settings flags of a run (the base configuration of the search)."""
    g = parser.add_argument_group("profile")
    g.add_argument("--prompts", help="prompt set YAML, a list of {id, user, thinking} (default: the packaged set)")
    g.add_argument("--max-prompts", type=_positive_int("--max-prompts"), default=None,
                   help="use only the first N prompts of the set")
    g.add_argument("--budget", default="10m",
                   help="time budget of the whole run: 90s, 10m, 1h30m, or none (default: 10m); the measurement "
                        "under way when it runs out finishes, then the outputs are written")
    g.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default: ./{DEFAULT_OUT})")
    g.add_argument("--resume", action="store_true",
                   help="continue from the results file in --out (also automatic when that file exists)")
    g.add_argument("--fresh", action="store_true",
                   help="start over: move an existing results file aside instead of resuming from it")
    g.add_argument("--groups", default=None,
                   help=f"knob groups to search, comma-separated, searched in this order: {','.join(GROUPS)} "
                        "(default: all)")
    g.add_argument("--values", action="append", metavar="KNOB=V1,V2",
                   help="candidate values of one knob instead of the built-in ones, e.g. num_draft_tokens=2,4,8 "
                        f"(repeatable; knobs: {', '.join(k for k in TUNED_KNOBS if k != 'acceptance')})")
    g.add_argument("--tokens", type=_positive_int("--tokens"), default=128,
                   help="max new tokens per generation (default 128; CI uses 16-32)")
    g.add_argument("--repeats", type=_positive_int("--repeats"), default=3,
                   help="timed generations per candidate and prompt, median kept (default 3)")
    g.add_argument("--warmup", type=_positive_int("--warmup", 0), default=1,
                   help="untimed generations per candidate before its first measurement (default 1)")
    g.add_argument("--objective", choices=("decode", "e2e"), default="decode",
                   help="what wins: decode tok/s, or e2e = tokens over prefill + decode time (default decode)")
    g.add_argument("--min-gain", type=float, default=0.02,
                   help="relative margin a challenger needs to replace the current best (default 0.02)")
    g.add_argument("--allow-lossy", action="store_true",
                   help="also try relaxed thinking acceptance (output may differ from plain greedy inside "
                        "<think> blocks)")
    g.add_argument("--no-chart", action="store_true", help="do not draw the PNG chart (needs matplotlib)")
    add_settings_arguments(parser, sections=RUN_SECTIONS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgespec profile", description=__doc__.split("\n\n")[0])
    add_profile_arguments(parser)
    return parser


def _prepare_results_file(path: Path, resume: bool, fresh: bool, say) -> None:
    if fresh and path.exists():
        aside = path.with_name(f"{path.stem}.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        shutil.move(path, aside)
        say(f"edgespec profile: started fresh; previous results moved to {aside}")
    elif path.exists():
        say(f"edgespec profile: resuming from {path}" + ("" if resume else " (pass --fresh to start over)"))
    elif resume:
        say(f"edgespec profile: nothing to resume in {path.parent}; starting a new search")


def _run_meta(bench: Bench, options: ProfileOptions, cases: list[PromptCase], store: ResultStore,
              budget: float | None, started: float) -> dict[str, Any]:
    """What the report, the JSON and the tuned YAML say about this run: model, device, software, knobs."""
    import torch

    from edgespec.profile import report
    from edgespec.progress import format_duration

    meta: dict[str, Any] = {
        "date": report.now(), "model": str(bench.model_dir), "model_name": bench.model_dir.name,
        "device": str(bench.device), "device_type": bench.device.type, "arch": bench.arch,
        "dtype": str(bench.model.dtype).replace("torch.", ""), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "tokens": options.tokens, "repeats": options.repeats, "warmup": options.warmup,
        "objective": options.objective, "min_gain": options.min_gain, "allow_lossy": options.allow_lossy,
        "groups": options.groups, "values": options.values,
        "budget": "none" if budget is None else format_duration(budget),
        "elapsed": format_duration(time.monotonic() - started), "resumed": store.loaded,
        "prompts": [{"id": c.id, "tokens": len(c.ids), "thinking": c.thinking} for c in cases],
        "wrote_yaml": False,
    }
    return meta


# The runtime plan of the tuned settings on this device, written beside them.
PLAN_YAML = "plan.yaml"


def _write_outputs(out: Path, base: Settings, outcome: SearchOutcome, store: ResultStore, cases: list[PromptCase],
                   meta: dict[str, Any], finished: bool, chart_wanted: bool, say: Callable[[str], None]
                   ) -> list[Path]:
    """Write the tuned YAML (a finished run with a final candidate), the chart, the JSON and the report; returns
    every file of the run in the order they are printed."""
    from edgespec.profile import report

    results_path = out / report.RESULTS_JSONL
    written = [results_path]
    extra_notes = report.reference_notes(store, cases)
    if finished and outcome.final is not None:
        tuned_path = out / report.TUNED_YAML
        tuned = report.write_tuned_yaml(tuned_path, base, outcome, meta)
        meta["wrote_yaml"] = True
        # What the tuned settings resolve to here, every arch default applied (as `edgespec dev plan` prints it).
        from edgespec.plan import build_plan, format_plan
        plan_path = out / PLAN_YAML
        plan_path.write_text(format_plan(build_plan(tuned)))
        written[:0] = [tuned_path, plan_path]
    chart = None
    if chart_wanted:
        try:
            report.write_chart(out / report.CHART_PNG, outcome, cases)
            chart = report.CHART_PNG
            written.append(out / report.CHART_PNG)
        except report.ChartUnavailable as e:
            say(f"edgespec profile: chart skipped: {e}")
            extra_notes.append(f"Chart skipped: {e}")
    report.write_json(out / report.MEASUREMENTS_JSON, outcome, store, meta)
    report.write_report(out / report.REPORT_MD, outcome, cases, meta, chart, extra_notes)
    written[1:1] = [out / report.MEASUREMENTS_JSON, out / report.REPORT_MD]
    return written


def run_profile(args: argparse.Namespace) -> int:
    """Run ``edgespec profile`` for parsed ``args``; user errors raise EdgespecError (the CLI prints them)."""

    from edgespec.bench.prompts import load_prompts
    from edgespec.profile import report
    from edgespec.profile.measure import Bench
    from edgespec.profile.results import ResultStore
    from edgespec.profile.search import ProfileOptions, Profiler
    from edgespec.progress import Progress

    started = time.monotonic()
    say = _stderr
    # Every input is checked before the model loads (seconds to minutes on the device).
    budget = parse_budget(args.budget)
    options = ProfileOptions(tokens=args.tokens, repeats=args.repeats, warmup=args.warmup, objective=args.objective,
                             min_gain=args.min_gain, allow_lossy=args.allow_lossy, groups=parse_groups(args.groups),
                             values=parse_values(args.values), budget_s=budget)
    if not 0.0 <= args.min_gain < 1.0:
        raise ConfigError(f"--min-gain {args.min_gain} must be in [0, 1)")
    if args.resume and args.fresh:
        raise ConfigError("--resume and --fresh contradict each other")
    base = load_settings(cli=args)
    if base.temperature != 0.0:
        say("edgespec profile: note: the search measures greedy decoding (temperature in the config is kept "
            "for the service but not used here)")
    prompts = load_prompts(args.prompts)
    if args.max_prompts:
        prompts = prompts[:args.max_prompts]
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create the folder: {e}") from None
    results_path = out / report.RESULTS_JSONL
    _prepare_results_file(results_path, args.resume, args.fresh, say)

    say(f"edgespec profile: loading {base.model} ...")
    bench = Bench(base)
    cases = bench.encode(prompts, options.tokens)
    context = {"model": str(bench.model_dir.resolve()), "device": str(bench.device), "arch": bench.arch,
               "dtype": str(bench.model.dtype), "max_seq_len": base.max_seq_len, "tokens": options.tokens,
               "repeats": options.repeats, "drafter_path": base.drafter_path,
               "ngram": [base.ngram_max_match, base.ngram_min_match, base.ngram_lookback, base.ngram_gate]}
    store = ResultStore(results_path, context)
    store.load()
    progress = Progress(0, budget, started=started)
    profiler = Profiler(bench, cases, store, options, progress, started=started)
    if store.loaded:
        profiler.notes.append(f"Resumed: {store.loaded} line(s) of earlier runs read back from {results_path.name}.")
    if store.ignored:
        profiler.notes.append(f"{store.ignored} line(s) of {results_path.name} ignored: measured with other "
                              "settings (model, device, tokens, repeats, ...) or unreadable.")
    try:
        outcome = profiler.run()
        code = 0
    except KeyboardInterrupt:
        outcome = profiler.outcome("interrupted")
        code = EXIT_INTERRUPTED
    finally:
        progress.close()

    meta = _run_meta(bench, options, cases, store, budget, started)
    written = _write_outputs(out, base, outcome, store, cases, meta, code == 0, not args.no_chart, say)

    if code == EXIT_INTERRUPTED:
        n = sum(len(r.measurements) for r in outcome.results)
        say(f"edgespec profile: interrupted; {n} measurement(s) kept in {results_path}. Run the same command "
            "again (or with --resume) to continue.")
        return code
    for p in written:
        print(p)
    if outcome.final is None:
        say("edgespec profile: no candidate was measured on every prompt within the budget; no tuned YAML "
            "written. Raise --budget (or lower --tokens/--repeats) and run again: it resumes.")
        return EXIT_NOTHING_MEASURED
    f = outcome.final
    say(f"edgespec profile: {outcome.status}; tuned: {f.label} -> {f.decode_tok_s:.1f} decode tok/s, "
        f"AL {f.acceptance_length:.2f}, TTFT {f.ttft_ms:.0f} ms")
    return 0


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m edgespec.profile``: the same as ``edgespec profile``."""
    args = build_parser().parse_args(argv)
    try:
        return run_profile(args)
    except EdgespecError as e:
        print(f"edgespec profile: error: {e}", file=sys.stderr)
        return 2
