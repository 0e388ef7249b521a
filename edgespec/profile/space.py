"""The search space of ``edgespec profile``: the tuned knobs, their candidate values, and the groups searched.

A *candidate* is one value for every knob in :data:`TUNED_KNOBS` (a plain dict, so it serialises as-is into the
results file and applies with ``Settings.with_overrides``). The search varies one *group* of related knobs at a
time (coordinate descent, see :mod:`edgespec.profile.search`); each group knows which values make sense given
the current best candidate (K only with a drafter, window only for DFlash, ...) and says why when it has nothing
to try, so the report can explain every skipped group.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import TYPE_CHECKING, Any

from edgespec.config import Settings, choices
from edgespec.errors import ConfigError

if TYPE_CHECKING:  # the CLI parser imports this module; keep torch out of `edgespec --help`
    from edgespec.arch.base import ArchDefaults

# Every setting the profiler may change, in the order they appear in labels and reports.
TUNED_KNOBS: tuple[str, ...] = (
    "drafter", "num_draft_tokens", "window_size", "window_seed", "lookup_min_match", "acceptance", "relaxed_top_k",
    "relaxed_delta", "relaxed_margin", "kv_dtype", "rollback", "cuda_graphs", "prefill_chunk", "draft_tree",
)

# Short names used in candidate labels (report tables, chart axis, progress bar).
SHORT = {
    "drafter": "drafter", "num_draft_tokens": "K", "window_size": "W", "window_seed": "seed",
    "lookup_min_match": "lookup",
    "acceptance": "accept", "relaxed_top_k": "topk", "relaxed_delta": "delta", "relaxed_margin": "margin",
    "kv_dtype": "kv", "rollback": "rollback", "cuda_graphs": "graphs", "prefill_chunk": "chunk",
    "draft_tree": "tree",
}

Candidate = dict[str, Any]

# Default candidate values. Small on purpose: each value costs (prompts x repeats) generations on the device.
DRAFTERS: tuple[str, ...] = ("none", "ngram", "dflash", "mtp")
K_VALUES: dict[str, tuple[int, ...]] = {
    "ngram": (2, 3, 4, 6, 8),
    "mtp": (1, 2, 3, 4),
    "dflash": (4, 7, 11, 15),       # DFlash drafts a block of 16 (K <= 15)
}
WINDOW_SIZES: tuple[int, ...] = (64, 128, 256)
WINDOW_SEEDS: tuple[bool, ...] = (True, False)
LOOKUP_MIN_MATCH: tuple[int, ...] = (0, 2, 3, 4)   # n-gram lookup in front of dflash/mtp (0 = off)
RELAXED_TOP_K: tuple[int, ...] = (3, 5)
RELAXED_DELTA: tuple[float, ...] = (1.0, 2.0)
RELAXED_MARGIN: tuple[str, ...] = ("logit",)
KV_DTYPES: tuple[str, ...] = ("model", "fp8")
ROLLBACKS: tuple[str, ...] = tuple(c for c in choices("rollback") if c != "auto")   # the strategies
GRAPHS: tuple[bool, ...] = (False, True)
PREFILL_CHUNKS: tuple[int, ...] = (256, 512, 1024, 2048)
# Draft tree node budgets (draft_tree): each measured end to end, so the winner is the budget whose acceptance
# length per cycle best pays for its verify rows on this device.
TREE_BUDGETS: tuple[str, ...] = ("off", "4", "8", "12", "16", "32")


def candidate_key(c: Mapping[str, Any]) -> str:
    """Stable identity of a candidate (the results file is keyed by it)."""
    return json.dumps({k: c[k] for k in TUNED_KNOBS}, sort_keys=True)


def candidate_label(c: Mapping[str, Any], start: Mapping[str, Any]) -> str:
    """Human label: the knobs that differ from the starting point, e.g. ``drafter=ngram K=6``."""
    diff = [f"{SHORT[k]}={_fmt(c[k])}" for k in TUNED_KNOBS if c[k] != start[k]]
    return " ".join(diff) if diff else "start"


def describe(c: Mapping[str, Any]) -> str:
    """Every knob that matters for this candidate, e.g. ``drafter=ngram K=auto kv=model rollback=checkpoint``."""
    keys = ["drafter"]
    if c["drafter"] != "none":
        keys.append("num_draft_tokens")
    if c["drafter"] == "dflash":
        keys += ["window_size", "window_seed"]
    if c["drafter"] in ("dflash", "mtp"):
        keys.append("lookup_min_match")
    if c["acceptance"] != "strict":
        keys += ["acceptance", "relaxed_top_k", "relaxed_delta", "relaxed_margin"]
    keys += ["kv_dtype", "rollback", "cuda_graphs", "prefill_chunk"]
    if c["drafter"] != "none" and _tree_on(c):
        keys.append("draft_tree")
    return " ".join(f"{SHORT[k]}={_fmt(c[k])}" for k in keys)


def _fmt(v: Any) -> str:
    if v is None:
        return "auto"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def is_lossy(c: Mapping[str, Any]) -> bool:
    """True for the opt-in relaxations whose greedy output may differ from plain decoding."""
    return c["acceptance"] != "strict"


def start_candidate(base: Settings, defaults: ArchDefaults) -> Candidate:
    """The starting point: the base settings with every ``auto`` resolved to the arch default.

    Resolving makes the tuned YAML explicit about what was measured (``kv_dtype: fp8``, not ``auto``), and makes
    ``auto`` and its resolved value one candidate instead of two.
    """
    c = {k: getattr(base, k) for k in TUNED_KNOBS}
    if c["kv_dtype"] == "auto":
        c["kv_dtype"] = "fp8" if defaults.kv_fp8 else "model"
    if c["rollback"] == "auto":
        c["rollback"] = defaults.rollback
    if c["window_size"] is None:
        c["window_size"] = defaults.window_size
    if c["window_seed"] is None:
        c["window_seed"] = defaults.window_seed
    if c["prefill_chunk"] is None:
        c["prefill_chunk"] = defaults.prefill_chunk
    if c["cuda_graphs"] is None:
        c["cuda_graphs"] = defaults.cuda_graphs
    if str(c["draft_tree"]).strip().lower() == "auto":
        c["draft_tree"] = str(defaults.tree_budget)
    return c


@dataclass(frozen=True)
class SpaceContext:
    """What the groups need to know about the device, the model, the prompts and the user's choices."""

    device_type: str                                  # "cuda" or "cpu"
    allow_lossy: bool
    has_state: bool                                   # recurrent (GDN) state: rollback strategies differ
    thinking_prompts: bool                            # any prompt renders with thinking on
    longest_prompt: int                               # tokens
    values: Mapping[str, Sequence[Any]] = field(default_factory=dict)   # --values overrides per knob
    resolved_k: int | None = None                     # K the current best actually ran with
    # MoE target: K values best first, predicted from AL x measured verify cost (edgespec.profile.k_choice)
    k_predicted: tuple[int, ...] | None = None


