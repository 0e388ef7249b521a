"""Distillation data: the target's own continuations of a prompt set, with its tapped hidden states, on disk.

Generating is by far the slowest part of training a small drafter on a CPU, so it runs once and is cached in a
folder of shards (``shard-NNNNN.safetensors``, one per generation batch, written atomically) plus ``meta.json``
(what produced them). Re-running with the same recipe resumes after the last complete shard; a different recipe
in the same folder is refused rather than mixed in.

Each sequence is ``tokens`` (chat-templated prompt + continuation), ``prompt_len`` (the loss covers only the
continuation) and ``taps [n, n_taps, H]``: the target's hidden states at the drafter's tap layers for its first
``n`` tokens (every token but possibly the last). Greedy continuations teach the drafter the exact path greedy
verification accepts; sampled ones (``samples_per_prompt``) widen the contexts it has seen.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from edgespec.distill.batched import Generated, generate_batch, supports_batched
from edgespec.errors import CheckpointError, ConfigError
from edgespec.loading.tokenizer import ChatTokenizer
from edgespec.models.decoder import TargetModel

CACHE_DTYPE = torch.bfloat16     # hidden states keep their range (fp16 overflows on outliers); half of fp32 on disk


@dataclass
class Sequence_:
    """One training sequence (see the module doc)."""

    tokens: torch.Tensor          # [T] int64
    prompt_len: int
    taps: torch.Tensor            # [n, n_taps, H], n >= T - 1


@dataclass
class DataRecipe:
    """What a data folder was generated from: a different recipe never mixes into an existing folder."""

    target: str
    taps: list[int]
    prompts_sha: str
    max_new_tokens: int
    samples_per_prompt: int
    temperature: float
    seed: int
    batch: int
    extra: dict = field(default_factory=dict)


def _prompts_sha(prompts: Sequence[str]) -> str:
    import hashlib

    return hashlib.sha256("\x00".join(prompts).encode()).hexdigest()[:16]


@torch.inference_mode()
def generate_one(model: TargetModel, prompt: Sequence[int], *, max_new_tokens: int, stop_ids: Sequence[int],
                 taps: Sequence[int], temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> Generated:
    """The serving model's path, one sequence: works for every target family (Qwen3.5 hybrids included)."""
    cache = model.new_cache(len(prompt) + max_new_tokens + 1)
    out = model.forward(torch.tensor(list(prompt), device=model.device), cache, taps=taps, logits="last")
    rows, tokens = [out.taps], list(prompt)
    for step in range(max_new_tokens):
        logits = out.logits[-1]
        if temperature > 0:
            nxt = int(torch.multinomial(torch.softmax(logits.float().cpu() / temperature, -1), 1,
                                        generator=generator))
        else:
            nxt = int(logits.argmax())
        tokens.append(nxt)
        if nxt in stop_ids or step == max_new_tokens - 1:
            break
        out = model.forward(torch.tensor([nxt], device=model.device), cache, taps=taps, logits="all")
        rows.append(out.taps)
    return Generated(tokens=tokens, prompt_len=len(prompt), taps=torch.cat(rows))


@torch.inference_mode()
def capture_taps(model: TargetModel, tokens: Sequence[int], taps: Sequence[int]) -> torch.Tensor:
    """Tapped hidden states ``[T, n_taps, H]`` of a given token sequence (teacher forcing, e.g. a logged reply)."""
    cache = model.new_cache(len(tokens))
    return model.forward(torch.tensor(list(tokens), device=model.device), cache, taps=taps, logits="none").taps


def _write_shard(path: Path, items: Sequence[Generated]) -> None:
    tokens = torch.cat([torch.tensor(g.tokens, dtype=torch.int32) for g in items])
    lens = torch.tensor([len(g.tokens) for g in items], dtype=torch.int64)
    tap_lens = torch.tensor([g.taps.shape[0] for g in items], dtype=torch.int64)
    tensors = {
        "tokens": tokens, "lengths": lens, "tap_lengths": tap_lens,
        "prompt_lens": torch.tensor([g.prompt_len for g in items], dtype=torch.int64),
        "taps": torch.cat([g.taps.to(CACHE_DTYPE).cpu() for g in items]).contiguous(),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)     # a shard is either whole or absent: an interrupted run resumes cleanly


