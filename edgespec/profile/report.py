"""The outputs of ``edgespec profile``: the tuned YAML, a JSON of every measurement, a Markdown report, a PNG chart.

The tuned YAML is :func:`edgespec.config.dump_yaml` of the base settings with the winning knobs applied (only the
values that differ from the defaults), so ``edgespec serve --config tuned.yaml`` loads it directly. Every ``auto``
the search touched is written resolved (``kv_dtype: fp8``, ``num_draft_tokens: 4``): the file states what was
measured, and a later change of an arch default does not silently change a tuned service.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from edgespec.config import Settings, dump_yaml
from edgespec.errors import EdgespecError
from edgespec.profile.measure import PromptCase, first_diff
from edgespec.profile.results import ResultStore
from edgespec.profile.search import CandidateResult, SearchOutcome
from edgespec.profile.space import candidate_key, describe
from edgespec.progress import format_duration

TUNED_YAML = "tuned.yaml"
RESULTS_JSONL = "results.jsonl"
MEASUREMENTS_JSON = "measurements.json"
REPORT_MD = "report.md"
CHART_PNG = "chart.png"


class ChartUnavailable(EdgespecError):
    """The PNG chart cannot be drawn (matplotlib is not installed)."""


# -- tuned settings -----------------------------------------------------------------------------------------------
def tuned_settings(base: Settings, final: CandidateResult) -> Settings:
    """The base settings with the winner's knobs, K pinned to what it ran with, and no secret."""
    values = dict(final.candidate)
    if values["drafter"] != "none" and values["num_draft_tokens"] is None and final.measurements:
        values["num_draft_tokens"] = final.measurements[0]["resolved"]["k"]
    # The API key may come from EDGESPEC_API_KEY; a tuned file gets copied around, a secret must not travel in it.
    return base.with_overrides(**values, api_key=None)


def write_tuned_yaml(path: Path, base: Settings, outcome: SearchOutcome, meta: Mapping[str, Any]) -> Settings:
    final = outcome.final
    assert final is not None
    tuned = tuned_settings(base, final)
    start = _result(outcome, outcome.start)
    lines = [
        f"# Written by `edgespec profile` on {meta['date']} for {meta['model_name']} on {meta['device']} "
        f"(arch {meta['arch']}, {meta['dtype']}).",
        f"# Winner: {describe(final.candidate)}",
        f"#   decode {final.decode_tok_s:.1f} tok/s, acceptance length {final.acceptance_length:.2f}, "
        f"time to first token {final.ttft_ms:.0f} ms"
        + (f" (start: {start.decode_tok_s:.1f} tok/s)" if start is not None and start.status == "ok" else ""),
        f"# Search: {outcome.status}" + (f" ({outcome.stop_note})" if outcome.stop_note else "")
        + f"; see {REPORT_MD}. Serve with: edgespec serve --config {path.name}",
    ]
    if base.api_key:
        lines.append("# api_key is not written here: set EDGESPEC_API_KEY in the service environment.")
    path.write_text("\n".join(lines) + "\n" + dump_yaml(tuned, only_changed=True))
    return tuned


# -- JSON -------------------------------------------------------------------------------------------------------
def write_json(path: Path, outcome: SearchOutcome, store: ResultStore, meta: Mapping[str, Any]) -> None:
    objective = meta["objective"]
    labels = {r.key: r.label for r in outcome.results}
    data = {
        "meta": dict(meta),
        "status": outcome.status,
        "stop_note": outcome.stop_note,
        "start": outcome.start,
        "tuned": outcome.final.candidate if outcome.final else None,
        "tuned_label": outcome.final.label if outcome.final else None,
        "groups": [{"group": s.group, "note": s.note, "tried": [labels.get(k, k) for k in s.tried],
                    "kept": labels.get(s.winner) if s.winner else None} for s in outcome.steps],
        "candidates": [r.summary(objective) for r in outcome.results],
        "measurements": [{k: v for k, v in m.items() if k not in ("key", "context")}
                         for r in outcome.results for m in r.measurements],
        "references": [{k: v for k, v in rec.items() if k not in ("key", "context", "token_ids")}
                       | {"generated_tokens": len(rec["token_ids"])} for rec in store.records("reference")],
        "notes": list(outcome.notes),
    }
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


# -- Markdown ---------------------------------------------------------------------------------------------------
def _result(outcome: SearchOutcome, cand: Mapping[str, Any]) -> CandidateResult | None:
    key = candidate_key(cand)
    return next((r for r in outcome.results if r.key == key), None)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}" if n else "-"


def _pct(new: float, old: float) -> str:
    return f" ({(new / old - 1) * 100:+.0f}%)" if old > 0 else ""