@dataclass
class GroupPlan:
    """Candidates of one group, the current best first; ``note`` says why the group was skipped or narrowed."""

    candidates: list[Candidate]
    note: str | None = None


@dataclass(frozen=True)
class Group:
    """A set of related knobs varied together; ``metric`` is what picks its winner."""

    name: str
    help: str
    knobs: tuple[str, ...]
    planner: Callable[[Candidate, SpaceContext], GroupPlan]
    metric: str = "objective"                         # "objective" (higher wins) or "ttft" (lower wins)

    def plan(self, current: Candidate, ctx: SpaceContext) -> GroupPlan:
        return self.planner(current, ctx)


def _vals(ctx: SpaceContext, knob: str, default: Sequence[Any]) -> list[Any]:
    return list(ctx.values.get(knob, default))


def _variants(current: Candidate, changes: list[dict[str, Any]]) -> list[Candidate]:
    """``current`` followed by each change applied to it, without duplicates."""
    out, seen = [current], {candidate_key(current)}
    for ch in changes:
        c = {**current, **ch}
        key = candidate_key(c)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _plan_drafter(cur: Candidate, ctx: SpaceContext) -> GroupPlan:
    # A new drafter starts from its own default K (K=8 for n-gram may be out of range for MTP); the K group
    # tunes it next.
    return GroupPlan(_variants(cur, [{"drafter": d, "num_draft_tokens": None}
                                     for d in _vals(ctx, "drafter", DRAFTERS) if d != cur["drafter"]]))