def write_sequences(folder: str | Path, items: Sequence[Generated], recipe: DataRecipe) -> Path:
    """Write already-made sequences (e.g. from a request log) as a one-shard data folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").write_text(json.dumps(asdict(recipe), indent=2))
    _write_shard(folder / "shard-00000.safetensors", items)
    return folder


def generate_data(folder: str | Path, model: TargetModel, tokenizer: ChatTokenizer, prompts: Sequence[str],
                  recipe: DataRecipe, *, rank: int = 0, world: int = 1,
                  progress: Callable[[int, int, int], None] | None = None) -> Path:
    """Generate (or resume) the data folder for ``prompts``: every prompt greedily, plus
    ``recipe.samples_per_prompt`` sampled continuations each. ``progress(done, total, tokens)`` after each shard.
    Under torchrun every rank generates the shards ``n % world == rank`` (each shard is seeded by its index, so
    the folder's content does not depend on the number of ranks) and all wait for the whole folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = folder / "meta.json"
    want = asdict(recipe)
    if world > 1:
        import torch.distributed as dist

        if rank == 0:
            _claim(meta, want, folder)
        dist.barrier()
        _generate_shards(folder, model, tokenizer, prompts, recipe, rank, world, progress)
        dist.barrier()
        return folder
    _claim(meta, want, folder)
    _generate_shards(folder, model, tokenizer, prompts, recipe, rank, world, progress)
    return folder


def _claim(meta: Path, want: dict, folder: Path) -> None:
    """Write the recipe into a new folder, or check that an existing folder was made with the same one."""
    if meta.exists():
        have = json.loads(meta.read_text())
        if have != want:
            diff = sorted(k for k in want if have.get(k) != want[k])
            raise ConfigError(f"data folder {folder} was made with a different recipe ({', '.join(diff)} differ): "
                              f"use another --data folder or delete it")
    else:
        meta.write_text(json.dumps(want, indent=2))


def _generate_shards(folder: Path, model: TargetModel, tokenizer: ChatTokenizer, prompts: Sequence[str],
                     recipe: DataRecipe, rank: int, world: int,
                     progress: Callable[[int, int, int], None] | None) -> None:
    stop_ids = tokenizer.stop_token_ids
    # Job list: (prompt index, temperature); greedy first so a short run still has the most useful data.
    jobs = [(i, 0.0) for i in range(len(prompts))]
    jobs += [(i, recipe.temperature) for _ in range(recipe.samples_per_prompt) for i in range(len(prompts))]
    batched = supports_batched(model)
    batch = recipe.batch if batched else 1
    chunks = [jobs[s:s + batch] for s in range(0, len(jobs), batch)]
    tokens_done = 0
    for n, chunk in enumerate(chunks):
        path = folder / f"shard-{n:05d}.safetensors"
        if path.exists() or n % world != rank:
            continue
        temp = chunk[0][1]
        same_temp = [j for j in chunk if j[1] == temp]
        rest = [j for j in chunk if j[1] != temp]
        gen = torch.Generator().manual_seed(recipe.seed * 1_000_003 + n)
        items: list[Generated] = []
        for group, t in ((same_temp, temp), (rest, rest[0][1] if rest else 0.0)):
            if not group:
                continue
            ids = [tokenizer.encode_chat([{"role": "user", "content": prompts[i]}], enable_thinking=False)
                   for i, _ in group]
            if batched:
                items += generate_batch(model, ids, max_new_tokens=recipe.max_new_tokens, stop_ids=stop_ids,
                                        taps=recipe.taps, temperature=t, generator=gen)
            else:
                items += [generate_one(model, p, max_new_tokens=recipe.max_new_tokens, stop_ids=stop_ids,
                                       taps=recipe.taps, temperature=t, generator=gen) for p in ids]
        _write_shard(path, items)
        tokens_done += sum(len(g.tokens) - g.prompt_len for g in items)
        if progress is not None:
            progress(n + 1, len(chunks), tokens_done)


def load_data(folder: str | Path) -> tuple[dict, list[Sequence_]]:
    """``(meta, sequences)`` of a data folder, shards in order."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise ConfigError(f"no distillation data in {folder} (meta.json missing)")
    meta = json.loads(meta_path.read_text())
    seqs: list[Sequence_] = []
    for path in sorted(folder.glob("shard-*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                t = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:
            raise CheckpointError(f"cannot read data shard {path}: {e}") from None
        tok_off = torch.cat([torch.zeros(1, dtype=torch.int64), t["lengths"].cumsum(0)])
        tap_off = torch.cat([torch.zeros(1, dtype=torch.int64), t["tap_lengths"].cumsum(0)])
        for i in range(t["lengths"].shape[0]):
            tokens = t["tokens"][tok_off[i]:tok_off[i + 1]].long()
            seqs.append(Sequence_(tokens=tokens, prompt_len=int(t["prompt_lens"][i]),
                                  taps=t["taps"][tap_off[i]:tap_off[i + 1]]))
    if not seqs:
        raise ConfigError(f"data folder {folder} holds no sequences yet")
    return meta, seqs


def target_fingerprint(model_dir: str | Path) -> str:
    """A short hash of the target's ``config.json``: data from another target is never reused."""
    import hashlib

    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:16]


def make_recipe(model_dir: str | Path, taps: Sequence[int], prompts: Sequence[str], *, max_new_tokens: int,
                samples_per_prompt: int, temperature: float, seed: int, batch: int) -> DataRecipe:
    """The recipe of a data folder (see :class:`DataRecipe`)."""
    return DataRecipe(target=target_fingerprint(model_dir), taps=[int(t) for t in taps],
                      prompts_sha=_prompts_sha(prompts), max_new_tokens=max_new_tokens,
                      samples_per_prompt=samples_per_prompt, temperature=temperature, seed=seed, batch=batch)
