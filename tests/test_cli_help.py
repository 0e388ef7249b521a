"""Each verb's --help shows its own flags: server flags only on `serve`, fixed choices listed, and --version."""

from __future__ import annotations

import dataclasses

import pytest

from edgespec.cli import main
from edgespec.config import RUN_SECTIONS, SECTION_OF, SECTIONS, Settings

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


def test_serve_lists_every_setting_by_section(capsys):
    text = _help(capsys, "serve")
    for f in dataclasses.fields(Settings):
        assert "--" + f.name.replace("_", "-") in text
    assert [s for s in SECTIONS if f"{s} settings:" in text] == list(SECTIONS)


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
