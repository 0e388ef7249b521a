"""Kernel options: every EDGESPEC_* name the code reads is a declared setting (or a listed non-setting), documented,
checked by name; the plan carries them and the engine installs them once per process, with no environment read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgespec.config import ENV_NOT_SETTINGS, ENV_PREFIX, Settings, load_settings
from edgespec.errors import ConfigError
from edgespec.kernels import options
from edgespec.kernels.options import KERNEL_SETTINGS, KernelOptions

ROOT = Path(__file__).resolve().parents[2]


def _names_in_code() -> set[str]:
    """Every EDGESPEC_<NAME> spelled in the package, the tools and the lab."""
    found: set[str] = set()
    for folder in ("edgespec", "arch", "serving", "tools", "lab"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh", ".c") and path.is_file():
                found |= set(re.findall(r"\bEDGESPEC_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return found


def test_every_environment_name_is_declared_and_documented():
    settings = {ENV_PREFIX + f.upper() for f in Settings.__dataclass_fields__}
    names = _names_in_code()
    assert {"EDGESPEC_GLUON", "EDGESPEC_GGUF_THREADS", "EDGESPEC_CACHE_DIR"} <= names     # the scan sees them
    undeclared = sorted(names - settings - set(ENV_NOT_SETTINGS))
    assert not undeclared, f"read but neither a setting nor in config.ENV_NOT_SETTINGS: {undeclared}"
    doc = (ROOT / "docs/configuration.md").read_text()
    for name in names:
        documented = f"`{name}`" in doc or f"`{name[len(ENV_PREFIX):].lower()}`" in doc
        assert documented, f"{name} is not in docs/configuration.md"


def test_kernel_switches_in_the_environment_are_settings(monkeypatch, capsys, demo_model_dir):
    """The live bug: EDGESPEC_GLUON=0 edgespec generate "hi" exited 2 with 'unknown setting(s) in environment
    EDGESPEC_*: gluon', while docs/architecture.md told users to set it. Now it generates, with Gluon off."""
    from edgespec.cli import main

    monkeypatch.setenv("EDGESPEC_GLUON", "0")
    assert main(["generate", "--model", str(demo_model_dir), "--drafter", "none", "--max-tokens", "3",
                 "--max-seq-len", "256", "hi"]) == 0, capsys.readouterr().err
    assert options.active().gluon is False             # the engine installed what the edge read
    env = {"EDGESPEC_GLUON": "0", "EDGESPEC_PDL": "0", "EDGESPEC_NO_TRITON": "1", "EDGESPEC_SKINNY": "wide",
           "EDGESPEC_GDN_BLOCK_V": "32", "EDGESPEC_GDN_WARPS": "2", "EDGESPEC_GGUF_NATIVE": "0",
           "EDGESPEC_GGUF_THREADS": "3", "EDGESPEC_DRAFT_TREE_KERNELS": "conv"}
    got = KernelOptions.from_settings(load_settings(environ=env))
    assert got == KernelOptions(no_triton=True, gluon=False, pdl=False, skinny="wide", gdn_block_v=32, gdn_warps=2,
                                gguf_native=False, gguf_threads=3, draft_tree_kernels="conv")
    assert set(KERNEL_SETTINGS) <= set(Settings.__dataclass_fields__)


@pytest.mark.parametrize("name,value,problem", [
    ("EDGESPEC_GDN_BLOCK_V", "48", "gdn_block_v 48: give a power of two"),
    ("EDGESPEC_GDN_WARPS", "3", "gdn_warps 3: give 1, 2, 4 or 8"),
    ("EDGESPEC_SKINNY", "narrow", "skinny .*'narrow' is not one of all, wide"),
    ("EDGESPEC_GGUF_THREADS", "0", "gguf_threads .*below the minimum 1"),
    ("EDGESPEC_GLUON", "maybe", "gluon .*'maybe' is not a valid bool"),
    ("EDGESPEC_DRAFT_TREE_KERNELS", "fast", "draft_tree_kernels .*'fast' is not one of reference, conv, triton"),
])
def test_bad_kernel_options_are_refused_by_name(name, value, problem):
    with pytest.raises(ConfigError, match=problem):
        KernelOptions.from_settings(load_settings(environ={name: value}))


def test_kernels_never_read_the_environment(monkeypatch):
    """Without an install the kernels run the defaults, whatever EDGESPEC_* says: the environment is read at the
    edge (load_settings) only."""
    monkeypatch.setenv("EDGESPEC_PDL", "0")
    assert options.active() == KernelOptions()
    assert options.install(KernelOptions()) == KernelOptions()       # the same again: fine
    with pytest.raises(ConfigError, match=r"installed once per process.*pdl=False \(in force: True\)"):
        options.install(KernelOptions(pdl=False))


def test_the_engine_installs_its_plan_and_refuses_a_second_one(tiny_checkpoints, tmp_path):
    """The plan's options reach the kernels through the engine's install; an engine asking for others in the same
    process is refused by name before it loads, rather than running kernels chosen under both."""
    import shutil

    from edgespec.bench.shapes import write_chat_tokenizer
    from edgespec.engine import Engine
    from edgespec.plan import build_plan

    folder = write_chat_tokenizer(shutil.copytree(tiny_checkpoints["llama"], tmp_path / "llama"))
    settings = Settings(model=str(folder), device="cpu", max_seq_len=64, cpu_blas=False)
    plan = build_plan(settings.with_overrides(gguf_threads=2))
    assert plan.kernels == KernelOptions(gguf_threads=2)
    Engine.load(plan)
    assert options.active() == plan.kernels
    with pytest.raises(ConfigError, match=r"gguf_threads=3 \(in force: 2\)"):
        Engine.load(build_plan(settings.with_overrides(gguf_threads=3)))
