"""Read a GGUF's metadata as a Hugging Face style folder: ``config.json``, ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``, written by :func:`write_gguf_folder`.

The native GGUF loader (:mod:`edgespec.loading.gguf_model`) reads the weights from the file itself and takes the
config and tokenizer from :func:`gguf_metadata_folder` (written once into the user cache); the GGUF -> safetensors
converter (:mod:`edgespec.convert.gguf`, ``edgespec convert``) writes the same folder plus the weights, passing its
tensor reader to :func:`write_gguf_folder`. Both share the GGUF tensor names and the q/k row order kept here.

Two llama.cpp conventions have to be undone on the way:

* GGUF lists tensor dimensions innermost first; the numpy arrays the ``gguf`` reader returns are already in
  row-major (HF) order, so we use those shapes and never the ``shape`` field.
* llama.cpp's converter reorders the rows of ``q_proj`` and ``k_proj`` inside each head from HF's "rotate
  half" RoPE layout (first half / second half of the head) to its interleaved-pair layout. The inverse is
  applied here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.errors import CheckpointError, EdgespecError, UnsupportedModelError
from edgespec.loading.gguf_qwen35 import (
    QWEN35_BLOCK_NAMES,
    QWEN35_PARAMS,
    is_mtp_tensor,
    main_layer_count,
    qwen35_config,
)
from edgespec.paths import cache_root

__all__ = [
    "MARKER",
    "OUTPUT_FILES",
    "gguf_metadata_folder",
    "is_converted",
    "open_gguf",
    "write_gguf_folder",
]

log = logging.getLogger(__name__)

# Written last into a finished folder. Bump FORMAT when the output changes so old caches get rebuilt.
MARKER = ".edgespec-converted.json"
FORMAT = 1
OUTPUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json")

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Split patterns of llama.cpp's BPE pre-tokenizer types that edgespec can reproduce with `tokenizers`.
_GPT2_REGEX_PRE = {"default", "gpt2", "mpt", "olmo"}
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = {"llama3", "llama-bpe", "llama-v3", "smaug-bpe", "falcon3"}
# Qwen2/Qwen3's split: the Llama 3 pattern with single digits.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN2_PRE = {"qwen2"}
# Qwen3.5's split (llama.cpp's "qwen35"): combining marks (\p{M}) stay with the letters before them.
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {**{p: _LLAMA3_SPLIT for p in _LLAMA3_PRE}, **{p: _QWEN2_SPLIT for p in _QWEN2_PRE}, "qwen35": _QWEN35_SPLIT}

# GGUF architectures served: HF model_type and class. llama.cpp's converter reorders the q/k rows of "llama" only
# (its RoPE is the interleaved kind); qwen3 uses NeoX RoPE, HF's rotate-half layout, so its rows stay as they are.
# qwen35 (the Qwen3.5 hybrid) is read in the file's own head order: edgespec.loading.gguf_qwen35.
GGUF_ARCHS = {"llama": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
              "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM")}
ROPE_PERMUTED_ARCHS = ("llama",)


# ------------------------------------------------------------------------------------------------------------
# GGUF reading


def _field_value(field: Any) -> Any:
    """Python value of a GGUF metadata field (scalar, string, or list), independent of gguf-py's version."""
    import gguf

    types = list(field.types)
    if not types:
        return None

    def one(kind: Any, part: np.ndarray) -> Any:
        if kind == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        return part.tolist()[0]

    if types[0] == gguf.GGUFValueType.ARRAY:
        return [one(types[-1], field.parts[i]) for i in field.data]
    return one(types[0], field.parts[-1])


