"""Does a demo drafter generalize? AL and tok/s on robot requests worded unlike any training template, against
n-gram, on four request streams (the targets: AL >= 2.5 and >= 1.2x n-gram's, faster than n-gram on at least
three of every four requests).

The streams are the session bench's robot requests (``edgespec.bench.robot_stream``: drones, hospital carts,
pipetting arms, greenhouse rovers, humanoids, dish cells, with their own JSON keys), seeds 0..3; no distillation
source trains or selects on them (``tests/distill/test_tasks.py``).

``session`` (default; what the targets are about): each stream is one ``edgespec bench session`` run on the demo
model: plain, ``ngram`` and ``dflash`` (the default path: the n-gram lookup in front of the drafter) serve the same
requests in turn, every answer checked against plain. With several drafters, each gets its own runs (n-gram only
in the first drafter's). ``estimate``: the distillation's held-out estimate (greedy continuations of the same
requests, blocks every 8 positions, no lookup) per drafter: seconds on a GPU, a quick look before the session runs.

  python tools/demo_drafter_eval.py --drafter NEW_DRAFTER --drafter edgespec/data/drafters/smollm2-135m-dflash
  python3 tools/demo_drafter_eval.py estimate --model TARGET_FOLDER --device cuda --drafter A --drafter B
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SHIPPED = "edgespec/data/drafters/smollm2-135m-dflash"
AL_TARGET, RATIO_TARGET, FASTER_SHARE = 2.5, 1.2, 3     # faster on 3 of every 4 requests


def _session(model: str, drafter: str, seed: int, args: argparse.Namespace, with_ngram: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "session.json"
        cmd = [sys.executable, "-m", "edgespec.cli", "bench", "session", "--model", model, "--drafter-path", drafter,
               "--session-drafters", "ngram,dflash" if with_ngram else "dflash", "--session-seed", str(seed),
               "--session-requests", str(args.requests), "--session-first", "0", "--tokens", str(args.tokens),
               "--device", args.device, "--out", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"bench session failed ({' '.join(cmd)}):\n{r.stderr[-2000:]}")
        figures = json.loads(out.read_text())["session"]
        return {name: dict(col, requests=[row[name] for row in figures["rows"]])
                for name, col in figures["steady"].items()}


def run_sessions(args: argparse.Namespace) -> dict:
    """Every stream through plain, n-gram and each drafter; prints a row per stream and the verdict."""
    table: dict[str, list[dict]] = {"ngram": []}
    for d in args.drafter:
        table[d] = []
    for seed in range(args.streams):
        for i, d in enumerate(args.drafter):
            steady = _session(args.model, d, seed, args, with_ngram=i == 0)
            if i == 0:
                table["ngram"].append(steady["ngram"])
            table[d].append(steady["dflash"])
        cells = [f"n-gram AL {table['ngram'][-1]['al']:.2f} {table['ngram'][-1]['tok_s']:.1f} tok/s"]
        cells += [f"{Path(d).name} AL {table[d][-1]['al']:.2f} {table[d][-1]['tok_s']:.1f} tok/s "
                  f"same {table[d][-1]['same_as_plain']}" for d in args.drafter]
        print(f"stream {seed} ({args.requests} requests): " + "; ".join(cells), flush=True)
    verdicts = {d: _verdict(table["ngram"], table[d]) for d in args.drafter}
    for d, v in verdicts.items():
        print(f"{d}: AL {v['al']:.2f} (n-gram {v['ngram_al']:.2f}, {v['al_x_ngram']:.2f}x), faster than n-gram on "
              f"{v['faster_requests']} of {v['requests']} requests and {v['faster_streams']} of {args.streams} "
              f"streams, tok/s {v['tok_s']:.1f} vs n-gram {v['ngram_tok_s']:.1f}; targets: AL >= {AL_TARGET} "
              f"{_yes(v['al'] >= AL_TARGET)}, >= {RATIO_TARGET}x n-gram {_yes(v['al_x_ngram'] >= RATIO_TARGET)}, "
              f"faster on >= 3 of 4 requests {_yes(4 * v['faster_requests'] >= FASTER_SHARE * v['requests'])}")
    return {"streams": table, "verdicts": verdicts}


def _yes(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _verdict(ngram: list[dict], ours: list[dict]) -> dict:
    """AL and tok/s over all streams (each stream's AL weighted alike), and the requests and streams where ours
    decodes faster than n-gram."""
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)       # noqa: E731
    al, ngram_al = mean(ours, "al"), mean(ngram, "al")
    pairs = [(o, n) for so, sn in zip(ours, ngram, strict=True) for o, n in zip(so["requests"], sn["requests"],
                                                                                 strict=True)]
    return {"al": al, "ngram_al": ngram_al, "al_x_ngram": al / ngram_al if ngram_al else float("inf"),
            "tok_s": mean(ours, "tok_s"), "ngram_tok_s": mean(ngram, "tok_s"), "requests": len(pairs),
            "faster_requests": sum(o["tok_s"] > n["tok_s"] for o, n in pairs),
            "faster_streams": sum(o["tok_s"] > n["tok_s"] for o, n in zip(ours, ngram, strict=True))}


def run_estimates(args: argparse.Namespace) -> dict:
    """The held-out estimate of every drafter on the streams' greedy continuations (one data folder)."""
    import torch

    from edgespec.bench.robot_stream import robot_stream
    from edgespec.distill.data import generate_data, load_data, make_recipe
    from edgespec.distill.kinds import drafter_kind
    from edgespec.distill.train import estimate_acceptance
    from edgespec.drafters.dflash_net import parse_dflash_config
    from edgespec.loading.checkpoint import load_target
    from edgespec.loading.hf_config import read_json
    from edgespec.loading.tokenizer import ChatTokenizer
    from edgespec.plan import resolve_device

    if args.model == "demo":
        from edgespec.convert.gguf import ensure_demo_model
        model_dir = ensure_demo_model()
    else:
        model_dir = Path(args.model)
    device = resolve_device(args.device)
    target = load_target(model_dir, dtype=torch.float32, device=device, merge=False)
    tokenizer = ChatTokenizer.from_folder(model_dir)
    prompts = [t for s in range(args.streams) for t in dict.fromkeys(robot_stream(args.requests, seed=s))]
    taps = parse_dflash_config(read_json(Path(args.drafter[0]) / "config.json"),
                               target.config.num_hidden_layers).target_layer_ids
    kind = drafter_kind("dflash")
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        recipe = make_recipe(model_dir, taps, prompts, max_new_tokens=args.tokens, samples_per_prompt=0,
                             temperature=0.0, seed=0, batch=64)
        generate_data(tmp, target, tokenizer, prompts, recipe)
        seqs = [s for s in load_data(tmp)[1] if s.tokens.shape[0] - s.prompt_len >= 2]
        for d in args.drafter:
            drafter = kind.load(d, target).to(device)
            obj = kind.objective(drafter, target.model.embed_tokens.weight, target.lm_head_weight,
                                 max(s.tokens.shape[0] for s in seqs) + 32, None, 7.0).to(device)
            figures[d] = estimate_acceptance(obj, seqs, device=device)
            print(f"{d}: held-out estimate AL {figures[d]:.3f} over {len(seqs)} reworded robot requests", flush=True)
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", choices=("session", "estimate"), default="session")
    p.add_argument("--drafter", action="append", help=f"drafter folder (repeat; default {SHIPPED})")
    p.add_argument("--model", default="demo")
    p.add_argument("--device", default="cpu")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--requests", type=int, default=6, help="requests per stream")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    args.drafter = args.drafter or [SHIPPED]
    figures = run_sessions(args) if args.mode == "session" else run_estimates(args)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
