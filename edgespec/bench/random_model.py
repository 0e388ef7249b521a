"""Random-weight benchmark checkpoints of a named shape, paired with a real BPE tokenizer.

Time to first token of a chat turn depends on how many tokens the turn adds, which a byte-level tokenizer inflates
about fourfold; a speed figure of a model shape only needs the shape. :func:`bench_model` therefore writes random
weights of a :data:`~edgespec.bench.shapes.SHAPES` entry next to the demo's SmolLM2 BPE tokenizer (or any
folder's tokenizer files), so the same command measures the same scenario on this CPU and on a GPU machine that
cannot download anything: the weights are generated where they run, only the tokenizer files (about 3.4 MB) travel.

The folder is cached under ``edgespec``'s cache root, keyed by shape, tokenizer and dtype, and written under a
temporary name then renamed, so a crash leaves no half-written model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from edgespec.bench.shapes import write_chat_tokenizer, write_random_checkpoint
from edgespec.errors import CheckpointError, ConfigError

# The files that carry a tokenizer and its chat use (ChatTokenizer.from_folder reads these).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
_MARKER = ".edgespec-bench-model.json"


def demo_tokenizer_folder() -> Path:
    """The demo model's tokenizer files (SmolLM2 BPE, 49152 ids), read from the embedded GGUF's metadata."""
    try:
        from edgespec.convert.gguf import demo_gguf_path
        from edgespec.loading.gguf_meta import gguf_metadata_folder

        return gguf_metadata_folder(demo_gguf_path())
    except (CheckpointError, ImportError) as exc:
        raise ConfigError(f"the demo tokenizer is not available here ({exc}); where the demo is installed, run "
                          "`python tools/make_bench_model.py --tokenizer-only bench-tokenizer` and pass "
                          "--bench-tokenizer bench-tokenizer") from exc


def copy_tokenizer(src: str | Path, dest: str | Path) -> list[int]:
    """Copy the tokenizer files of ``src`` into ``dest``; return the ids that end a turn (generation_config's)."""
    src, dest = Path(src), Path(dest)
    if not (src / "tokenizer.json").is_file():
        raise CheckpointError(f"{src}: no tokenizer.json to take the benchmark tokenizer from")
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)
    gen = src / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    return [eos] if isinstance(eos, int) else list(eos or [])


def tokenizer_source(name: str) -> Path | None:
    """``demo`` -> the demo tokenizer folder, ``byte`` -> None (the byte-level chat tokenizer), else a folder."""
    if name == "demo":
        return demo_tokenizer_folder()
    if name == "byte":
        return None
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"benchmark tokenizer {name!r}: not demo, byte or a folder with tokenizer.json")
    return folder


def write_bench_model(shape: str, out: str | Path, tokenizer: str = "demo", dtype: str = "bfloat16",
                      mtp: bool = False, seed: int = 0) -> Path:
    """Write random weights of ``shape`` (a SHAPES name or ``tiny:FAMILY``) and the ``tokenizer``'s files (see
    :func:`tokenizer_source`) into ``out``."""
    from edgespec.bench.gpu import shape_config

    cfg = shape_config(shape)
    out = Path(out)
    src = tokenizer_source(tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    if src is None:
        write_chat_tokenizer(out)
        eos = [258]                 # <|im_end|> of the byte tokenizer
    else:
        eos = copy_tokenizer(src, out)
    if mtp:
        cfg["mtp_num_hidden_layers"] = 1
    if not eos:
        raise CheckpointError(f"{src}: generation_config.json names no eos_token_id to end a turn")
    cfg["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    # A test shape's small vocabulary grows to the tokenizer's (the published shapes' are all larger already).
    from tokenizers import Tokenizer
    n_ids = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    cfg["vocab_size"] = max(cfg["vocab_size"], n_ids)
    write_random_checkpoint(out, cfg, seed=seed, with_mtp=mtp, dtype=getattr(torch, dtype))
    return out


def bench_model(shape: str, tokenizer: str = "demo", dtype: str = "bfloat16", root: str | Path | None = None,
                mtp: bool = False) -> Path:
    """A cached random-weight checkpoint of ``shape`` with ``tokenizer``: written on first use, reused after."""
    from edgespec.paths import cache_root

    src = tokenizer_source(tokenizer)
    digest = "byte" if src is None else hashlib.sha256((src / "tokenizer.json").read_bytes()).hexdigest()[:12]
    from edgespec.bench.gpu import shape_config

    key = {"shape": shape, "tokenizer": digest, "dtype": dtype, "mtp": mtp, "config": shape_config(shape)}
    base = Path(root) if root is not None else cache_root() / "bench-models"
    out = base / f"{shape.replace(':', '-')}-{digest}-{dtype}{'-mtp' if mtp else ''}"
    marker = out / _MARKER
    if marker.is_file() and json.loads(marker.read_text()) == key:
        return out
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_bench_model(shape, tmp, tokenizer, dtype, mtp)
    (tmp / _MARKER).write_text(json.dumps(key))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