class _Meta:
    """GGUF metadata with errors that name the file and the key."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._reader = reader
        self._path = path

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else _field_value(field)

    def require(self, key: str) -> Any:
        if key not in self._reader.fields:
            raise CheckpointError(f"{self._path}: GGUF metadata key {key!r} is missing")
        return _field_value(self._reader.fields[key])


def _float32_clean(value: float) -> float:
    # GGUF stores eps/theta as float32 (1e-5 reads back as 9.9999997e-06); write the shortest decimal that
    # round-trips through float32 so config.json says 1e-05 like the original.
    return float(str(np.float32(value)))


# ------------------------------------------------------------------------------------------------------------
# tensor names and row order


def _unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp views each head's rows as ``[2, head_dim/2]`` (HF's two RoPE halves) and transposes to
    ``[head_dim/2, 2]`` so that rotated pairs sit next to each other. We view them as ``[head_dim/2, 2]`` and
    transpose back.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise CheckpointError(f"q/k weight with {rows} rows does not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return np.ascontiguousarray(
        weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",          # qwen3
    "attn_k_norm": "self_attn.k_norm",
    **QWEN35_BLOCK_NAMES,
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)(?:\.(weight|bias))?$")   # qwen35's ssm_a has no suffix
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def _hf_name(gguf_name: str) -> tuple[str, str | None, int | None]:
    """(HF tensor name, GGUF block role or None, layer index or None); unknown names raise."""
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        layer, role, kind = int(m.group(1)), m.group(2), m.group(3)
        if (role, kind) in QWEN35_PARAMS:            # HF parameters that are no module's weight or bias
            return f"model.layers.{layer}.{QWEN35_PARAMS[role, kind]}", role, layer
        if kind is not None:
            return f"model.layers.{layer}.{_BLOCK_NAMES[role]}.{kind}", role, layer
    m = _TOP_RE.match(gguf_name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}", None, None
    # e.g. rope_freqs (Llama 3.1 rope scaling): silently dropping it would give a subtly wrong model.
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no Llama equivalent edgespec knows")


# ------------------------------------------------------------------------------------------------------------
# tokenizer


def _build_tokenizer(meta: _Meta, path: Path) -> tuple[Any, list[int], list[int]]:
    """A ``tokenizers.Tokenizer`` rebuilt from the GGUF vocabulary; also (control ids, user-defined ids)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    model = meta.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedModelError(
            f"{path}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') vocabularies convert"
        )
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    merges_raw: list[str] = meta.require("tokenizer.ggml.merges")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre", "default")

    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens has duplicate entries")
    # Byte-level tokens never contain a real space (it is spelled "Ġ"), so one space separates a merge pair.
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    tk = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))

    if pre in _DIGITS_THEN_GPT2_PRE:
        # llama.cpp: "\p{N}" split first (every digit alone), then the GPT-2 pattern -- what SmolLM2's own
        # tokenizer.json expresses as Digits(individual) + ByteLevel(use_regex).
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in _GPT2_REGEX_PRE:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _SPLITS:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        raise UnsupportedModelError(f"{path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported")
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)

    control = [i for i, t in enumerate(types) if t == _TOKEN_CONTROL]
    user = [i for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED]
    # Control tokens (<|im_start|>, ...) must be matched whole in rendered chat text and skipped on decode.
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    if user:
        tk.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    return tk, control, user


# ------------------------------------------------------------------------------------------------------------
# conversion


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def open_gguf(gguf_path: Path) -> Any:
    """A ``gguf.GGUFReader`` over the file (memory-mapped); a damaged file raises a named error."""
    import gguf

    try:
        return gguf.GGUFReader(str(gguf_path))
    except Exception as exc:  # gguf-py raises ValueError/struct.error/... on damaged files
        raise CheckpointError(f"{gguf_path}: not a readable GGUF file: {exc}") from exc


def _special_tokens(meta: _Meta, tokens: list[str]) -> dict[str, tuple[int | None, str | None]]:
    """``bos``, ``eos``, ``pad``, ``unk`` and ``eot``: (id, text) of each special token the GGUF names, (None,
    None) for those it does not (or names out of range)."""
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id",
            "eot": "eot_token_id"}
    out: dict[str, tuple[int | None, str | None]] = {}
    for role, key in keys.items():
        idx = meta.get(f"tokenizer.ggml.{key}")
        ok = idx is not None and 0 <= int(idx) < len(tokens)
        out[role] = (int(idx), tokens[int(idx)]) if ok else (None, None)
    return out


