"""What a tree verify costs on a GPU against a chain verify of the same model: eager forwards of random weights.

Random weights accept nothing, so this times cost only: an eager chain forward of R rows (GDN deferred, the chain
verify's mode) against an eager tree forward of the same rows (a tree of B = R - 1 nodes, DDTree-like: a main
branch with side branches), and the commit of a path of the tree. Both eager (no CUDA graph): the ratio shows what
the tree path adds per forward (the ancestor-masked attention, the GDN tree reference) before any graph capture.

    python tools/tree_cost.py --shape qwen3.5-4b --rows 17,33,64 --context 2048
"""

from __future__ import annotations

import argparse

import torch

from edgespec.bench.gpu import random_model
from edgespec.cache.state import StateMode
from edgespec.kernels.tree import TreeMask


def side_branch_parents(rows: int) -> list[int]:
    """Row parents of a main branch of ``rows // 2`` rows with one-node side branches hanging off it (pre-order)."""
    parents = [-1]
    spine = [0]
    while len(parents) < rows:
        parents.append(spine[-1])                      # a side leaf of the current spine node
        if len(parents) < rows:
            parents.append(spine[-1])                  # the next spine node (after its sibling in pre-order)
            spine.append(len(parents) - 1)
    return parents


def _time(fn, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` CUDA-event timed calls (after two warm-ups)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-4b")
    ap.add_argument("--rows", default="17,33,64")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows_list = [int(r) for r in args.rows.split(",")]
    model = random_model(args.shape, dev, torch.bfloat16, args.context + 128)
    cache = model.new_cache(args.context + 128, defer_rows=max(rows_list))
    prompt = torch.randint(0, 1000, (args.context,), device=dev)
    print(f"shape={args.shape} context={args.context} device={torch.cuda.get_device_name()} (eager, bf16)")
    print(f"{'rows':>5} {'chain ms':>9} {'tree ms':>8} {'tree/chain':>10} {'commit ms':>9}")
    for R in rows_list:
        cache.reset()
        model.prefill(prompt, cache)
        t_chain, t_tree, t_commit = measure(model, cache, args.context, R, args.iters)
        print(f"{R:>5} {t_chain:>9.2f} {t_tree:>8.2f} {t_tree / t_chain:>10.2f} {t_commit:>9.3f}", flush=True)


def measure(model, cache, context: int, R: int, iters: int) -> tuple[float, float, float]:
    """Median ms of an eager chain forward of R rows, of a tree forward of R rows, and of a main-branch commit."""
    dev = model.device
    tokens = torch.randint(0, 1000, (R,), device=dev)
    tree = TreeMask.from_parents(torch.tensor(side_branch_parents(R)), dev)
    path = [0] + list(range(2, R, 2))        # down the main branch

    def at_context() -> None:
        cache.reset()
        cache.length = context               # the prefilled KV rows stay; GDN states restart at zero (same cost)

    def chain() -> None:
        at_context()
        model.forward(tokens, cache, mode=StateMode.DEFER, chunked=False)
        cache.rollback(context + 1)

    def tree_fwd() -> None:
        at_context()
        model.forward(tokens, cache, tree=tree, chunked=False)
        cache.commit_path([0])

    commits = []
    for _ in range(iters):
        at_context()
        model.forward(tokens, cache, tree=tree, chunked=False, logits="none")
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        cache.commit_path(path)
        b.record()
        b.synchronize()
        commits.append(a.elapsed_time(b))
    return _time(chain, iters), _time(tree_fwd, iters), sorted(commits)[len(commits) // 2]


if __name__ == "__main__":
    main()
