"""The docs: configuration.md lists every setting as edgespec/config.py defines it; every repository path the docs
cite exists; docs/measurements/ holds exactly the files docs/benchmarks.md cites."""

from __future__ import annotations

import re
from pathlib import Path

from _tools import load_tool

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