def _write_tokenizer_files(dest: Path, meta: _Meta, tokenizer: Any, tokens: list[str], control_ids: list[int],
                           special: dict[str, tuple[int | None, str | None]], context_length: int) -> None:
    """``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat template) and
    ``generation_config.json`` of a converted GGUF."""
    (bos_id, bos), (eos_id, eos), (pad_id, pad) = special["bos"], special["eos"], special["pad"]
    unk, eot_id = special["unk"][1], special["eot"][0]
    eos_ids = [i for i in dict.fromkeys([eos_id, eot_id]) if i is not None]
    tokenizer.save(str(dest / "tokenizer.json"))
    tok_cfg: dict[str, Any] = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": tokens[i], "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i in control_ids
        },
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        # Loads tokenizer.json exactly as written (a model-specific class could rebuild its own pipeline).
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        tok_cfg["chat_template"] = template
    _write_json(dest / "tokenizer_config.json", {k: v for k, v in tok_cfg.items() if v is not None})

    gen_cfg = {"bos_token_id": bos_id, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
               "pad_token_id": pad_id}
    _write_json(dest / "generation_config.json", {k: v for k, v in gen_cfg.items() if v not in (None, [])})


def _gguf_tokenizer(meta: _Meta, path: Path) -> tuple[Any, list[int], list[str]]:
    """(tokenizer, control ids, tokens) of the file. llama.cpp's "none" vocabulary (benchmark files: llama-bench
    feeds token ids) has no tokenizer to rebuild: (None, [], []), and the file loads for benchmarks only (no
    tokenizer files are written; serving it names the missing file)."""
    if meta.get("tokenizer.ggml.model") == "none":
        return None, [], []
    tokenizer, control_ids, _ = _build_tokenizer(meta, path)
    return tokenizer, control_ids, meta.require("tokenizer.ggml.tokens")


# The GGUF's tensors as HF-named float32 arrays (reader, file, head count, KV head count, q/k rows permuted).
TensorReader = Callable[[Any, Path, int, int, bool], dict[str, np.ndarray]]


def _convert_into(gguf_path: Path, dest: Path, tensors: TensorReader | None = None) -> None:
    """Write every output file of ``gguf_path`` into the (empty) folder ``dest``, ``model.safetensors`` from
    ``tensors`` when given; without: config and tokenizer for a model whose weights are read from the GGUF."""
    weights = tensors is not None
    from safetensors.numpy import save_file

    reader = open_gguf(gguf_path)
    meta = _Meta(reader, gguf_path)

    arch = meta.require("general.architecture")
    if arch not in GGUF_ARCHS:
        raise UnsupportedModelError(f"{gguf_path}: GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHS)}")
    model_type, hf_class = GGUF_ARCHS[arch]
    hidden = int(meta.require(f"{arch}.embedding_length"))
    n_heads = int(meta.require(f"{arch}.attention.head_count"))
    n_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // n_heads))
    if meta.has(f"{arch}.rope.scaling.type") and meta.get(f"{arch}.rope.scaling.type") not in ("none", None):
        raise UnsupportedModelError(f"{gguf_path}: RoPE scaling ({arch}.rope.scaling.type) is not supported")

    tokenizer, control_ids, tokens = _gguf_tokenizer(meta, gguf_path)
    vocab_size = int(meta.get(f"{arch}.vocab_size", len(tokens))) if tokens else int(meta.require(f"{arch}.vocab_size"))

    special = _special_tokens(meta, tokens)
    bos_id, eos_id, pad_id = special["bos"][0], special["eos"][0], special["pad"][0]

    # qwen35: the MTP layers a converter may append are not part of the main model (gguf_qwen35).
    main = main_layer_count(meta, arch) if arch == "qwen35" else None
    kept = [t for t in reader.tensors if main is None or not is_mtp_tensor(t.name, main)]
    names = {_hf_name(t.name)[0] for t in kept}   # also rejects tensors we do not know
    arrays = tensors(reader, gguf_path, n_heads, n_kv_heads, arch in ROPE_PERMUTED_ARCHS) if tensors else {}
    tied = "lm_head.weight" not in names
    if "model.embed_tokens.weight" not in names:
        raise CheckpointError(f"{gguf_path}: no token_embd.weight tensor")
    context_length = int(meta.require(f"{arch}.context_length"))
    rope_theta = _float32_clean(meta.get(f"{arch}.rope.freq_base", 10000.0))

    config = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32_clean(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        # Both spellings: transformers 5 reads rope_parameters, older readers rope_theta.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": context_length,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in names,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
    }
    if arch == "qwen35":
        config.update(qwen35_config(meta, arch, head_dim, rope_theta))

    if weights:
        save_file(arrays, str(dest / "model.safetensors"), metadata={"format": "pt"})
    del arrays
    _write_json(dest / "config.json", config)

    if tokenizer is not None:
        _write_tokenizer_files(dest, meta, tokenizer, tokens, control_ids, special, context_length)


