"""What a tree verify costs on a GPU against a chain verify of the same model: forwards of random weights.

Random weights accept nothing, so this times cost only: a chain forward of ``--chain-rows`` rows (GDN deferred, the
chain verify's mode; 16 = the served K=15 verify), a chain forward of R rows and a tree forward of the same R rows
(a tree of B = R - 1 nodes, DDTree-like: a main branch with one-leaf side branches), and the commit of the main
branch of the tree. ``--graphs``: the forwards are captured as CUDA graphs at the context position and replayed,
keyed by their row count (as a served verify runs); a capture that fails is reported and that forward runs eagerly.
The commit runs eagerly (as the session runs it). ``--format``: the target's linear layers (as ``edgespec bench
--formats`` builds them); ``--sm-limit N``: everything on a green context of N SMs (made current first).

    python tools/tree_cost.py --shape qwen3.5-4b --rows 17,33,64 --context 2048
    python tools/tree_cost.py --shape qwen3.5-27b --format int4 --lm-head int4 --rows 33,64 --graphs \
        --sm-limit 16 --json t16.json

``--json`` writes the figures for ``tools/thor_projection.py --tree-cost``.

``--runtime``: the cycle as the runtime runs it, instead of the forwards above. The arch hooks prepare a tree session's
captured forwards (``ArchHooks.prepare`` with a ``TreeVerify`` rollback and graphs on): the 16-row chain verify with
its in-graph greedy verdict and the deferred commit graph, and the static tree verifies of ``edgespec.arch.tree_graphs``
(forward + device greedy verdict, then the commit graph: K/V moves and GDN/conv advance along the path, no host sync
between them). A chain cycle is ``hooks.verify`` + ``StrictGreedy.accept`` + ``rollback``; a tree cycle is
``StaticTreeForward.verify`` + ``commit_greedy`` + ``kept``, each timed on the host clock from a synchronised start to
the end of the commit (median), plus each captured graph replayed alone (CUDA events, median). The trees are a main
branch as deep as the chain (``--chain-rows`` - 1 drafts: a session's trees are no deeper than its drafts per cycle)
with the other nodes as side leaves. ``--rows`` are then budgets + 1 of the captured set (17, 33, 64)::

    python tools/tree_cost.py --shape qwen3.5-27b --format int4 --lm-head int4 --rows 33,64 --runtime --json rt.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.arch.detect import select_hooks  # noqa: E402
from edgespec.bench.formats import FORMATS, format_model  # noqa: E402
from edgespec.bench.gpu import random_model, sm_clock_mhz, weight_bytes_per_token  # noqa: E402
from edgespec.bench.shapes import SHAPES, config_dict  # noqa: E402
from edgespec.bench.sm_limit import limit_sms  # noqa: E402
from edgespec.cache.state import StateMode  # noqa: E402
from edgespec.config import load_settings  # noqa: E402
from edgespec.kernels import sm_count  # noqa: E402
from edgespec.kernels.verify.tree import TreeMask  # noqa: E402
from edgespec.plan import install_kernel_options  # noqa: E402
from edgespec.weights.requantize import quantize_lm_head  # noqa: E402


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


def spine_parents(rows: int, depth: int) -> list[int]:
    """Row parents (pre-order) of a main branch of ``depth`` nodes with the other ``rows - 1 - depth`` nodes as leaves
    spread evenly over its levels: a DDTree-like tree no deeper than a chain of ``depth`` drafts (the runtime commits
    paths of at most the drafts per cycle + 1 rows)."""
    depth = min(depth, rows - 1)
    leaves = rows - 1 - depth
    parents, spine = [-1], 0
    for level in range(depth):
        share = leaves // depth + (level < leaves % depth)
        parents += [spine] * share                     # side leaves of this spine node
        parents.append(spine)                          # the next spine node, after its siblings in pre-order
        spine = len(parents) - 1
    return parents


def _time(fn: Callable[[], None], iters: int) -> float:
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


class Bench:
    """One model and cache at ``context`` prefilled rows; each forward is timed from that position."""

    def __init__(self, model, context: int, rows: list[int], graphs: bool) -> None:
        self.model, self.context, self.graphs = model, context, graphs
        dev = model.device
        self.cache = model.new_cache(context + max(rows) + 8, defer_rows=max(rows))
        model.prefill(torch.randint(0, 1000, (context,), device=dev), self.cache)
        self.notes: list[str] = []

    def at_context(self) -> None:
        self.cache.reset()
        self.cache.length = self.context   # the prefilled KV rows stay; GDN states restart at zero (same cost)

    def runner(self, name: str, body: Callable[[], None], settle: Callable[[], None]) -> Callable[[], None]:
        """``body`` (a forward at the context position) as a timed callable: a replay of its CUDA graph with
        ``--graphs`` (``settle`` puts the cache's host bookkeeping back after the capture), else eager."""
        def eager() -> None:
            self.at_context()
            body()
            settle()

        if not self.graphs:
            return eager
        try:
            eager()                                   # warm-up: Triton compiles outside the capture
            self.at_context()
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                body()
            settle()
        except Exception as e:                        # noqa: BLE001 -- reported, the forward then runs eagerly
            self.notes.append(f"{name}: capture failed ({type(e).__name__}: {str(e).splitlines()[0][:120]}), "
                              "timed eagerly")
            torch.cuda.synchronize()
            self.at_context()
            return eager
        return graph.replay

    def chain_ms(self, R: int, iters: int) -> float:
        tokens = torch.randint(0, 1000, (R,), device=self.model.device)
        run = self.runner(f"chain {R}", lambda: self.model.forward(tokens, self.cache, mode=StateMode.DEFER,
                                                                   chunked=False),
                          lambda: self.cache.rollback(self.context + 1))
        return _time(run, iters)

    def tree_ms(self, R: int, iters: int) -> tuple[float, float]:
        """Median ms of a tree forward of R rows and of the commit of its main branch."""
        model, cache, dev = self.model, self.cache, self.model.device
        tokens = torch.randint(0, 1000, (R,), device=dev)
        tree = TreeMask.from_parents(torch.tensor(side_branch_parents(R)), dev)
        for layer in model.model.layers:             # host-built tables first: nothing may sync in a capture
            if layer.kind != "full_attention":
                tree.conv_index(layer.linear_attn.conv1d.kernel_size[0])
        path = [0] + list(range(2, R, 2))            # down the main branch
        run = self.runner(f"tree {R}", lambda: model.forward(tokens, cache, tree=tree, chunked=False),
                          lambda: cache.commit_path([0]))
        t_tree = _time(run, iters)
        commits = []
        for _ in range(iters):
            self.at_context()
            model.forward(tokens, cache, tree=tree, chunked=False, logits="none")
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            cache.commit_path(path)
            b.record()
            b.synchronize()
            commits.append(a.elapsed_time(b))
        return t_tree, sorted(commits)[len(commits) // 2]


def _replay_ms(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    return _time(graph.replay, iters)


def _wall_ms(cycle: Callable[[], None], iters: int) -> float:
    """Median host milliseconds of ``cycle`` from a synchronised start to its end (it ends with a host copy or a
    synchronise), after two warm-ups."""
    times = []
    for i in range(iters + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cycle()
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1000.0)
    return sorted(times)[len(times) // 2]


def runtime_cycles(model, context: int, rows_list: list[int], chain_rows: int, iters: int) -> dict:
    """The chain and tree cycles through the runtime's captured stages (see ``--runtime`` in the module doc)."""
    from edgespec.arch.rollback import TreeVerify
    from edgespec.speculative.acceptance import StrictGreedy

    dev, vocab = model.device, min(1000, model.config.vocab_size)
    hooks = select_hooks("auto", dev)
    rollback = TreeVerify(max(rows_list) - 1)
    cache = hooks.new_cache(model, model.rope.cos.shape[0], False, rollback, max_rows=chain_rows)
    hooks.prepare(model, cache, chain_rows, (), rollback, True, 0)
    missing = [r for r in rows_list if r not in hooks.static_trees]
    if missing:
        raise SystemExit(f"--runtime: rows {missing} are not captured tree sizes ({sorted(hooks.static_trees)})")
    model.prefill(torch.randint(0, vocab, (context,), device=dev), cache, chunk=2048)
    policy = StrictGreedy()
    chain_tokens = torch.randint(0, vocab, (chain_rows,), device=dev)

    def chain_cycle() -> None:
        start = cache.length
        step = hooks.verify(model, cache, chain_tokens, (), rollback)
        verdict = policy.accept(step.logits, chain_tokens[1:], None, step.greedy)
        rollback.rollback(model, cache, start, chain_tokens, verdict.accepted + 1, ())

    chain_cycle_ms = _wall_ms(chain_cycle, iters)
    chain_verify_ms = _replay_ms(hooks.static[chain_rows].graph, iters)
    out = {"chain_base_ms": chain_verify_ms, "chain_cycle_ms": chain_cycle_ms, "trees": []}
    for R in rows_list:
        static = hooks.static_trees[R]
        tokens = torch.randint(0, vocab, (R,), device=dev)
        parents = torch.tensor(spine_parents(R, chain_rows - 1))

        def tree_cycle(static=static, tokens=tokens, parents=parents) -> None:
            static.verify(tokens, parents)
            path, _ = static.commit_greedy()
            static.kept(len(path))

        cycle_ms = _wall_ms(tree_cycle, iters)
        verify_ms = _replay_ms(static.verify_graph, iters)      # replays write only rows past the committed ones
        commit_ms = _replay_ms(static.commit_graph, iters)      # and the path of a random tree is its root alone
        out["trees"].append({
            "rows": R, "budget": R - 1, "tree_ms": verify_ms, "commit_ms": commit_ms, "cycle_ms": cycle_ms,
            "tree_over_chain_base": verify_ms / chain_verify_ms, "cycle_over_chain_cycle": cycle_ms / chain_cycle_ms,
            "commit_share_of_cycle": commit_ms / cycle_ms})
    return out


def print_runtime(res: dict, chain_rows: int) -> None:
    print(f"chain cycle of {chain_rows} rows (verify + accept + deferred commit, captured): "
          f"{res['chain_cycle_ms']:.2f} ms; its verify graph alone {res['chain_base_ms']:.2f} ms")
    print(f"{'rows':>5} {'budget':>6} {'verify ms':>9} {'commit ms':>9} {'cycle ms':>8} {'verify/chain':>12} "
          f"{'cycle/chain':>11} {'commit share':>12}")
    for t in res["trees"]:
        print(f"{t['rows']:>5} {t['budget']:>6} {t['tree_ms']:>9.2f} {t['commit_ms']:>9.3f} {t['cycle_ms']:>8.2f} "
              f"{t['tree_over_chain_base']:>12.2f} {t['cycle_over_chain_cycle']:>11.2f} "
              f"{t['commit_share_of_cycle']:>11.1%}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-4b", choices=sorted(SHAPES))
    ap.add_argument("--format", default="dense", choices=FORMATS, help="the target's linear layers")
    ap.add_argument("--lm-head", default="model", choices=("model", "fp8", "int4", "nvfp4"),
                    help="the target's output projection (lm_head_weights)")
    ap.add_argument("--rows", default="17,33,64", help="tree forward rows (B + 1), each at most 64")
    ap.add_argument("--chain-rows", type=int, default=16, help="rows of the chain verify compared against")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--graphs", action="store_true", help="capture and replay the forwards as CUDA graphs")
    ap.add_argument("--sm-limit", type=int, default=0, help="run on a green context of this many SMs (Thor: 20)")
    ap.add_argument("--json", help="write the figures here (for tools/thor_projection.py --tree-cost)")
    ap.add_argument("--runtime", action="store_true", help="time the runtime's captured chain and tree cycles "
                    "(verify + accept + commit) instead of bare forwards; --rows from the captured set 17,33,64")
    args = ap.parse_args(argv)
    install_kernel_options(load_settings())   # the kernel switches of EDGESPEC_CONFIG / EDGESPEC_* (no engine here)
    rows_list = [int(r) for r in args.rows.split(",") if r]
    if any(not 2 <= r <= 64 for r in rows_list):
        ap.error(f"--rows {args.rows}: each tree forward has 2 to 64 rows")
    dev = torch.device("cuda")
    limit = None
    if args.sm_limit:
        try:
            limit = limit_sms(args.sm_limit, dev)
        except (ValueError, RuntimeError) as e:
            ap.error(str(e))
        print(limit.describe(), flush=True)
    max_len = args.context + max(rows_list + [args.chain_rows]) + 8
    if args.runtime:
        max_len = args.context + 64 + 4 * (args.iters + 2) * (len(rows_list) + 1) + 64   # cycles keep a row each
    if args.format == "dense":
        model = random_model(args.shape, dev, torch.bfloat16, max_len)
    else:
        model = format_model(config_dict(**SHAPES[args.shape]), args.format, dev, torch.bfloat16, max_len)
    quantize_lm_head(model, args.lm_head)
    # The packed products this GPU serves them with (a session's prepare does the same): without it, int4/FP8/NVFP4
    # layers run their torch reference, a whole-matrix dequantize per call.
    fast = select_hooks("auto", dev).choose_weight_kernels(model)
    device = torch.cuda.get_device_name()
    meta = {"shape": args.shape, "format": args.format, "lm_head": args.lm_head, "device": device,
            "sms": sm_count(dev), "sm_clock_mhz": sm_clock_mhz(), "context": args.context,
            "sm_limit": {"requested": limit.requested, "granted": limit.granted} if limit else None,
            "verify_bytes": weight_bytes_per_token(model), "chain_rows": args.chain_rows}
    if args.runtime:
        print(f"shape={args.shape} format={args.format} lm_head={args.lm_head} context={args.context} "
              f"device={device} ({sm_count(dev)} SMs) (runtime cycles, CUDA graphs, {fast} packed weights on fast "
              "kernels)", flush=True)
        res = runtime_cycles(model, args.context, rows_list, args.chain_rows, args.iters)
        print_runtime(res, args.chain_rows)
        if args.json:
            Path(args.json).write_text(json.dumps({**meta, "graphs": True, "runtime": True, **res}, indent=2))
        return 0
    bench = Bench(model, args.context, rows_list + [args.chain_rows], args.graphs)
    mode = "CUDA graphs" if args.graphs else "eager"
    print(f"shape={args.shape} format={args.format} lm_head={args.lm_head} context={args.context} "
          f"device={device} ({sm_count(dev)} SMs) ({mode}, bf16 activations, {fast} packed weights on fast kernels)")
    chain_base = bench.chain_ms(args.chain_rows, args.iters)
    print(f"chain verify of {args.chain_rows} rows: {chain_base:.2f} ms")
    print(f"{'rows':>5} {'chain ms':>9} {'tree ms':>8} {'tree/chain':>10} {f'tree/chain{args.chain_rows}':>13} "
          f"{'commit ms':>9} {'commit share':>12}")
    results = []
    for R in rows_list:
        t_chain = bench.chain_ms(R, args.iters)
        t_tree, t_commit = bench.tree_ms(R, args.iters)
        share = t_commit / (t_tree + t_commit)
        results.append({"rows": R, "budget": R - 1, "chain_ms": t_chain, "tree_ms": t_tree, "commit_ms": t_commit,
                        "tree_over_chain": t_tree / t_chain, "tree_over_chain_base": t_tree / chain_base,
                        "commit_share_of_verify_and_commit": share})
        print(f"{R:>5} {t_chain:>9.2f} {t_tree:>8.2f} {t_tree / t_chain:>10.2f} {t_tree / chain_base:>13.2f} "
              f"{t_commit:>9.3f} {share:>11.1%}", flush=True)
    for note in bench.notes:
        print("note:", note)
    if args.json:
        out = {**meta, "graphs": args.graphs, "chain_base_ms": chain_base, "trees": results, "notes": bench.notes}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