def _plan_k(cur: Candidate, ctx: SpaceContext) -> GroupPlan:
    if cur["drafter"] == "none":
        return GroupPlan([cur], "no drafter: K does not apply")
    values = _vals(ctx, "num_draft_tokens", K_VALUES.get(cur["drafter"], (2, 4, 8)))
    note = None
    if ctx.k_predicted:
        # MoE target: measure only the two best predicted K (the union a verify reads grows with K)
        values, note = list(ctx.k_predicted[:2]), "MoE target: K from AL x measured verify cost (see notes)"
    # Skip the value the current best already ran with (K=None resolves to the drafter default).
    values = [k for k in values if k != ctx.resolved_k]
    return GroupPlan(_variants(cur, [{"num_draft_tokens": k} for k in values]), note)


def _plan_window(cur: Candidate, ctx: SpaceContext) -> GroupPlan:
    if cur["drafter"] != "dflash":
        return GroupPlan([cur], "window size and seeding apply to the dflash drafter only")
    sizes = _vals(ctx, "window_size", WINDOW_SIZES)
    seeds = _vals(ctx, "window_seed", WINDOW_SEEDS)
    return GroupPlan(_variants(cur, [{"window_size": w, "window_seed": s} for w, s in product(sizes, seeds)]))


def _plan_lookup(cur: Candidate, ctx: SpaceContext) -> GroupPlan:
    if cur["drafter"] not in ("dflash", "mtp"):
        return GroupPlan([cur], "the n-gram lookup goes in front of a model drafter (dflash, mtp) only")
    return GroupPlan(_variants(cur, [{"lookup_min_match": v} for v in _vals(ctx, "lookup_min_match",
                                                                            LOOKUP_MIN_MATCH)]))


def _plan_relaxed(cur: Candidate, ctx: SpaceContext) -> GroupPlan:
    if cur["drafter"] == "none":
        return GroupPlan([cur], "no drafter: acceptance does not apply")
    if not ctx.thinking_prompts:
        return GroupPlan([cur], "no prompt renders with thinking on: relaxed thinking would change nothing")
    if not ctx.allow_lossy:
        return GroupPlan([cur], "relaxed thinking is lossy: pass --allow-lossy to try it")
    changes: list[dict[str, Any]] = [{"acceptance": "strict"}]
    for k, d, m in product(_vals(ctx, "relaxed_top_k", RELAXED_TOP_K), _vals(ctx, "relaxed_delta", RELAXED_DELTA),
                           _vals(ctx, "relaxed_margin", RELAXED_MARGIN)):
        changes.append({"acceptance": "relaxed_thinking", "relaxed_top_k": k, "relaxed_delta": d,
                        "relaxed_margin": m})
    return GroupPlan(_variants(cur, changes))


def _plan_kv(cur: Candidate, ctx: SpaceContext) -> GroupPlan:
    return GroupPlan(_variants(cur, [{"kv_dtype": v} for v in _vals(ctx, "kv_dtype", KV_DTYPES)]))


def _tree_on(c: Mapping[str, Any]) -> bool:
    return str(c["draft_tree"]).strip().lower() not in ("off", "false", "none")


def _plan_tree(cur: Candidate, ctx: SpaceContext) -> GroupPlan:
    if cur["drafter"] == "none":
        return GroupPlan([cur], "no drafter: no draft tree")
    if cur["acceptance"] != "strict":
        return GroupPlan([cur], "draft trees are judged strictly: relaxed acceptance judges chains only")
    # A tree verifies with the deferred rollback (its GDN layers defer); chains keep the rollback they had.
    changes = [{"draft_tree": v, "rollback": "deferred"} if str(v).lower() != "off" else {"draft_tree": v}
               for v in _vals(ctx, "draft_tree", TREE_BUDGETS)]
    return GroupPlan(_variants(cur, changes))


def _plan_rollback(cur: Candidate, ctx: SpaceContext) -> GroupPlan:
    if cur["drafter"] == "none":
        return GroupPlan([cur], "no drafter: plain decoding never rolls back")
    if _tree_on(cur):
        return GroupPlan([cur], "a draft tree verifies with the deferred rollback")
    if not ctx.has_state:
        return GroupPlan([cur], "attention-only model: every strategy truncates the KV cache the same way")
    return GroupPlan(_variants(cur, [{"rollback": v} for v in _vals(ctx, "rollback", ROLLBACKS)]))


