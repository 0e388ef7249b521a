"""``edgespec distill``: train (or adapt) a DFlash drafter for a target on the target's own outputs.

Two data sources: a prompt set the target answers itself (``--prompts FILE`` or ``--prompts robot:N`` for the
synthetic robot workload), or a request log the server wrote (``--from-log FILE``, usually with ``--init`` to
fine-tune an existing drafter). The result is a drafter folder in the published layout, loadable with
``--drafter dflash --drafter-path OUT``. Runs unchanged under ``torchrun --nproc-per-node N``. See docs/drafters.md.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from edgespec.errors import ConfigError

if TYPE_CHECKING:       # the heavy modules load only when a run needs them
    from edgespec.distill.data import Sequence_
    from edgespec.distill.holdout import HoldoutReport
    from edgespec.loading.tokenizer import ChatTokenizer
    from edgespec.models.decoder import TargetModel


def add_distill_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target and output")
    g.add_argument("--model", default="demo", help="target checkpoint folder, or 'demo' (embedded SmolLM2-135M)")
    g.add_argument("--out", required=True, help="drafter folder to write (resumes when it holds train_state.pt)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (torchrun: cuda:LOCAL_RANK)")
    g.add_argument("--target-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="target precision while generating data (auto: float32 on CPU, bfloat16 on GPU; float32 "
                   "on a GPU reproduces a CPU-served target's greedy outputs more closely)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads per process (default 1: on a shared CPU extra threads mostly wait)")
    g = p.add_argument_group("data")
    g.add_argument("--prompts", default="robot:160",
                   help="prompt file (.yaml/.jsonl/.txt), robot:N (synthetic robot prompts), tasks:N (JSON plans, "
                   "tool calls, reports), self:N / self-robot:N / self-tool:N (written by the target itself), or "
                   "several joined by '+' (e.g. self:2000+tasks:2000; docs/drafters.md)")
    g.add_argument("--self-temperature", type=float, default=1.0,
                   help="sampling temperature of the self-instructed requests")
    g.add_argument("--from-log", nargs="+", metavar="FILE",
                   help="train on request log(s) (JSONL written with request_log set) instead of prompts")
    g.add_argument("--data", help="data cache folder (default: OUT/data)")
    g.add_argument("--samples-per-prompt", type=int, default=1, help="sampled continuations per prompt (+1 greedy)")
    g.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled continuations")
    g.add_argument("--max-new-tokens", type=int, default=160)
    g.add_argument("--gen-batch", type=int, default=32, help="sequences generated at once (attention-only targets)")
    g.add_argument("--holdout-every", type=int, default=10, help="hold out about 1 prompt (or group) in N for the "
                   "AL estimate")
    g.add_argument("--holdout-by", choices=("prompt", "template", "source"), default="prompt",
                   help="hold out single prompts, or whole templates / sources (an entry's template:/source: "
                   "label), so the held-out AL measures prompts unlike the training ones (edgespec.distill.holdout)")
    g.add_argument("--held-out", metavar="FILE", help="your own held-out set instead: a prompt file the target "
                   "answers, or a request log; never trained on")
    g.add_argument("--data-only", action="store_true", help="generate the data cache, then stop")
    g = p.add_argument_group("drafter shape (ignored with --init)")
    g.add_argument("--drafter-kind", default="dflash", help="drafter architecture to train (edgespec.distill.kinds: "
                   "dflash, or dflash2: z-lab's DFlash2DraftModel, with the convolutions and the candidate selector)")
    g.add_argument("--init", help="start from this drafter folder (fine-tune) instead of random weights")
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--taps", help="comma-separated target_layer_ids (default: the reference rule)")
    g.add_argument("--intermediate-size", type=int, metavar="N", default=None, help="default: the target's")
    g.add_argument("--heads", type=int, default=None)
    g.add_argument("--kv-heads", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--target-init", action=argparse.BooleanOptionalAction, default=True,
                   help="start every drafter layer from the target's last decoder layer when the shapes match "
                   "(and the context path from the last tap), instead of random weights")
    g.add_argument("--mask-token-id", type=int, default=None, help="default: the target's last vocabulary id")
    g.add_argument("--conv-kernel-size", type=int, metavar="N", default=2,
                   help="dflash2: taps of each dynamic convolution")
    g.add_argument("--conv-group-size", type=int, metavar="N", default=16,
                   help="dflash2: channels per dynamic-coefficient group")
    g.add_argument("--selector-rank", type=int, metavar="N", default=256,
                   help="dflash2: rank of the selector's codebooks")
    g.add_argument("--selector-top-k", type=int, metavar="N", default=16,
                   help="dflash2: candidates per draft position")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=400)
    g.add_argument("--batch", type=int, default=4, help="sequences per step (per rank)")
    g.add_argument("--anchors", type=int, default=32, help="blocks per sequence per step")
    g.add_argument("--pack", type=int, default=1, help="sequences per forward: their blocks packed into one "
                   "masked batch (same logits; on a GPU one launch sequence instead of one per sequence)")
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--warmup", type=int, default=20)
    g.add_argument("--gamma", type=float, default=7.0, help="loss decay over block rows: exp(-(k-1)/gamma)")
    g.add_argument("--window", type=int, default=None, help="train with a per-token context window W (default: "
                   "the whole history, as the reference drafter)")
    g.add_argument("--vocab-sample", type=int, default=0,
                   help="score the labels against N random other tokens instead of the whole vocabulary (a "
                   "sampled softmax: several times cheaper on CPU; 0 = full softmax)")
    g.add_argument("--max-held-out", type=int, default=12, help="held-out prompts used by the AL estimate")
    g.add_argument("--time-budget", type=float, default=None, metavar="MINUTES",
                   help="fit --steps to this many minutes of training (timed over the first steps; the learning-rate "
                   "schedule spans the steps that fit)")
    g.add_argument("--eval-every", type=int, default=50)
    g.add_argument("--eval-each-epoch", action="store_true",
                   help="also estimate the held-out AL at the end of every epoch (all in distill.json)")
    g.add_argument("--keep-best", action="store_true",
                   help="write the drafter of the best held-out AL so far to OUT/best (with a held-out set worded "
                   "unlike the training prompts, where generality peaked)")
    g.add_argument("--save-every", type=int, default=100)
    g.add_argument("--seed", type=int, default=0)


def _prompts(spec: str) -> list[str]:
    """The prompts of a ``--prompts`` spec made of files and robot:N parts (self-instructed parts need the
    target: :func:`_prompt_set`)."""
    from edgespec.distill.self_instruct import sources_need_target

    if sources_need_target(spec):
        raise ConfigError(f"--prompts {spec!r}: self-instructed parts are written by the target while distilling")
    return [text for text, _ in _prompt_set(spec)]


def _source_prompts(kind: str, arg: str, make_self: Callable[[str, int], list[str]] | None
                    ) -> list[tuple[str, dict[str, str]]]:
    """One part of ``--prompts``: a prompt file with its labels, robot:N, or self-instructed (``make_self``)."""
    from edgespec.distill.workload import load_labelled_prompts, robot_prompts

    if kind == "file":
        return load_labelled_prompts(arg)
    if kind == "robot":
        return [(text, {}) for text in robot_prompts(int(arg))]
    if kind == "tasks":
        from edgespec.distill.tasks import task_prompts
        return task_prompts(int(arg))
    if make_self is None:
        raise ConfigError(f"--prompts {kind}:{arg}: self-instructed prompts need the target")
    return [(text, {}) for text in make_self(kind, int(arg))]


def _prompt_set(spec: str, make_self: Callable[[str, int], list[str]] | None = None
                ) -> list[tuple[str, dict[str, str]]]:
    """The labelled prompts of ``--prompts``: its ``+``-joined parts interleaved, each prompt labelled with its
    source (robot, self, self-robot, or the file's path) unless its entry names one."""
    from edgespec.distill.self_instruct import mixed, parse_sources

    parts = parse_sources(spec)
    return mixed([(arg if kind == "file" else kind, _source_prompts(kind, arg, make_self)) for kind, arg in parts])


def _self_instructed(args: argparse.Namespace, target, tokenizer, data_dir: Path, rank: int, world: int
                     ) -> Callable[[str, int], list[str]]:
    """The maker of self-instructed prompts for :func:`_prompt_set`: sampled by the target on rank 0 once and
    kept in ``data_dir`` (a rerun resumes with the same prompts; every rank reads the same file). Benchmark
    prompts and the ``--held-out`` file's prompts are never among them."""
    import torch  # here, not at the top: the CLI parser imports this module

    from edgespec.distill.self_instruct import self_instruct
    from edgespec.distill.workload import bench_prompt_texts, load_prompt_file

    exclude = set(bench_prompt_texts())
    if args.held_out and not _is_request_log(Path(args.held_out).expanduser()):
        exclude |= set(load_prompt_file(Path(args.held_out).expanduser()))

    def make(kind: str, n: int) -> list[str]:
        path = data_dir / f"prompts-{kind}-{n}-seed{args.seed}.json"
        if rank == 0 and not path.exists():
            t0 = time.time()
            prompts = self_instruct(target, tokenizer, n, topic=kind, seed=args.seed,
                                    temperature=args.self_temperature, batch=args.gen_batch, exclude=exclude)
            data_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(prompts, indent=0))
            tmp.replace(path)
            print(f"self-instructed ({kind}): {n} prompts in {time.time() - t0:.0f}s -> {path}", flush=True)
        if world > 1:
            torch.distributed.barrier()
        return _read_prompt_cache(path, n)

    return make


