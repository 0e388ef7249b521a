"""The docs: configuration.md lists every setting as edgespec/config.py defines it; every repository path the docs
cite exists; docs/measurements/ holds exactly the files docs/benchmarks.md cites; every ``edgespec`` command and
model id of README.md and docs/guide.md runs as written on the demo model, or parses where it needs a GPU or a
downloaded checkpoint; the guide's serve and client examples answer."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import openai
import pytest
from _tools import load_tool
from serving_helpers import ServerProcess

from edgespec.bench.cli import bench_argv
from edgespec.cli import build_parser, main
from edgespec.config import load_settings

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_doc_is_current():
    mod = load_tool("gen_config_doc")
    assert (ROOT / "docs/configuration.md").read_text() == mod.render(), "run: python tools/gen_config_doc.py"


# A repository path in prose or code: tools/x.py, docs/..., measurements/... (relative to docs/), with shell-style
# {a,b} alternatives. Paths outside the repository (/etc/..., ~/...) do not match.
_REPO_PATH = re.compile(r"(?<![\w/.~-])((?:tools|lab|docs|edgespec|arch|serving|tests|configs|measurements)"
                        r"/[\w./{},*-]+)")
_DOCS = [ROOT / "README.md", ROOT / "lab" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _expand(path: str) -> list[str]:
    """``a.{txt,json}`` -> ``a.txt``, ``a.json``."""
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in _expand(path[:m.start()] + alt + path[m.end():])]


def _cited(doc: Path) -> set[str]:
    return {p for m in _REPO_PATH.finditer(doc.read_text()) for p in _expand(m.group(1).rstrip(".,:;"))}


def test_expand_and_cite_on_a_tiny_text(tmp_path):
    assert _expand("m/a.{txt,json}") == ["m/a.txt", "m/a.json"]
    doc = tmp_path / "x.md"
    doc.write_text("see `measurements/a.{txt,json}`, tools/b.py. Not /etc/tools/c.yaml nor ~/docs/d.md")
    assert _cited(doc) == {"measurements/a.txt", "measurements/a.json", "tools/b.py"}


def test_docs_cite_only_files_that_exist():
    missing = []
    for doc in _DOCS:
        for path in _cited(doc):
            base = ROOT / "docs" if path.startswith("measurements/") else ROOT
            if "*" not in path and not (base / path).exists() and not (doc.parent / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, missing


def test_measurement_files_are_exactly_those_the_benchmarks_page_cites():
    cited = {p.split("/", 1)[1] for p in _cited(ROOT / "docs" / "benchmarks.md") if p.startswith("measurements/")}
    kept = {p.name for p in (ROOT / "docs" / "measurements").iterdir()}
    assert cited == kept, f"uncited: {sorted(kept - cited)}, missing: {sorted(cited - kept)}"


def test_docs_stay_inside_the_repository():
    for doc in _DOCS:
        text = doc.read_text()
        assert "shared/" not in text and "../" not in text, f"{doc.relative_to(ROOT)} points outside the repository"
        assert not re.search(r"\b[Rr]ound \d+", text), f"{doc.relative_to(ROOT)} narrates rounds: docs/notes/"


# ---- the commands and model ids of README.md and docs/guide.md, as written ------------------------------------
# Each `edgespec ...` command of the two pages (a bash block's line or an inline code span) is checked one of
# three ways, and a command in neither table fails the test that lists them, so a new one must be placed:
# * _RUN: run as written, in process, on this CPU and the demo model (EDGESPEC_MAX_TOKENS bounds generate).
# * _PARSED: needs what CI lacks (a GPU, a downloaded checkpoint, the robot's files, minutes of benchmarking);
#   parsed by the real parser instead, its settings resolved where they name no file; the value says why.
# * _TEMPLATES: a pattern with placeholders (FILE, MODE, <verb>, "…"): every expansion is parsed, a --help run.
_COMMAND_DOCS = (ROOT / "README.md", ROOT / "docs" / "guide.md")
_BUDGET_35B = ("edgespec doctor --shape qwen3.5-35b-a3b --format int4 --kv fp8 --max-seq-len 32768 --drafter mtp "
               "--memory 24GB")
_PARSED = {
    'edgespec generate --model /models/Qwen3-4B --max-seq-len 8192 "Plan the pick-and-place of the blue box."':
        "a downloaded Qwen3-4B checkpoint",
    "edgespec serve --model /models/Qwen3-4B --drafter ngram --served-model-name robot-agent":
        "a downloaded Qwen3-4B; its flags serve the demo in test_guide_serve_and_client_example_answer",
    'edgespec generate --model /models/Qwen3.6-27B --drafter mtp --image front.jpg "Plan picking up the red cube."':
        "a downloaded 27B vision-language model, a GPU and a camera frame",
    "edgespec profile --config /etc/edgespec/agent.yaml --prompts my_prompts.yaml --budget 20m --out ~/profile":
        "the robot's installed settings and prompts, and a 20-minute budget",
    "edgespec serve --config ~/profile/tuned.yaml": "the YAML that edgespec profile writes",
    "edgespec bench --tree auto": "every bench prompt, plain, chain and tree: minutes on a CPU",
    "edgespec bench session": "24 requests through every drafter: minutes on a CPU",
    _BUDGET_35B: "a meta build of its 10,240 experts (~20 s); tests/test_shape_budget.py runs these values",
}
_TEMPLATES = {
    "edgespec <verb> --help": "every verb of the parser, --help run",
    "edgespec bench MODE --help": "every bench subcommand of the parser, --help run",
    'edgespec generate "…"': [["generate", "Plan the pick-and-place of the blue box."]],
    "edgespec convert --gguf FILE --out DIR": [["convert", "--gguf", "model.gguf", "--out", "model-fp32"]],
    "edgespec bench shapes qwen3.5-4b,...": [["bench", "shapes", "qwen3.5-4b,qwen3.5-27b"]],
    "edgespec quantize --format int4": [["quantize", "--format", "int4", "/models/bf16", "/models/int4"]],
    # A verb named in prose: the parser has it and its --help runs (the <verb> template).
    **{f"edgespec {verb}": "a verb named in prose" for verb in ("bench", "distill", "profile", "quantize", "serve")},
}


def _run_doctor(out: str) -> None:
    assert "detected arch" in out and "serving stack: ok" in out, out


def _run_vision_budget(out: str) -> None:
    # The guide states the total this command prints.
    total = re.search(r"total: ([\d.]+) GB of 128.00 GB", out)
    assert total and f"{float(total.group(1)):.1f} GB with a 32k FP8 KV cache" in _page("docs/guide.md"), out


def _run_plan(out: str) -> None:
    assert out.startswith("device: ") and "\nmodel:" in out and "\nkernels:" in out, out


def _run_dev_settings(out: str) -> None:
    assert "lm_head_weights: --lm-head-weights / EDGESPEC_LM_HEAD_WEIGHTS" in out, out


def _run_generate(out: str) -> None:
    assert out.strip(), "generate printed no answer"


_RUN = {
    "edgespec doctor": _run_doctor,
    'edgespec generate --drafter ngram "Output a JSON action list for a robot to pick up the red cube."':
        _run_generate,
    "edgespec dev plan": _run_plan,
    "edgespec doctor --plan": lambda out: _run_plan(out[out.index("device: cpu\ndtype"):]),
    "edgespec dev settings": _run_dev_settings,
    "edgespec convert": None,    # checked in test_convert_runs_as_written (it needs the converted demo)
    "edgespec doctor --shape qwen3.5-27b --format int4 --kv fp8 --max-seq-len 32768 --drafter mtp --vision "
    "--memory 128GB": _run_vision_budget,
}


def _page(rel: str) -> str:
    return (ROOT / rel).read_text()


def _fences(text: str, lang: str) -> list[str]:
    """The bodies of the fenced blocks of ``text`` opened with ```lang."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def doc_commands(text: str) -> set[str]:
    """Every ``edgespec ...`` command of a page: bash-block lines (comments dropped) and inline code spans, each
    with its whitespace collapsed to single spaces."""
    found = set()
    for block in _fences(text, "bash"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["edgespec"]:
                found.add(" ".join(shlex.quote(w) if " " in w else w for w in words).replace("'", '"'))
    found |= {" ".join(span.split()) for span in re.findall(r"(?<!`)`(edgespec [^`]+)`", text)}
    return found


def test_doc_commands_are_read_from_blocks_and_spans():
    text = "```bash\nedgespec doctor   # the arch\nls\n```\nthen `edgespec generate\n\"a b\"` and `x`"
    assert doc_commands(text) == {"edgespec doctor", 'edgespec generate "a b"'}