def _plan_graphs(cur: Candidate, ctx: SpaceContext) -> GroupPlan:
    if ctx.device_type != "cuda":
        return GroupPlan([cur], "CUDA graphs need a GPU")
    return GroupPlan(_variants(cur, [{"cuda_graphs": v} for v in _vals(ctx, "cuda_graphs", GRAPHS)]))


def _plan_prefill(cur: Candidate, ctx: SpaceContext) -> GroupPlan:
    # Every chunk at least as long as the longest prompt prefills each prompt in one piece: they are the same
    # candidate as far as these prompts can tell, so only the smallest of them is measured.
    longest = ctx.longest_prompt
    seen = {min(cur["prefill_chunk"], longest)}
    picked = []
    for v in sorted(_vals(ctx, "prefill_chunk", PREFILL_CHUNKS)):
        eff = min(v, longest)
        if eff not in seen:
            seen.add(eff)
            picked.append(v)
    if not picked:
        return GroupPlan([cur], f"every prompt ({longest} tokens at most) fits one chunk at each size tried")
    return GroupPlan(_variants(cur, [{"prefill_chunk": v} for v in picked]))


GROUPS: dict[str, Group] = {g.name: g for g in (
    Group("drafter", "draft proposer: none, ngram, dflash, mtp", ("drafter",), _plan_drafter),
    Group("k", "drafts per cycle K (num_draft_tokens)", ("num_draft_tokens",), _plan_k),
    Group("window", "dflash window size and prompt-tail seeding", ("window_size", "window_seed"), _plan_window),
    Group("lookup", "n-gram lookup in front of dflash/mtp (lookup_min_match)", ("lookup_min_match",), _plan_lookup),
    Group("relaxed", "relaxed thinking acceptance (lossy, --allow-lossy) with top-k and margin",
          ("acceptance", "relaxed_top_k", "relaxed_delta", "relaxed_margin"), _plan_relaxed),
    Group("tree", "draft tree node budget (draft_tree: off or nodes per verify), AL against verify cost",
          ("draft_tree", "rollback"), _plan_tree),
    Group("kv", "KV cache format: model dtype or fp8", ("kv_dtype",), _plan_kv),
    Group("rollback", "partial-accept rollback: checkpoint, replay or deferred", ("rollback",), _plan_rollback),
    Group("graphs", "CUDA graphs on/off (GPU only)", ("cuda_graphs",), _plan_graphs),
    Group("prefill", "prefill chunk length (judged on time to first token)", ("prefill_chunk",), _plan_prefill,
          metric="ttft"),
)}


def parse_groups(text: str | None) -> list[str]:
    """``"drafter,k"`` -> the named groups in search order; None or ``all`` -> every group."""
    if text is None or text.strip() in ("", "all"):
        return list(GROUPS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise ConfigError(f"--groups: unknown group(s) {', '.join(map(repr, unknown))}; "
                          f"choose from {', '.join(GROUPS)}")
    # Search order is fixed (drafter before K, ...), whatever order the user typed.
    return [g for g in GROUPS if g in names]


def parse_values(items: Sequence[str] | None) -> dict[str, list[Any]]:
    """``["num_draft_tokens=2,4", "kv_dtype=fp8"]`` -> values per knob, each checked like a settings value."""
    out: dict[str, list[Any]] = {}
    for item in items or ():
        knob, sep, raw = item.partition("=")
        knob = knob.strip().replace("-", "_")
        if not sep or not raw.strip():
            raise ConfigError(f"--values {item!r}: expected KNOB=V1,V2,...")
        if knob not in TUNED_KNOBS or knob == "acceptance":
            choices = ", ".join(k for k in TUNED_KNOBS if k != "acceptance")
            raise ConfigError(f"--values {item!r}: {knob!r} is not a tuned knob; choose from {choices}")
        vals = []
        for part in raw.split(","):
            # Same parsing and range checks as a YAML or environment value of that setting.
            vals.append(getattr(Settings().with_overrides(**{knob: part.strip()}), knob))
            if knob == "draft_tree":
                # torch loads only when a profile runs; off, auto or a budget 1..63, else refused by name.
                from edgespec.drafters.tree import tree_budget
                tree_budget(vals[-1])
        out[knob] = vals
    return out