def _read_prompt_cache(path: Path, n: int) -> list[str]:
    """The self-instructed prompts an earlier run kept: a JSON list of ``n`` prompt strings."""
    try:
        prompts = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"self-instructed prompt cache {path} is unreadable ({e}): delete it to sample again") \
            from None
    if not (isinstance(prompts, list) and len(prompts) == n and all(isinstance(p, str) and p for p in prompts)):
        raise ConfigError(f"self-instructed prompt cache {path} is not a list of {n} prompt strings: delete it to "
                          f"sample again")
    return prompts


def _groups(args: argparse.Namespace, tokenizer, labelled: list[tuple[str, dict[str, str]]] | None
            ) -> dict[bytes, str]:
    """Prompt tokens (as data.py renders them) -> template or source, for ``--holdout-by template|source``."""
    import numpy as np

    from edgespec.distill.holdout import template_of

    if args.from_log:
        if args.holdout_by == "template":
            raise ConfigError("--holdout-by template needs prompt texts; a request log holds token ids: use "
                              "--holdout-by source (one log file per source) or --held-out FILE")
        from edgespec.distill.request_log import read_log
        return {np.asarray(prompt, dtype=np.int64).tobytes(): Path(path).name
                for path in args.from_log for prompt, _ in read_log(path)}
    out = {}
    for text, labels in labelled or []:
        ids = tokenizer.encode_chat([{"role": "user", "content": text}], enable_thinking=False)
        if args.holdout_by == "template":
            group = template_of(text, labels.get("template"))
        else:
            group = labels.get("source", args.prompts)
        out[np.asarray(ids, dtype=np.int64).tobytes()] = group
    return out