def reference_notes(store: ResultStore, cases: Sequence[PromptCase]) -> list[str]:
    """Where plain greedy output itself depends on the KV format (FP8 vs model dtype)."""
    refs = list(store.records("reference"))
    where = []
    for case in cases:
        by_kv: dict[str, list[int]] = {}
        for r in refs:
            if r["prompt"] == case.id and r["prompt_sha"] == case.sha:
                by_kv.setdefault(r["kv_dtype"], r["token_ids"])
        if "model" in by_kv and "fp8" in by_kv:
            i = first_diff(by_kv["model"], by_kv["fp8"])
            if i is not None:
                where.append(f"`{case.id}` from token {i}")
    if not where:
        return []
    return [f"Plain greedy output with FP8 KV differs from model-dtype KV on {len(where)} prompt(s): "
            f"{', '.join(where)}. FP8 candidates are checked against plain decoding with FP8 KV (speculation "
            "stays lossless); the KV format itself is the trade-off."]


def write_report(path: Path, outcome: SearchOutcome, cases: Sequence[PromptCase], meta: Mapping[str, Any],
                 chart: str | None, extra_notes: Sequence[str] = ()) -> None:
    """``report.md``: status, the tuned result against the start, the search, every candidate and prompt, how it
    was measured, notes."""
    objective = meta["objective"]
    status = {"complete": "complete: every selected group searched",
              "budget": f"stopped by the time budget ({outcome.stop_note})",
              "interrupted": "INTERRUPTED: partial results; run again (same --out) to resume",
              }.get(outcome.status, outcome.status)
    out = [f"# edgespec profile: {meta['model_name']} on {meta['device']}", "",
           f"- Status: {status}",
           f"- Tuned settings: `{TUNED_YAML}`" + (" (serve with `edgespec serve --config " + TUNED_YAML + "`)"
                                                 if meta.get("wrote_yaml") else " (not written)"),
           f"- Objective: {'decode tok/s' if objective == 'decode' else 'end-to-end tok/s (prefill + decode)'}, "
           f"a challenger must win by {meta['min_gain'] * 100:.0f}%", ""]

    out += _result_section(outcome, meta) + _search_section(outcome) + _candidate_sections(outcome)
    if chart:
        out += [f"![decode tok/s and acceptance length per candidate and prompt]({chart})", ""]
    out += _method_section(meta, cases)
    notes = [n for n in (*outcome.notes, *extra_notes) if n]
    if notes:
        out += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    path.write_text("\n".join(out) + "\n")


def _result_section(outcome: SearchOutcome, meta: Mapping[str, Any]) -> list[str]:
    """The tuned candidate against the start (nothing when no candidate was measured everywhere)."""
    final = outcome.final
    if final is None:
        return []
    start = _result(outcome, outcome.start)
    out = ["## Result", "", "| | start | tuned |", "|---|---|---|"]
    s_ok = start is not None and start.status == "ok"

    def row(name: str, fmt: str, attr: str, pct: bool = False) -> None:
        new = getattr(final, attr)
        old = getattr(start, attr) if s_ok else None
        old_txt = format(old, fmt) if old is not None else "-"
        out.append(f"| {name} | {old_txt} | {format(new, fmt)}{_pct(new, old) if pct and old else ''} |")

    out.append(f"| settings | `{describe(outcome.start)}` | `{describe(final.candidate)}` |")
    row("decode tok/s", ".1f", "decode_tok_s", pct=True)
    row("end-to-end tok/s", ".1f", "e2e_tok_s", pct=True)
    row("acceptance length", ".2f", "acceptance_length")
    row("time to first token (ms)", ".0f", "ttft_ms")
    kind = "GPU max allocated" if meta["device_type"] == "cuda" else "process RSS high-water, upper bound"
    out.append(f"| peak memory (MiB, {kind}) | {_mib(start.peak_memory_bytes) if s_ok else '-'} | "
               f"{_mib(final.peak_memory_bytes)} |")
    out.append("")
    return out


def _search_section(outcome: SearchOutcome) -> list[str]:
    """One row per searched group: the values tried and the one kept."""
    out: list[str] = []
    labels = {r.key: r.label for r in outcome.results}
    status_of = {r.key: r.status for r in outcome.results}
    out += ["## Search (one group at a time, best value kept)", "", "| group | tried | kept | note |",
            "|---|---|---|---|"]
    for s in outcome.steps:
        tried = ", ".join(f"`{labels.get(k, k)}`" + ("" if status_of.get(k) == "ok" else f" ({status_of.get(k)})")
                          for k in s.tried)
        kept = f"`{labels[s.winner]}`" if s.winner in labels else "-"
        out.append(f"| {s.group} | {tried} | {kept} | {s.note or ''} |")
    out.append("")
    return out


