"""How often each kind of draft-tree node is accepted against its joint draft probability (CPU demo or any model).

Runs every prompt with trees of ``--budget`` nodes holding the chain of first choices and every other node of the
best-first expansion (no sizing by cost), and counts per depth, for the chain nodes and for the others: nodes
verified, their summed joint probability (what a calibrated drafter expects to be accepted) and the accepted ones.
A tree pays on a device when its extra nodes are accepted often enough to be worth a verify row each.

    python tools/tree_node_stats.py --prompts docs/measurements/tree_robot_bench.yaml [--budget 32] [--tokens 96]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.bench.prompts import load_prompts  # noqa: E402
from edgespec.config import load_settings  # noqa: E402
from edgespec.drafters.tree import DraftTree  # noqa: E402
from edgespec.engine import Engine  # noqa: E402
from edgespec.plan import build_plan
from edgespec.speculative.acceptance import StrictGreedy  # noqa: E402

DEPTHS = 6     # depths above this one are counted together


class NodeStats:
    """Per (chain or other, depth): nodes verified, summed joint probability, nodes accepted."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], list[float]] = {}
        self.tree: DraftTree | None = None

    def record(self, tree: DraftTree, accepted_rows: list[int]) -> None:
        joint, chain, accepted = tree.joint_probs(), tree.first_path(), set(accepted_rows[1:])
        for i in range(tree.size):
            key = ("chain" if chain[i] else "other", min(int(tree.depths[i]), DEPTHS))
            entry = self.rows.setdefault(key, [0, 0.0, 0])
            entry[0] += 1
            entry[1] += float(joint[i])
            entry[2] += (i + 1) in accepted

    def print(self) -> None:
        print(f"{'nodes':<6} {'depth':>5} {'verified':>8} {'sum joint':>9} {'accepted':>8} {'accepted/joint':>14} "
              f"{'per node':>8}")
        for (kind, depth), (n, joint, acc) in sorted(self.rows.items()):
            label = f"{depth}+" if depth == DEPTHS else str(depth)
            print(f"{kind:<6} {label:>5} {n:>8} {joint:>9.2f} {acc:>8} {acc / max(joint, 1e-9):>14.2f} "
                  f"{acc / n:>8.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True, help="prompt set YAML")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--drafter", default="dflash")
    args = ap.parse_args(argv)
    settings = load_settings(cli=argparse.Namespace()).with_overrides(
        drafter=args.drafter, draft_tree=str(args.budget), lookup_min_match=0)
    engine = Engine.load(build_plan(settings))
    session, stats = engine.session, NodeStats()
    session.cycles.cost = None                # every node of the budget verified
    propose, commit = session.proposer.propose_tree, session.rollback.commit

    def propose_tree(last: int, k: int, budget: int, chain_first: bool = False) -> DraftTree | None:
        stats.tree = propose(last, k, budget, chain_first=True)
        return stats.tree

    def commit_path(cache, rows: list[int]) -> None:
        stats.record(stats.tree, rows)
        commit(cache, rows)

    session.proposer.propose_tree, session.rollback.commit = propose_tree, commit_path
    print(f"model={engine.model_dir.name} drafter={args.drafter} budget={args.budget} (chain first, no sizing)")
    for pr in load_prompts(args.prompts):
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": pr.user}], enable_thinking=pr.thinking)
        res = session.generate(ids, max_tokens=args.tokens, policy=StrictGreedy(),
                               stop_ids=engine.tokenizer.stop_token_ids)
        print(f"{pr.id}: AL {res.telemetry.acceptance_length:.2f}, {res.telemetry.tree_cycles} tree cycles")
    stats.print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