def _is_request_log(path: Path) -> bool:
    """A JSONL file whose first record carries prompt_ids (what the server's request log writes)."""
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    return isinstance(json.loads(line), dict) and "prompt_ids" in json.loads(line)
                except json.JSONDecodeError:
                    return False
    return False


def _held_out_data(args: argparse.Namespace, out: Path, target, tokenizer, model_dir: Path, taps, rank: int,
                   world: int) -> list:
    """``--held-out FILE`` as sequences: a request log as logged, a prompt file answered greedily by the
    target; cached in OUT/held_out_data like the training data."""
    import torch  # here, not at the top: the CLI parser imports this module

    from edgespec.distill.data import generate_data, load_data, make_recipe
    from edgespec.distill.workload import load_prompt_file

    path = Path(args.held_out).expanduser()
    folder = out / "held_out_data"
    if _is_request_log(path):
        from edgespec.distill.request_log import log_data
        if rank == 0:
            log_data(path, folder, target, model_dir, taps)
        if world > 1:
            torch.distributed.barrier()
    else:
        prompts = load_prompt_file(path)
        recipe = make_recipe(model_dir, taps, prompts, max_new_tokens=args.max_new_tokens, samples_per_prompt=0,
                             temperature=0.0, seed=args.seed, batch=args.gen_batch)
        generate_data(folder, target, tokenizer, prompts, recipe, rank=rank, world=world)
    _, seqs = load_data(folder)
    return [s for s in seqs if s.tokens.shape[0] - s.prompt_len >= 2]


