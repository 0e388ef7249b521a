"""tools/demo_target_pack.py: the demo GGUF in parts for the device tool, restored byte for byte."""

from __future__ import annotations

import shutil

import pytest

from tests._tools import load_tool
from tests.gguf_files import write_tiny_gguf

pack_tool = load_tool("demo_target_pack")


def test_a_gguf_in_parts_comes_back_identical_from_two_calls_folders(tmp_path) -> None:
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_1", embed_qtype="Q8_0")
    ranges = pack_tool._tensor_ranges(gguf_path)
    assert {r[2] for r in ranges} == {20, 34}                 # the Q4_1 and Q8_0 tensors are transposed
    pack_tool.pack(gguf_path, tmp_path / "pack", parts=3, preset=1)
    # The parts arrive in different device calls: two in one folder (stashed earlier), one in another.
    first, second = tmp_path / "call1", tmp_path / "call2"
    for folder, names in ((first, ["part-1-of-3.xz", "part-2-of-3.xz"]), (second, ["part-3-of-3.xz"])):
        folder.mkdir()
        for name in names + ["manifest.json", "gguf.zip"]:
            shutil.copyfile(tmp_path / "pack" / name, folder / name)
    pack_tool.stash(first, tmp_path / "stash")
    pack_tool.unpack([second, tmp_path / "stash"], tmp_path / "out.gguf")
    assert (tmp_path / "out.gguf").read_bytes() == gguf_path.read_bytes()


def test_a_missing_or_damaged_part_is_named(tmp_path) -> None:
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_1")
    pack_tool.pack(gguf_path, tmp_path / "pack", parts=2, preset=1)
    (tmp_path / "pack" / "part-2-of-2.xz").unlink()
    with pytest.raises(SystemExit, match="parts missing .*part-2-of-2.xz"):
        pack_tool.unpack([tmp_path / "pack"], tmp_path / "out.gguf")
    (tmp_path / "pack" / "part-2-of-2.xz").write_bytes(b"not the part")
    with pytest.raises(SystemExit, match=r"part-2-of-2.xz \(damaged\)"):
        pack_tool.unpack([tmp_path / "pack"], tmp_path / "out.gguf")
    with pytest.raises(SystemExit, match="no manifest.json"):
        pack_tool.unpack([tmp_path / "nowhere"], tmp_path / "out.gguf")


def test_the_drafter_evaluation_counts_requests_and_streams() -> None:
    """tools/demo_drafter_eval.py's verdict: ALs averaged over streams, faster counted per request and stream."""
    ev = load_tool("demo_drafter_eval")
    row = lambda al, tok_s, reqs: {"al": al, "tok_s": tok_s, "requests": [{"tok_s": t} for t in reqs]}  # noqa: E731
    ngram = [row(2.0, 10.0, [10, 10]), row(2.0, 20.0, [20, 20])]
    ours = [row(3.0, 12.0, [12, 9]), row(2.0, 25.0, [25, 21])]
    v = ev._verdict(ngram, ours)
    assert v["al"] == 2.5 and v["al_x_ngram"] == 1.25
    assert (v["faster_requests"], v["requests"], v["faster_streams"]) == (3, 4, 2)