def _candidate_sections(outcome: SearchOutcome) -> list[str]:
    """Every candidate's pooled figures, then its figures per prompt."""
    final = outcome.final
    out: list[str] = []
    numbered = list(outcome.results)
    out += ["## Candidates", "",
            "| # | candidate | status | decode tok/s | e2e tok/s | AL | TTFT ms | peak MiB | greedy = plain | note |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(numbered, 1):
        win = " **(tuned)**" if final is not None and r.key == final.key else ""
        if r.measurements:
            same = "lossy (opt-in)" if r.lossy else ("yes" if r.same_as_plain else "**no**")
            figs = (f"{r.decode_tok_s:.1f} | {r.e2e_tok_s:.1f} | {r.acceptance_length:.2f} | {r.ttft_ms:.0f} | "
                    f"{_mib(r.peak_memory_bytes)} | {same}")
        else:
            figs = "- | - | - | - | - | -"
        note = (r.note or "").replace("|", "/").replace("\n", " ")
        out.append(f"| {i} | `{r.label}`{win} | {r.status} | {figs} | {note} |")
    out.append("")

    out += ["## Per prompt", "", "| # | candidate | prompt | decode tok/s | AL | TTFT ms | tokens | greedy = plain |",
            "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(numbered, 1):
        for m in r.measurements:
            same = "yes" if m["same_as_plain"] else f"no (from token {m['first_diff']})"
            out.append(f"| {i} | `{r.label}` | {m['prompt']} | {m['decode_tok_s']:.1f} | "
                       f"{m['acceptance_length']:.2f} | {m['ttft_ms']:.0f} | {m['generated_tokens']} | {same} |")
    out.append("")
    return out


def _method_section(meta: Mapping[str, Any], cases: Sequence[PromptCase]) -> list[str]:
    """Model, device, prompts, repeats and what each figure counts."""
    out: list[str] = []
    out += ["## How it was measured", "",
            f"- Model `{meta['model']}`, device {meta['device']} (arch {meta['arch']}), dtype {meta['dtype']}, "
            f"torch {meta['torch']}, torch CPU threads: {meta['threads']}",
            f"- Prompts ({len(cases)}): " + ", ".join(f"`{c.id}`" + (" (thinking)" if c.thinking else "")
                                                     for c in cases),
            f"- Up to {meta['tokens']} new tokens per generation, {meta['warmup']} warm-up + {meta['repeats']} "
            f"timed run(s) per candidate and prompt (medians); greedy",
            "- Decode tok/s counts the tokens after the first over the time after the first (pooled over prompts); "
            "time to first token is the prefill stage; greedy output is compared with plain decoding using the "
            "same KV format",
            f"- Budget {meta['budget']}, this run took {meta['elapsed']}; "
            f"{meta['resumed']} measurement(s) read back from `{RESULTS_JSONL}`", ""]
    return out


# -- PNG chart ----------------------------------------------------------------------------------------------------
def write_chart(path: Path, outcome: SearchOutcome, cases: Sequence[PromptCase]) -> None:
    """Grouped bars: decode tok/s (top) and acceptance length (bottom) per candidate, one bar per prompt."""
    try:
        import matplotlib
    except ImportError:
        raise ChartUnavailable("the PNG chart needs matplotlib, which is not installed: "
                               "pip install 'edgespec[profile]' (or matplotlib), or pass --no-chart") from None
    matplotlib.use("Agg")   # no display on the device or in CI
    import matplotlib.pyplot as plt

    rows = [(i, r) for i, r in enumerate(outcome.results, 1) if r.measurements]
    if not rows:
        raise ChartUnavailable("nothing was measured, so there is no chart")
    n_prompts = len(cases)
    width = 0.8 / max(n_prompts, 1)
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 1.1 * len(rows) + 2), 6.5), sharex=True)
    for j, case in enumerate(cases):
        xs, tok, al = [], [], []
        for x, (_, r) in enumerate(rows):
            m = next((m for m in r.measurements if m["prompt"] == case.id), None)
            if m is not None:
                xs.append(x - 0.4 + width * (j + 0.5))
                tok.append(m["decode_tok_s"])
                al.append(m["acceptance_length"])
        axes[0].bar(xs, tok, width, label=case.id)
        axes[1].bar(xs, al, width, label=case.id)
    axes[0].set_ylabel("decode tok/s")
    axes[1].set_ylabel("acceptance length")
    axes[0].legend(fontsize="small", ncol=min(n_prompts, 3))
    final_key = outcome.final.key if outcome.final else None
    mark = {"disqualified": " (output differs)", "incomplete": " (partial)"}
    ticks = [f"#{i} {r.label}" + (" *" if r.key == final_key else "") + mark.get(r.status, "")
             + (" (lossy)" if r.lossy else "") for i, r in rows]
    axes[1].set_xticks(range(len(rows)))
    axes[1].set_xticklabels(ticks, rotation=30, ha="right", fontsize="small")
    axes[0].set_title("edgespec profile (* = tuned)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


__all__ = ["CHART_PNG", "MEASUREMENTS_JSON", "REPORT_MD", "RESULTS_JSONL", "TUNED_YAML", "ChartUnavailable",
           "format_duration", "reference_notes", "tuned_settings", "write_chart", "write_json", "write_report",
           "write_tuned_yaml"]