def _write_data(args: argparse.Namespace, data_dir: Path, target: TargetModel, tokenizer: ChatTokenizer,
                model_dir: Path, taps: Sequence[int], rank: int, world: int, say: Callable[..., None]
                ) -> list[tuple[str, dict[str, str]]] | None:
    """Capture the training data into ``data_dir``: from a serving request log (``--from-log``, rank 0) or by
    generating the target's own continuations of the prompts (every rank its shard). Returns the labelled
    prompts (None for a log)."""
    import torch  # here, not at the top: the CLI parser imports this module

    from edgespec.distill.data import generate_data, make_recipe

    if args.from_log:
        from edgespec.distill.request_log import log_data

        if rank == 0:
            log_data(args.from_log, data_dir, target, model_dir, taps)
        if world > 1:
            torch.distributed.barrier()
        return None
    labelled = _prompt_set(args.prompts, _self_instructed(args, target, tokenizer, data_dir, rank, world))
    prompts = [text for text, _ in labelled]
    recipe = make_recipe(model_dir, taps, prompts, max_new_tokens=args.max_new_tokens,
                         samples_per_prompt=args.samples_per_prompt, temperature=args.temperature,
                         seed=args.seed, batch=args.gen_batch)
    sources = Counter(labels["source"] for _, labels in labelled)
    say(f"data: {len(prompts)} prompts ({', '.join(f'{k} {v}' for k, v in sources.items())}) x "
        f"(1 greedy + {args.samples_per_prompt} sampled) -> {data_dir}")
    generate_data(data_dir, target, tokenizer, prompts, recipe, rank=rank, world=world,
                  progress=_shard_bar(rank == 0))
    return labelled


def _shard_bar(enabled: bool) -> Callable[[int, int, int], None]:
    """The data progress bar: shards written (this rank's; a resumed run skips the shards already on disk) and
    the continuation tokens they hold."""
    from edgespec.distill.train import Progress

    bar: list[Progress] = []

    def update(done: int, total: int, tokens: int) -> None:
        if not bar:
            bar.append(Progress(total, enabled))
        bar[0].update(done, f"data shards, {tokens} new tokens", final=done == total)

    return update


def _held_out_inputs(args: argparse.Namespace, out: Path, target: TargetModel, tokenizer: ChatTokenizer,
                     model_dir: Path, taps: Sequence[int], rank: int, world: int,
                     labelled: list[tuple[str, dict[str, str]]] | None
                     ) -> tuple[dict[bytes, str] | None, list[Sequence_] | None]:
    """What ``_split`` holds out by: prompt groups (``--holdout-by template|source``) or the sequences of the
    user's own ``--held-out`` FILE; (None, None) for the plain 1-in-N prompt split."""
    if args.held_out is not None:
        return None, _held_out_data(args, out, target, tokenizer, model_dir, taps, rank, world)
    if args.holdout_by != "prompt":
        return _groups(args, tokenizer, labelled), None
    return None, None


def _split(seqs: list[Sequence_], args: argparse.Namespace, group_of: dict[bytes, str] | None,
           held_file: list[Sequence_] | None) -> tuple[list[Sequence_], list[Sequence_], HoldoutReport]:
    """Training and held-out sequences (``--holdout-by`` groups or ``--held-out`` FILE, edgespec.distill.holdout),
    and the report of how they were split."""
    from edgespec.distill.holdout import split

    trainset, held, report = split(seqs, args.holdout_by, args.holdout_every, group_of, held_file)
    # The held-out estimate runs on the greedy continuations (the path greedy verification follows); a sampled
    # continuation is told apart by not being the target's argmax path, which the data does not record, so the
    # estimate takes the first continuation of each held-out prompt (generation writes greedy ones first).
    firsts: dict[bytes, Sequence_] = {}
    for s in held:
        firsts.setdefault(s.tokens[:s.prompt_len].numpy().tobytes(), s)
    held = list(firsts.values())[:args.max_held_out]
    report.held_out_sequences = len(held)
    return trainset, held, report


