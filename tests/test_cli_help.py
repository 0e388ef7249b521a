"""Each verb's --help shows its own flags: server flags only on `serve`, user settings only (developer ones are
accepted and listed by `edgespec dev settings`), at most 80 lines, without importing torch; and --version."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest

from edgespec.cli import VERBS, main
from edgespec.config import DEV_SETTINGS, RUN_SECTIONS, SECTION_OF, SECTIONS, USER_SETTINGS, Settings, flag_of

SERVER_FLAGS = ("--host", "--port", "--api-key", "--max-queue", "--request-timeout-s", "--max-body-bytes")


def _help(capsys, *verb: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([*verb, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("verb", [("generate",), ("bench", "prompts"), ("bench", "session"), ("profile",)])
def test_run_verbs_hide_the_server_flags(capsys, verb):
    text = _help(capsys, *verb)
    assert "--drafter {none,ngram,suffix,dflash,mtp}" in text and "--max-tokens" in text
    for flag in SERVER_FLAGS:
        assert flag not in text, f"{verb} --help lists {flag}"


def test_serve_shows_the_user_settings_and_accepts_the_developer_ones(capsys):
    """Every setting stays reachable: a user one in --help, a developer one as the same flag (and YAML key and
    EDGESPEC_ variable), listed by `edgespec dev settings`."""
    text = _help(capsys, "serve")
    for name in USER_SETTINGS:
        assert flag_of(name) + " " in text, name
    for name in DEV_SETTINGS:
        assert flag_of(name) + " " not in text, f"developer setting {name} in serve --help"
    assert [s for s in SECTIONS if f"{s} settings:" in text] == [s for s in SECTIONS if s != "runtime"]
    from edgespec.cli import build_parser
    from edgespec.config import load_settings

    argv = ["serve"]
    for f in dataclasses.fields(Settings):
        if f.name in DEV_SETTINGS:
            value = {"draft_tree": "4", "gdn_block_v": "8", "gdn_warps": "2"}.get(f.name, f.default)
            argv += [flag_of(f.name), str(value if value is not None else "none")]
    args = build_parser(argv).parse_args(argv)
    assert load_settings(cli=args, environ={}).draft_tree == "4"
    assert main(["dev", "settings"]) == 0
    listing = capsys.readouterr().out
    listed = {line.split(":")[0].strip() for line in listing.splitlines() if line.startswith("  ") and
              not line.startswith("   ")}
    assert listed == set(DEV_SETTINGS)
    assert all(f"  {name}: {flag_of(name)} / EDGESPEC_{name.upper()}, default" in listing for name in DEV_SETTINGS)


def test_the_user_surface_is_what_an_integrator_sets():
    """Model, drafter, memory, server and telemetry settings are user ones; kernel switches and tuning are not."""
    assert {"model", "drafter", "drafter_path", "max_seq_len", "kv_dtype", "port", "api_key", "energy_meter",
            "request_log", "temperature"} <= set(USER_SETTINGS)
    assert {"gluon", "pdl", "no_triton", "gguf_isa", "cuda_graphs", "prefill_chunk", "rollback", "window_size",
            "ngram_max_match", "stage_timing"} <= set(DEV_SETTINGS)
    assert SECTION_OF["cuda_graphs"] == "runtime" and not set(USER_SETTINGS) & {
        n for n, s in SECTION_OF.items() if s == "runtime"}


def test_profile_rollbacks_are_the_strategies():
    from edgespec.arch.rollback import ROLLBACK_STRATEGIES
    from edgespec.profile.space import ROLLBACKS

    assert ROLLBACKS == ROLLBACK_STRATEGIES


# Every command line with a --help: each verb, each bench and dev subcommand.
COMMANDS = [(), *[(v,) for v in VERBS], *[("bench", m) for m in ("prompts", "formats", "shapes", "session",
                                                                  "multi-turn", "peer")],
            ("dev", "settings"), ("dev", "plan")]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "edgespec")
def test_every_help_fits_80_lines(capsys, monkeypatch, command):
    monkeypatch.setenv("COLUMNS", "80")         # an ordinary terminal: the narrowest --help is read in
    lines = _help(capsys, *command).splitlines()
    assert len(lines) <= 80, f"edgespec {' '.join(command)} --help prints {len(lines)} lines"


def test_help_version_and_host_doctor_import_no_torch():
    """`--help` of every command, `--version` and `doctor --host-only` run without importing torch (a fresh
    interpreter: this one has torch loaded already)."""
    script = textwrap.dedent(f"""
        import contextlib, io, sys
        from edgespec.cli import main
        for argv in {[[*c, "--help"] for c in COMMANDS] + [["--version"]]!r}:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
                main(argv)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(["doctor", "--host-only"]) == 0
        assert "python" in out.getvalue() and "torch" in out.getvalue()
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"torch imported: {done.stdout[:300]}"


def test_every_setting_has_a_section_and_server_ones_are_serve_only():
    assert set(SECTION_OF.values()) <= set(SECTIONS)
    assert SECTION_OF["model"] == "model" and SECTION_OF["drafter"] == "speculation"
    assert SECTION_OF["cuda_graphs"] == "runtime" and SECTION_OF["temperature"] == "sampling"
    assert {SECTION_OF[f[2:].replace("-", "_")] for f in SERVER_FLAGS} == {"server"}
    assert "server" not in RUN_SECTIONS


def test_generate_rejects_a_server_flag(capsys):
    with pytest.raises(SystemExit) as done:
        main(["generate", "--port", "9000", "hello"])
    assert done.value.code == 2 and "--port" in capsys.readouterr().err


def test_version_comes_from_the_package_metadata(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"edgespec {version('edgespec')}"