def _subcommands(parser) -> dict:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _parse(argv: list[str]):
    """``argv`` through the parser ``edgespec`` itself uses (the bench subcommand default included); generate and
    serve settings resolved too where no file is named."""
    words = ["bench", *bench_argv(argv[1:])] if argv[:1] == ["bench"] else argv
    try:
        args = build_parser().parse_args(words)
    except SystemExit as exc:
        raise AssertionError(f"edgespec {' '.join(argv)}: the parser refuses it (exit {exc.code})") from None
    if args.command in ("generate", "serve") and not args.config:
        load_settings(cli=args)
    return args


def _help_runs(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0, argv
    assert capsys.readouterr().out.startswith("usage: edgespec"), argv


def test_every_doc_command_is_checked_one_way():
    found = set().union(*(doc_commands(doc.read_text()) for doc in _COMMAND_DOCS))
    tables = (_RUN, _PARSED, _TEMPLATES)
    unplaced = sorted(found - set().union(*tables))
    assert not unplaced, f"doc commands no test checks (place them in _RUN, _PARSED or _TEMPLATES): {unplaced}"
    stale = sorted(set().union(*tables) - found)
    assert not stale, f"checked commands the docs no longer show: {stale}"


def test_commands_that_need_a_gpu_or_a_checkpoint_parse():
    for command in _PARSED:
        _parse(shlex.split(command)[1:])
    # The 35B-A3B budget the guide shows is the one tests/test_shape_budget.py computes and checks.
    args = _parse(shlex.split(_BUDGET_35B)[1:])
    assert (args.shape, args.format, args.kv, args.max_seq_len, args.drafter, args.memory) == (
        "qwen3.5-35b-a3b", "int4", "fp8", 32768, "mtp", "24GB")


def test_templates_expand_to_valid_commands(capsys):
    verbs = _subcommands(build_parser())
    for verb in verbs:
        _help_runs([verb], capsys)
    modes = _subcommands(verbs["bench"])
    for mode in modes:
        _help_runs(["bench", mode], capsys)
    for command, expansions in _TEMPLATES.items():
        if command.count(" ") == 1:
            assert command.split()[1] in verbs, command
        elif isinstance(expansions, list):
            for argv in expansions:
                _parse(argv)
    # The guide's table of bench subcommands is the parser's list.
    listed = set(re.findall(r"^\| `([\w-]+)", _page("docs/guide.md").split("| subcommand | measures |")[1], re.M))
    assert listed == set(modes), (listed, set(modes))


def test_commands_run_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EDGESPEC_MAX_TOKENS", "24")
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))     # the demo's metadata folder: not the user's cache
    for command, check in _RUN.items():
        if check is None:
            continue
        assert main(shlex.split(command)[1:]) == 0, command
        check(capsys.readouterr().out)