def run_distill(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: the CLI parser imports this module

    from edgespec.distill.data import load_data
    from edgespec.distill.kinds import drafter_kind
    from edgespec.distill.train import TrainOptions, init_distributed, local_rank, train
    from edgespec.loading.checkpoint import load_target
    from edgespec.loading.tokenizer import ChatTokenizer
    from edgespec.plan import resolve_device

    if args.pack < 1:
        raise ConfigError(f"--pack {args.pack}: sequences per forward must be 1 or more")
    if args.time_budget is not None and args.time_budget <= 0:
        raise ConfigError(f"--time-budget {args.time_budget}: minutes of training must be more than 0")
    device = resolve_device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    rank, world = init_distributed(device)
    if args.model == "demo":
        from edgespec.convert.gguf import ensure_demo_model
        model_dir = ensure_demo_model()
    else:
        model_dir = Path(args.model).expanduser()
    out = Path(args.out).expanduser()
    data_dir = Path(args.data).expanduser() if args.data else out / "data"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.target_dtype, torch.float32 if device.type == "cpu" else torch.bfloat16)
    # Unmerged checkpoint layout: the batched generator reads q/k/v and gate/up separately.
    target = load_target(model_dir, dtype=dtype, device=device, merge=False)
    tokenizer = ChatTokenizer.from_folder(model_dir)
    kind = drafter_kind(args.drafter_kind)
    drafter = kind.load(args.init, target) if args.init else kind.new(args, target, args.seed)
    taps = drafter.cfg.target_layer_ids
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    t0 = time.time()
    labelled = _write_data(args, data_dir, target, tokenizer, model_dir, taps, rank, world, say)
    group_of, held_file = _held_out_inputs(args, out, target, tokenizer, model_dir, taps, rank, world, labelled)
    t_data = time.time() - t0
    if args.data_only:
        say(f"data ready in {data_dir} ({t_data:.0f}s)")
        return 0
    meta, seqs = load_data(data_dir)
    if list(meta["taps"]) != list(taps):
        raise ConfigError(f"data {data_dir} was captured at target layers {meta['taps']}, the drafter taps {taps}")
    seqs = [s for s in seqs if s.tokens.shape[0] - s.prompt_len >= 2]
    trainset, held, report = _split(seqs, args, group_of, held_file)
    say(f"train: {len(trainset)} sequences ({sum(s.tokens.shape[0] - s.prompt_len for s in trainset)} tokens), "
        f"held out: {len(held)}; drafter {drafter.cfg.num_hidden_layers} layer(s), taps {taps}, "
        f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M parameters; world {world} on {device}")
    drafter = drafter.to(device=device, dtype=torch.float32)
    max_pos = max(s.tokens.shape[0] for s in seqs) + drafter.cfg.block_size + 1
    objective = kind.objective(drafter, target.model.embed_tokens.weight, target.lm_head_weight, max_pos,
                               args.window, args.gamma).to(device)
    target_cfg = target.config
    del target
    opts = TrainOptions(steps=args.steps, batch=args.batch, anchors=args.anchors, lr=args.lr, warmup=args.warmup,
                        gamma=args.gamma, window=args.window, eval_every=args.eval_every,
                        save_every=args.save_every, seed=args.seed, vocab_sample=args.vocab_sample,
                        time_budget_s=None if args.time_budget is None else args.time_budget * 60.0,
                        pack=args.pack, eval_epoch=args.eval_each_epoch, keep_best=args.keep_best)
    info = {"kind": kind.name, "target": str(model_dir), "data": str(data_dir), "from_log": args.from_log,
            "init": args.init,
            "options": vars(opts), "world": world, "data_seconds": round(t_data, 1)}
    t1 = time.time()
    res = train(objective, trainset, held, opts, out, kind.published_config(drafter.cfg, target_cfg), device, info)
    res["train_seconds"] = round(time.time() - t1, 1)
    report.held_out_al, report.held_out_al_start = res["held_out_al"], res["held_out_al_start"]
    if rank == 0:
        report.write(out)
    say(report.line())
    res["held_out"] = asdict(report)
    say(json.dumps(res))
    if world > 1:
        torch.distributed.destroy_process_group()
    return 0

