"""Training loop of ``edgespec distill``: AdamW on the block objective, DDP under torchrun, checkpoint + resume.

Single process: plain. Under ``torchrun`` (``WORLD_SIZE`` > 1) the same code joins a process group (gloo on CPU,
nccl on GPU), wraps the objective in DistributedDataParallel and gives each rank its own share of the training
sequences (DistributedSampler); rank 0 alone writes checkpoints and prints progress. Every rank loads the target
(embedding and head) itself; the data folder is shared.

The output folder is a published-layout drafter (``config.json`` + ``model.safetensors``, bf16) after every
save; ``train_state.pt`` beside it holds the fp32 weights, optimizer state and step, so a killed run resumes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.utils.data import DistributedSampler

from edgespec.distill.data import Sequence_
from edgespec.distill.objective import BlockObjective, accepted_lengths, make_blocks, pack_blocks, sampled_vocab
from edgespec.drafters.dflash_net import DFlashDraftModel


@dataclass
class TrainOptions:
    """Optimisation knobs (the CLI's flags)."""

    steps: int = 400
    batch: int = 4                 # sequences per step and rank
    anchors: int = 32              # blocks per sequence and step
    lr: float = 6e-4
    warmup: int = 20
    weight_decay: float = 0.0
    clip: float = 1.0
    gamma: float = 7.0
    window: int | None = None
    eval_every: int = 50
    save_every: int = 100
    seed: int = 0
    vocab_sample: int = 0          # > 0: sampled softmax over the labels + this many random tokens
    time_budget_s: float | None = None   # fit ``steps`` to this many seconds of training (see fit_steps)
    pack: int = 1                  # sequences per forward (pack_blocks, >= 1): fewer, larger launches on a GPU
    eval_epoch: bool = False       # also estimate the held-out AL at the end of every epoch
    keep_best: bool = False        # write the drafter with the best held-out AL so far to OUT/best


def fit_steps(opts: TrainOptions, step: int, elapsed_s: float, step_s: float, eval_s: float) -> int:
    """Total steps that fit the time budget, decided once the first steps were timed: the remaining seconds over
    the cost of a step plus its share of the held-out evaluations, never more than ``opts.steps`` nor fewer than
    the steps already done. The cosine schedule then spans the steps that will actually run."""
    if opts.time_budget_s is None:
        return opts.steps
    per_step = step_s + eval_s / max(opts.eval_every, 1)
    left = max(opts.time_budget_s - elapsed_s - eval_s, 0.0)
    return max(step, min(opts.steps, step + int(left / max(per_step, 1e-9))))


def dist_info() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment (0, 1 without it)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_distributed(device: torch.device) -> tuple[int, int]:
    """Join the process group when launched by torchrun; returns (rank, world size)."""
    rank, world = dist_info()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world


def is_held_out(seq: Sequence_, every: int) -> bool:
    """Held-out split by prompt (a hash of its tokens): every sampled continuation of a held-out prompt is held
    out with its greedy one, so the estimate never sees a prompt trained on."""
    if every <= 0:
        return False
    h = hashlib.sha256(seq.tokens[:seq.prompt_len].numpy().astype("int64").tobytes()).digest()
    return int.from_bytes(h[:4], "little") % every == 0


def sample_anchors(seq: Sequence_, n: int, gen: torch.Generator) -> torch.Tensor:
    """Up to ``n`` distinct anchors among the continuation's positions ``prompt_len .. len-2`` (sorted)."""
    lo, hi = seq.prompt_len, seq.tokens.shape[0] - 2
    if hi < lo:
        return torch.empty(0, dtype=torch.long)
    span = hi - lo + 1
    pick = torch.randperm(span, generator=gen)[:n] + lo
    return pick.sort().values


class Progress:
    """One updating line on stderr (a terminal) or a line per report (a log file)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.t0 = total, enabled, time.time()
        self.tty = sys.stderr.isatty()

    def update(self, step: int, text: str, final: bool = False) -> None:
        if not self.enabled:
            return
        el = time.time() - self.t0
        eta = el / max(step, 1) * (self.total - step)
        width = 24
        fill = int(width * step / max(self.total, 1))
        line = f"[{'#' * fill}{'.' * (width - fill)}] {step}/{self.total} {text} {el:.0f}s eta {eta:.0f}s"
        if self.tty:
            print("\r" + line, end="\n" if final else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)


@torch.no_grad()
def estimate_acceptance(objective: BlockObjective, seqs: Sequence[Sequence_], stride: int = 8,
                        device: torch.device | str = "cpu", max_blocks: int = 16) -> float:
    """Mean greedy acceptance length (bonus included) of blocks anchored every ``stride`` positions (at most
    ``max_blocks`` per sequence) of held-out greedy continuations: what a greedy session on those prompts would
    see where its anchors land. Always over the full vocabulary."""
    cfg = objective.cfg
    total, n = 0.0, 0
    for s in seqs:
        anchors = torch.arange(s.prompt_len, s.tokens.shape[0] - 1, stride)[:max_blocks]
        if anchors.numel() == 0:
            continue
        b = make_blocks(s.tokens.to(device), s.prompt_len, s.taps.to(device), anchors.to(device), cfg.block_size,
                        cfg.mask_token_id)
        al = accepted_lengths(objective(b), b.labels)
        total += float(al.float().sum())
        n += al.numel()
    return total / max(n, 1)


def drafter_config(cfg: Any, target_cfg: Any) -> dict[str, Any]:
    """The published ``config.json`` of a drafter (the z-lab keys, mask id and taps under ``dflash_config``)."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "max_position_embeddings": target_cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias, "hidden_act": "silu", "vocab_size": target_cfg.vocab_size,
        "num_target_layers": target_cfg.num_hidden_layers, "tie_word_embeddings": False, "dtype": "bfloat16",
        "layer_types": list(cfg.layer_types), "sliding_window": cfg.sliding_window, "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
    }