def is_converted(folder: Path, source: Path | None = None, weights: bool = True) -> bool:
    """True when ``folder`` is a finished conversion of this format (and of ``source``, when given);
    ``weights=False``: a metadata-only folder (:func:`gguf_metadata_folder`) is enough."""
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        return False
    if source is not None and info.get("source_size") != source.stat().st_size:
        return False  # the package shipped a different GGUF
    if weights and not info.get("weights", True):
        return False
    names = OUTPUT_FILES if info.get("tokenizer", True) else ("config.json", "model.safetensors")
    return all((folder / name).is_file() for name in names if weights or name != "model.safetensors")


def _remove_tree(path: Path) -> None:
    # Move aside first so that the final name is free at once even if deleting takes a while or fails midway.
    trash = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def write_gguf_folder(gguf_path: str | Path, out_dir: str | Path, *, force: bool = False,
                      progress: Callable[[str], None] | None = None, tensors: TensorReader | None = None) -> Path:
    """Write a llama/qwen3-architecture GGUF as an HF-style folder ``out_dir`` and return it: the weights too when
    ``tensors`` reads them (:func:`edgespec.convert.gguf.convert_gguf`), else config and tokenizer only.

    Skips the work when ``out_dir`` already holds a finished conversion (unless ``force``). The folder is
    built under a temporary name next to ``out_dir`` and renamed into place, so a crash or a concurrent run
    never leaves a half-written model behind. An existing ``out_dir`` that is not an edgespec conversion is
    never overwritten.
    """
    src = Path(gguf_path)
    out = Path(out_dir).expanduser()
    weights = tensors is not None
    if not src.is_file():
        raise CheckpointError(f"{src}: GGUF file not found")
    if not force and is_converted(out, src, weights):
        return out
    if out.exists() and not (out / MARKER).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(
            f"{out}: exists and is not a folder edgespec converted; remove it or choose another output folder"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if progress is not None:
            progress(f"converting {src.name} -> {out}")
        _convert_into(src, tmp, tensors)
        _write_json(tmp / MARKER, {"format": FORMAT, "source": str(src), "source_size": src.stat().st_size,
                                   "weights": weights, "tokenizer": (tmp / "tokenizer.json").is_file()})
        # mkdtemp makes the folder 0700 (and safetensors writes 0600); a model cache is ordinary readable
        # data.
        for item in tmp.iterdir():
            item.chmod(0o644)
        tmp.chmod(0o755)
        if out.exists():
            _remove_tree(out)
        try:
            os.rename(tmp, out)
        except OSError:
            # Another process finished the same conversion first; theirs is as good as ours.
            if is_converted(out, src, weights):
                return out
            raise
    except OSError as exc:
        raise EdgespecError(f"{out}: cannot write the converted model: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_metadata_folder(gguf_path: str | Path) -> Path:
    """A folder with the config and tokenizer files of ``gguf_path`` (no weights: the native loader reads them
    from the GGUF), written once into the user cache under a name keyed by the file's path, size and mtime."""
    src = Path(gguf_path).expanduser()
    if not src.is_file():
        raise CheckpointError(f"{src}: GGUF file not found")
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return write_gguf_folder(src, cache_root() / "gguf-meta" / f"{src.stem}-{key}", progress=log.info)