def test_convert_runs_as_written(demo_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(demo_model_dir.parent))   # the session's conversion: reused
    assert main(["convert"]) == 0
    assert capsys.readouterr().out.strip() == str(demo_model_dir)


def test_docs_name_only_the_model_ids_the_guide_serves():
    ids = {m for doc in _COMMAND_DOCS for m in re.findall(r'\bmodel="([^"]+)"', doc.read_text())}
    assert ids == {"robot-agent"}, ids
    assert "--served-model-name robot-agent" in _page("docs/guide.md")


def test_guide_serve_and_client_example_answer(tmp_path):
    """The guide's serve command on the demo model (its --model swapped, on a free port) answers the guide's
    OpenAI client example as written, under the model id that command serves; another id is 404."""
    serve = next(c for c in _PARSED if c.startswith("edgespec serve --model"))
    words = shlex.split(serve)[2:]
    flags = {words[i][2:].replace("-", "_"): words[i + 1] for i in range(0, len(words), 2)}
    assert flags.pop("model") == "/models/Qwen3-4B"
    client_code = next(b for b in _fences(_page("docs/guide.md"), "python") if "OpenAI(" in b)
    env = {"EDGESPEC_MAX_TOKENS": "24", "EDGESPEC_CACHE_DIR": str(tmp_path)}
    with ServerProcess("demo", entry=("-m", "edgespec.cli", "serve"), env=env, log_path=tmp_path / "server.log",
                       **flags) as server:
        scope: dict = {}
        exec(client_code.replace("http://127.0.0.1:8000", server.url), scope)
        reply = scope["reply"]
        assert reply.model == flags["served_model_name"] and reply.choices[0].message.content, reply
        assert "edgespec" in reply.model_extra, reply
        with pytest.raises(openai.NotFoundError) as refused:
            scope["client"].chat.completions.create(model="Qwen3-4B", messages=[{"role": "user", "content": "x"}])
        assert isinstance(refused.value.body, dict) and refused.value.body.get("code") == "model_not_found"