def save_drafter(folder: Path, drafter: DFlashDraftModel, target_cfg: Any, info: dict[str, Any]) -> None:
    """Write the published layout (bf16, no prefix) atomically-enough: weights then config."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in drafter.state_dict().items()}
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(drafter_config(drafter.cfg, target_cfg), indent=2))
    (folder / "distill.json").write_text(json.dumps(info, indent=2))


class HeldOutLog:
    """Every held-out estimate of a run as ``[step, epoch, AL]``, and with ``best_dir`` the drafter of the best
    estimate so far written there (``--keep-best``). With a held-out set worded unlike the training prompts, the
    best point is where generality peaked, which later steps (fitting the training prompts harder) can pass by. A
    resumed run starts a new log."""

    def __init__(self, best_dir: Path | None) -> None:
        self.best_dir, self.best = best_dir, -math.inf
        self.history: list[list[float]] = []

    def record(self, al: float, step: int, epoch: int, drafter: DFlashDraftModel, target_cfg: Any,
               info: dict[str, Any]) -> None:
        self.history.append([step, epoch, round(al, 4)])
        if al > self.best:
            self.best = al
            if self.best_dir is not None:
                save_drafter(self.best_dir, drafter, target_cfg,
                             dict(info, step=step, epoch=epoch, held_out_al=al, held_out_history=self.history))


def lr_at(opts: TrainOptions, step: int) -> float:
    """Learning rate of ``step``: linear warm-up, then cosine decay to a tenth of ``opts.lr``."""
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    t = (step - opts.warmup) / max(opts.steps - opts.warmup, 1)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _accumulate_step(model: torch.nn.Module, objective: BlockObjective, train_seqs: Sequence[Sequence_],
                     picks: list[int], opts: TrainOptions, gen: torch.Generator, device: torch.device, world: int
                     ) -> tuple[float, int, int]:
    """Forward and backward over the step's sequences ``picks``, ``opts.pack`` per forward (gradients summed;
    DDP syncs on the last group only). Returns the summed loss (sequence-weighted), and the first-draft hits
    and valid rows for the top-1 figure."""
    loss_sum, hits, rows = 0.0, 0, 0
    groups = [picks[g:g + opts.pack] for g in range(0, len(picks), opts.pack)]
    for i, group in enumerate(groups):
        parts = []
        for j in group:
            s = train_seqs[j]
            anchors = sample_anchors(s, opts.anchors, gen)
            if anchors.numel():
                parts.append(make_blocks(s.tokens.to(device), s.prompt_len, s.taps.to(device),
                                         anchors.to(device), objective.cfg.block_size,
                                         objective.cfg.mask_token_id))
        if not parts:
            continue
        b = parts[0] if len(parts) == 1 else pack_blocks(parts)
        labels, vocab = b.labels, None
        if opts.vocab_sample > 0:
            vocab, labels = sampled_vocab(b.labels, objective.head.shape[0], opts.vocab_sample, gen)
        logits = model(b, vocab)
        loss, _ = objective.loss(logits, labels)
        # Each group's weighted mean (one sequence's without packing), averaged over the step's sequences
        # (DDP then averages over ranks).
        loss = loss * len(group) / len(picks)
        if world > 1 and i < len(groups) - 1:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()
        loss_sum += float(loss.detach()) * len(picks)       # the group mean times its sequences
        with torch.no_grad():
            valid = labels[:, 0] >= 0
            hits += int(((logits[:, 0].argmax(-1) == labels[:, 0]) & valid).sum())
            rows += int(valid.sum())
    return loss_sum, hits, rows


def _resume(state_path: Path, drafter: torch.nn.Module, optim: torch.optim.Optimizer, device: torch.device
            ) -> tuple[int, float | None]:
    """Load the drafter and optimizer state a killed run saved; returns its step and held-out AL at the start
    (0 and None for a fresh run)."""
    if not state_path.exists():
        return 0, None
    state = torch.load(state_path, map_location=device, weights_only=True)
    drafter.load_state_dict(state["drafter"])
    optim.load_state_dict(state["optim"])
    return int(state["step"]), state.get("first_al")


def _budget_steps(opts: TrainOptions, step: int, elapsed_s: float, step_s: float, eval_s: float,
                  device: torch.device) -> int:
    """The step count that fits the time budget (:func:`fit_steps`), agreed by every rank (the smallest: DDP
    ranks must stop at the same step); says so when it changes the plan."""
    rank, world = dist_info()
    total = fit_steps(opts, step, elapsed_s, step_s, eval_s)
    if world > 1:
        agreed = torch.tensor([total], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        total = int(agreed)
    if total != opts.steps and rank == 0:
        print(f"time budget {opts.time_budget_s:.0f}s: {step_s * 1e3:.0f} ms a step, training {total} "
              f"steps instead of {opts.steps}", file=sys.stderr, flush=True)
    return total


def train(objective: BlockObjective, train_seqs: Sequence[Sequence_], held_out: Sequence[Sequence_],
          opts: TrainOptions, out: Path, target_cfg: Any, device: torch.device, info: dict[str, Any]
          ) -> dict[str, Any]:
    """Run (or resume) training; returns the final figures (loss, held-out AL before/after)."""
    rank, world = dist_info()
    drafter = objective.drafter
    params = [p for p in drafter.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=opts.lr, weight_decay=opts.weight_decay, betas=(0.9, 0.95))
    state_path = out / "train_state.pt"
    step, first_al = _resume(state_path, drafter, optim, device)
    model: torch.nn.Module = objective
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(objective, broadcast_buffers=False)
    sampler = DistributedSampler(range(len(train_seqs)), num_replicas=world, rank=rank, shuffle=True,
                                 seed=opts.seed, drop_last=False)

    log = HeldOutLog(out / "best" if opts.keep_best and rank == 0 else None)

    def evaluate() -> float:
        drafter.eval()
        al = estimate_acceptance(objective, held_out, device=device) if held_out else float("nan")
        drafter.train()
        log.record(al, step, epoch, drafter, target_cfg, info)
        return al

    def save(final: bool = False) -> None:
        if rank != 0:
            return
        info_now = dict(info, step=step, held_out_al=last_al, held_out_al_start=first_al, loss=last_loss,
                        held_out_history=log.history)
        save_drafter(out, drafter, target_cfg, info_now)
        tmp = out / "train_state.pt.tmp"
        torch.save({"drafter": drafter.state_dict(), "optim": optim.state_dict(), "step": step,
                    "first_al": first_al}, tmp)
        os.replace(tmp, state_path)

    progress = Progress(opts.steps, rank == 0)
    t_start = time.time()
    epoch, order = 0, []
    if first_al is None:
        first_al = evaluate()
    eval_s = time.time() - t_start
    # With a time budget, steps first_step+1 .. first_step+probe are timed (the first one, with its allocations
    # and compiled kernels, is left out), then the step count is fitted once.
    first_step, probe, t_probe = step, min(10, opts.steps), 0.0
    last_al, last_loss = first_al, float("nan")
    progress.update(step, f"held-out AL {last_al:.2f}")
    gen = torch.Generator().manual_seed(opts.seed * 7919 + rank + 1000 * step)
    drafter.train()
    while step < opts.steps:
        if step == first_step + 1:
            t_probe = time.time()
        if step == first_step + probe and opts.time_budget_s is not None:
            step_s = (time.time() - t_probe) / max(probe - 1, 1)
            opts.steps = progress.total = _budget_steps(opts, step, time.time() - t_start, step_s, eval_s, device)
        if not order:
            sampler.set_epoch(epoch)
            epoch += 1
            order = list(sampler)
        picks, order = order[:opts.batch], order[opts.batch:]
        for g in optim.param_groups:
            g["lr"] = lr_at(opts, step)
        optim.zero_grad(set_to_none=True)
        loss_sum, hits, rows = _accumulate_step(model, objective, train_seqs, picks, opts, gen, device, world)
        torch.nn.utils.clip_grad_norm_(params, opts.clip)
        optim.step()
        step += 1
        last_loss = loss_sum / max(len(picks), 1)
        if step % opts.eval_every == 0 or step == opts.steps or (opts.eval_epoch and not order):
            last_al = evaluate()
        progress.update(step, f"loss {last_loss:.3f} top1 {hits / max(rows, 1):.2f} held-out AL {last_al:.2f} "
                              f"lr {lr_at(opts, step - 1):.1e}", final=step == opts.steps)
        if step % opts.save_every == 0 or step == opts.steps:
            save()
    if world > 1:
        dist.barrier()
    return {"steps": step, "loss": last_loss, "held_out_al": last_al, "held_out_al_start": first_al,
            "held_out_history": log.history, "best_held_out_al": log.best if opts.keep_best else None}
