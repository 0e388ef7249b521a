"""Training loop of ``edgespec distill``: AdamW on a drafter's objective, DDP under torchrun, checkpoint + resume.

Single process: plain. Under ``torchrun`` (``WORLD_SIZE`` > 1) the same code joins a process group (gloo on CPU,
nccl on GPU), wraps the objective in DistributedDataParallel and gives each rank its own share of every step's
sequences (DistributedSampler); rank 0 alone writes checkpoints, the curve and progress. Every rank loads the
target (embedding and head) itself; the data folder is shared.

A step is the same computation whatever the number of ranks: the epoch's shuffle is one permutation split
across ranks (with ``--batch B`` per rank, a step of W ranks trains on the sequences a single process with
``--batch W*B`` trains on), each sequence's anchors are drawn from a generator seeded by (seed, step, sequence),
not by rank, and the reported loss is the mean over all the step's sequences. So a distributed run follows the
single-process loss curve up to the rounding of the gradient all-reduce, and a resumed run follows the curve the
killed one would have (:mod:`edgespec.distill.checkpoint` keeps where in the epoch it stood).
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from edgespec.distill.checkpoint import load_state, save_drafter, save_state
from edgespec.distill.curve import write_curve
from edgespec.distill.data import Sequence_
from edgespec.distill.kinds import TrainObjective
from edgespec.distill.objective import accepted_drafts, make_blocks, pack_blocks, sampled_vocab
from edgespec.drafters.draft_vocab import rank_by_counts


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


DATA_PHASE_TIMEOUT = timedelta(hours=6)


def dist_info() -> tuple[int, int]:
    """(rank, world size) of the process group this process joined (0, 1 outside one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def launched_by_torchrun() -> bool:
    """Whether torchrun (torch's elastic launcher) started this process, as torch.distributed tells it."""
    return dist.is_available() and dist.is_torchelastic_launched()


def local_rank() -> int:
    """This process's rank on its node under torchrun (torch.distributed's word for it), 0 otherwise."""
    return dist.get_node_local_rank(fallback_rank=0) if launched_by_torchrun() else 0


def init_distributed(device: torch.device) -> tuple[int, int]:
    """Join the process group when launched by torchrun (torch.distributed reads the rendezvous torchrun set up);
    returns (rank, world size)."""
    if launched_by_torchrun() and not dist.is_initialized():
        # Rank 0 alone writes the self-instructed prompts and ranks wait for each other's data shards: with a
        # large target that takes far longer than the default 10-minute collective timeout.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=DATA_PHASE_TIMEOUT)
    return dist_info()


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


def seeded(*parts: int) -> torch.Generator:
    """A CPU generator seeded by a tuple of integers (seed, step, sequence ...), the same on every rank."""
    digest = hashlib.sha256(",".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@torch.no_grad()
def acceptance_sums(objective: TrainObjective, seqs: Sequence[Sequence_], stride: int = 8,
                    device: torch.device | str = "cpu", max_blocks: int = 16) -> tuple[float, int]:
    """(summed acceptance length, blocks) of greedy verification over blocks anchored every ``stride`` positions
    (at most ``max_blocks`` per sequence) of held-out greedy continuations: what a greedy session on those prompts
    would see where its anchors land. Always over the full vocabulary."""
    cfg = objective.cfg
    total, n = 0.0, 0
    for s in seqs:
        anchors = torch.arange(s.prompt_len, s.tokens.shape[0] - 1, stride)[:max_blocks]
        if anchors.numel() == 0:
            continue
        b = make_blocks(s.tokens.to(device), s.prompt_len, s.taps.to(device), anchors.to(device), cfg.block_size,
                        cfg.mask_token_id)
        al = accepted_drafts(objective.drafts(b), b.labels)
        total += float(al.float().sum())
        n += al.numel()
    return total, n


def estimate_acceptance(objective: TrainObjective, seqs: Sequence[Sequence_], stride: int = 8,
                        device: torch.device | str = "cpu", max_blocks: int = 16) -> float:
    """Mean greedy acceptance length (bonus included) of :func:`acceptance_sums`; under torchrun every rank
    scores its share of ``seqs`` and the sums are all-reduced (every rank returns the same figure)."""
    rank, world = dist_info()
    total, n = acceptance_sums(objective, seqs[rank::world] if world > 1 else seqs, stride, device, max_blocks)
    if world > 1:
        sums = torch.tensor([total, float(n)], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        total, n = float(sums[0]), int(sums[1])
    return total / max(n, 1)


def lr_at(opts: TrainOptions, step: int) -> float:
    """Learning rate of ``step``: linear warm-up, then cosine decay to a tenth of ``opts.lr``."""
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    t = (step - opts.warmup) / max(opts.steps - opts.warmup, 1)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _step_blocks(objective: TrainObjective, train_seqs: Sequence[Sequence_], group: list[int], opts: TrainOptions,
                 step: int, device: torch.device):
    """The blocks of one forward: every sequence of ``group`` with its anchors drawn from the generator of
    (seed, step, sequence index), packed into one batch; None when no sequence has an anchor."""
    parts = []
    for j in group:
        s = train_seqs[j]
        anchors = sample_anchors(s, opts.anchors, seeded(opts.seed, step, j))
        if anchors.numel():
            parts.append(make_blocks(s.tokens.to(device), s.prompt_len, s.taps.to(device), anchors.to(device),
                                     objective.cfg.block_size, objective.cfg.mask_token_id))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else pack_blocks(parts)


def _accumulate_step(model: torch.nn.Module, objective: TrainObjective, train_seqs: Sequence[Sequence_],
                     picks: list[int], opts: TrainOptions, step: int, device: torch.device, world: int
                     ) -> torch.Tensor:
    """Forward and backward over the step's sequences ``picks``, ``opts.pack`` per forward (gradients summed;
    DDP syncs on the last group only). Returns this rank's sums ``[loss x sequences, sequences, first-draft hits,
    valid first rows]`` (float64) for the step's figures."""
    rank, _ = dist_info()
    sums = torch.zeros(4, dtype=torch.float64)
    vocab_gen = seeded(opts.seed, step, -1 - rank)          # the sampled softmax's negatives: per rank
    groups = [picks[g:g + opts.pack] for g in range(0, len(picks), opts.pack)]
    for i, group in enumerate(groups):
        b = _step_blocks(objective, train_seqs, group, opts, step, device)
        if b is None:
            continue
        labels, vocab = b.labels, None
        if opts.vocab_sample > 0:
            vocab, labels = sampled_vocab(b.labels, objective.head.shape[0], opts.vocab_sample, vocab_gen)
        out = model(b, vocab)
        loss, _ = objective.loss(out, labels)
        logits = getattr(out, "logits", out)            # a kind's output may carry more than the logits
        # Each group's weighted mean (one sequence's without packing), averaged over the step's sequences
        # (DDP then averages over ranks).
        loss = loss * len(group) / len(picks)
        if world > 1 and i < len(groups) - 1:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()
        with torch.no_grad():
            valid = labels[:, 0] >= 0
            hits = ((logits[:, 0].argmax(-1) == labels[:, 0]) & valid).sum()
            sums += torch.tensor([float(loss.detach()) * len(picks), 0.0, float(hits), float(valid.sum())],
                                 dtype=torch.float64)
    sums[1] = len(picks)
    return sums


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


class Trainer:
    """One training run (or its resumption): the optimizer, the run state, the epoch order, saving and the
    held-out estimates. :meth:`run` trains to ``opts.steps`` and returns the final figures."""

    def __init__(self, objective: TrainObjective, train_seqs: Sequence[Sequence_], held_out: Sequence[Sequence_],
                 opts: TrainOptions, out: Path, published: dict[str, Any], device: torch.device,
                 info: dict[str, Any]) -> None:
        self.rank, self.world = dist_info()
        self.objective, self.train_seqs, self.held_out = objective, train_seqs, held_out
        self.opts, self.out, self.published, self.device, self.info = opts, out, published, device, info
        self.drafter = objective.drafter
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optim = torch.optim.AdamW(self.params, lr=opts.lr, weight_decay=opts.weight_decay, betas=(0.9, 0.95))
        self.state = load_state(out, self.drafter, self.optim, device)
        self.model: torch.nn.Module = objective
        if self.world > 1:
            self.model = torch.nn.parallel.DistributedDataParallel(objective, broadcast_buffers=False)
        self.sampler = DistributedSampler(range(len(train_seqs)), num_replicas=self.world, rank=self.rank,
                                          shuffle=True, seed=opts.seed, drop_last=False)
        self.order: list[int] = []
        if self.state.consumed:                     # resumed mid-epoch: the rest of that epoch's order
            self.sampler.set_epoch(self.state.epoch - 1)
            self.order = list(self.sampler)[self.state.consumed:]
        if self.state.total_steps is not None:
            opts.steps = self.state.total_steps
        self.best_dir = out / "best" if opts.keep_best and self.rank == 0 else None
        # The draft vocabulary's ranking (edgespec.drafters.draft_vocab): the training answers' token counts.
        self.draft_vocab = rank_by_counts((s.tokens[s.prompt_len:].tolist() for s in train_seqs),
                                          f"token counts of the {len(train_seqs)} training sequences' answers "
                                          "(edgespec distill)")

    def evaluate(self) -> float:
        """Estimate the held-out AL now, log it, and keep the best drafter (``--keep-best``)."""
        self.drafter.eval()
        al = (estimate_acceptance(self.objective, self.held_out, device=self.device) if self.held_out
              else float("nan"))
        self.drafter.train()
        st = self.state
        st.held_out.append([st.step, st.epoch, round(al, 4)])
        if al > st.best_al:
            st.best_al = al
            if self.best_dir is not None:
                save_drafter(self.best_dir, self.drafter, self.published,
                             dict(self.info, step=st.step, epoch=st.epoch, held_out_al=al,
                                  held_out_history=st.held_out), self.draft_vocab)
        return al

    def save(self) -> None:
        """Rank 0: the published drafter, the curve and the training state (in that order: the state last, so a
        resumed run never starts past what the folder shows)."""
        if self.rank != 0:
            return
        st = self.state
        info = dict(self.info, step=st.step, held_out_al=st.last_al, held_out_al_start=st.first_al,
                    loss=st.last_loss, held_out_history=st.held_out)
        save_drafter(self.out, self.drafter, self.published, info, self.draft_vocab)
        write_curve(self.out, st.curve, st.held_out, title=f"edgespec distill: {self.out.name}, world {self.world}")
        save_state(self.out, self.drafter, self.optim, st)

    def next_picks(self) -> list[int]:
        """This rank's sequences of the next step (a new epoch's shuffle when the current one is used up)."""
        st = self.state
        if not self.order:
            self.sampler.set_epoch(st.epoch)
            st.epoch += 1
            st.consumed = 0
            self.order = list(self.sampler)
        picks, self.order = self.order[:self.opts.batch], self.order[self.opts.batch:]
        st.consumed += len(picks)
        return picks

    def step(self) -> tuple[float, float]:
        """One optimizer step; returns (loss, first-draft top-1), each over all ranks' sequences."""
        picks = self.next_picks()
        for g in self.optim.param_groups:
            g["lr"] = lr_at(self.opts, self.state.step)
        self.optim.zero_grad(set_to_none=True)
        sums = _accumulate_step(self.model, self.objective, self.train_seqs, picks, self.opts, self.state.step,
                                self.device, self.world)
        torch.nn.utils.clip_grad_norm_(self.params, self.opts.clip)
        self.optim.step()
        self.state.step += 1
        if self.world > 1:
            sums = sums.to(self.device)
            dist.all_reduce(sums)
        loss, top1 = float(sums[0] / sums[1].clamp(min=1)), float(sums[2] / sums[3].clamp(min=1))
        self.state.curve.append([self.state.step, round(loss, 6), round(top1, 4)])
        return loss, top1

    def _fit_budget(self, t_start: float, t_probe: float, probe: int, eval_s: float, progress: Progress) -> None:
        step_s = (time.time() - t_probe) / max(probe - 1, 1)
        self.opts.steps = progress.total = _budget_steps(self.opts, self.state.step, time.time() - t_start, step_s,
                                                         eval_s, self.device)
        self.state.total_steps = self.opts.steps

    def run(self) -> dict[str, Any]:
        """Train (or resume) to ``opts.steps``; returns the final figures."""
        opts, st = self.opts, self.state
        progress = Progress(opts.steps, self.rank == 0)
        t_start = time.time()
        if st.first_al is None:
            st.first_al = self.evaluate()
        eval_s = time.time() - t_start
        # With a time budget, steps first+1 .. first+probe are timed (the first one, with its allocations and
        # compiled kernels, is left out), then the step count is fitted once (and kept by a resumed run).
        first, probe, t_probe = st.step, min(10, opts.steps), 0.0
        progress.update(st.step, f"held-out AL {st.first_al:.2f}")
        self.drafter.train()
        while st.step < opts.steps:
            if st.step == first + 1:
                t_probe = time.time()
            if st.step == first + probe and opts.time_budget_s is not None and st.total_steps is None:
                self._fit_budget(t_start, t_probe, probe, eval_s, progress)
            loss, top1 = self.step()
            al = st.last_al
            if st.step % opts.eval_every == 0 or st.step == opts.steps or (opts.eval_epoch and not self.order):
                al = self.evaluate()
            progress.update(st.step, f"loss {loss:.3f} top1 {top1:.2f} held-out AL {al:.2f} "
                                     f"lr {lr_at(opts, st.step - 1):.1e}", final=st.step == opts.steps)
            if st.step % opts.save_every == 0 or st.step == opts.steps:
                self.save()
        if self.world > 1:
            dist.barrier()
        return {"steps": st.step, "loss": st.last_loss, "held_out_al": st.last_al, "held_out_al_start": st.first_al,
                "held_out_history": st.held_out, "best_held_out_al": st.best_al if opts.keep_best else None}


def train(objective: TrainObjective, train_seqs: Sequence[Sequence_], held_out: Sequence[Sequence_],
          opts: TrainOptions, out: Path, published: dict[str, Any], device: torch.device, info: dict[str, Any]
          ) -> dict[str, Any]:
    """Run (or resume) training (:class:`Trainer`); returns the final figures (loss, held-out AL before/after).
    ``published`` is the drafter's ``config.json`` (its kind's ``published_config``)."""
    return Trainer(objective, train_seqs, held_out, opts, out, published, device, info).run()
