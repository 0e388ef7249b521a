"""What a verify of R rows costs here, chain or tree: the cost model that sizes each draft tree (``draft_tree: auto``).

Two models, one interface (:class:`CostModel`: :meth:`~CostModel.record` each cycle, :meth:`~CostModel.cycle` to
predict one):

* :class:`MeasuredCost`: verify milliseconds measured per row count, for chain and tree forwards apart
  (:class:`RowCosts`: written by ``edgespec profile`` for one device, weight format and model, or measured by the
  session itself from its captured graphs at start-up, :func:`measure_graph_costs`), times one online scale (the
  recent cycles' measured over predicted verify time: a loaded CPU, a throttled module) plus the recent draft time.
  Graph-backed costs are steps: a tree of R rows replays the smallest captured forward that holds it.
* :class:`LineCost`: no measurements given: a least-squares line ``intercept + per_row * rows`` through the recent
  cycles' verify seconds (chains and trees alike) plus their mean draft time, with the arch's prior
  (``ArchDefaults.tree_row_cost``, one more row as a share of a cycle's fixed cost) until enough cycles of
  different widths were seen; a tree forward's extra cost over a chain of the same rows is a second online ratio.

Both predict a cycle's seconds (the prior alone: units of the fixed cost), which is all the sizing needs
(:func:`edgespec.speculative.tree_size.choose_tree` compares expected tokens per unit of it).
"""

from __future__ import annotations

import bisect
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgespec.errors import ConfigError

ROW_COSTS_VERSION = 1


@dataclass(frozen=True)
class RowCosts:
    """Measured verify milliseconds by row count: ``chain`` and ``tree`` forwards, on the device, weight format and
    model named by ``key``. ``step``: each forward runs at the smallest measured row count that holds it (captured
    graphs); else the cost is interpolated linearly between measured counts (extrapolated from the last two)."""

    chain: Mapping[int, float]
    tree: Mapping[int, float]
    key: Mapping[str, Any] = field(default_factory=dict)
    step: bool = False

    def __post_init__(self) -> None:
        for name in ("chain", "tree"):
            table = getattr(self, name)
            if not table:
                raise ConfigError(f"row costs: no {name} verify measured")
            bad = [(r, ms) for r, ms in table.items() if int(r) < 1 or not float(ms) > 0]
            if bad:
                raise ConfigError(f"row costs: {name} entries need rows >= 1 and milliseconds > 0, got {bad[:3]}")

    def verify_ms(self, rows: int, tree: bool) -> float:
        """Predicted milliseconds of a verify of ``rows`` rows (a tree forward when ``tree``)."""
        table = self.tree if tree else self.chain
        xs = sorted(int(r) for r in table)
        ys = [float(table[r]) for r in xs]
        i = bisect.bisect_left(xs, rows)
        if i < len(xs) and xs[i] == rows:
            return ys[i]
        if self.step:
            return ys[min(i, len(xs) - 1)] * (1.0 if i < len(xs) else rows / xs[-1])
        if len(xs) == 1:
            return ys[0] * rows / xs[0]
        lo = min(max(i - 1, 0), len(xs) - 2)
        slope = (ys[lo + 1] - ys[lo]) / (xs[lo + 1] - xs[lo])
        return max(ys[lo] + slope * (rows - xs[lo]), 1e-6)

    def to_json(self) -> dict[str, Any]:
        return {"version": ROW_COSTS_VERSION, "key": dict(self.key), "step": self.step,
                "chain_ms": {str(r): round(ms, 4) for r, ms in sorted(self.chain.items())},
                "tree_ms": {str(r): round(ms, 4) for r, ms in sorted(self.tree.items())}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "row costs") -> RowCosts:
        if not isinstance(data, Mapping) or data.get("version") != ROW_COSTS_VERSION:
            raise ConfigError(f"{where}: not a row-cost table of version {ROW_COSTS_VERSION} (written by "
                              "edgespec profile)")
        try:
            chain = {int(r): float(ms) for r, ms in data["chain_ms"].items()}
            tree = {int(r): float(ms) for r, ms in data["tree_ms"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"{where}: chain_ms and tree_ms must map rows to milliseconds ({e})") from None
        return cls(chain, tree, dict(data.get("key") or {}), bool(data.get("step", False)))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


def load_row_costs(path: str | Path, expect: Mapping[str, Any]) -> RowCosts:
    """The table in ``path``; refused by name when missing, malformed or measured elsewhere (a ``key`` entry that
    differs from ``expect``'s: another device, weight format or model)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"draft_tree_costs {str(path)!r}: no such file (edgespec profile writes it)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"draft_tree_costs {str(path)!r}: cannot read it as JSON ({e})") from None
    costs = RowCosts.from_json(data, f"draft_tree_costs {str(path)!r}")
    differ = {k: (costs.key[k], v) for k, v in expect.items() if k in costs.key and costs.key[k] != v}
    if differ:
        said = ", ".join(f"{k} {a!r} (here {b!r})" for k, (a, b) in differ.items())
        raise ConfigError(f"draft_tree_costs {str(path)!r} was measured for {said}: profile this device again")
    return costs


def device_label(device) -> str:
    """The device a row-cost table was measured on: the CUDA device's name and SM count (a green context of 16
    SMs is another device than the whole chip), or ``cpu``."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    from edgespec.kernels import sm_count
    return f"{torch.cuda.get_device_name(device)} ({sm_count(device)} SMs)"


class CostModel(ABC):
    """Predicts a cycle's cost from its verify rows and kind, learning from the cycles it is shown."""

    @abstractmethod
    def record(self, rows: int, tree: bool, verify_s: float, draft_s: float) -> None:
        """One cycle: ``rows`` verified (1: a plain decode step), as a tree forward when ``tree``, in ``verify_s``
        seconds (verify, accept and commit) after a draft (and the proposer's commit) of ``draft_s``."""

    @abstractmethod
    def cycle(self, rows: int, tree: bool) -> float:
        """Predicted cost of a cycle verifying ``rows`` rows (draft included), in the model's units."""


class _Decaying:
    """Exponentially weighted sums of the recent cycles (each older cycle's weight decays by ``decay``)."""

    def __init__(self, decay: float) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"cycle cost: decay {decay} must be in (0, 1]")
        self.decay = decay
        self.sums: dict[str, float] = {}

    def add(self, **values: float) -> None:
        for k in self.sums:
            self.sums[k] *= self.decay
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def get(self, name: str) -> float:
        return self.sums.get(name, 0.0)


class LineCost(CostModel):
    """The line fit of the module doc: ``prior`` (one more row as a share of the fixed cost) until ``min_cycles``
    cycles of widths spread by at least two rows were seen."""

    def __init__(self, prior: float, decay: float = 0.97, min_cycles: int = 16) -> None:
        if prior < 0:
            raise ValueError(f"cycle cost: prior {prior} must be >= 0")
        self.prior, self.min_cycles = prior, min_cycles
        self.cycles = 0
        self._s = _Decaying(decay)
        self._tree = _Decaying(decay)            # tree cycles: measured / line-predicted verify

    def record(self, rows: int, tree: bool, verify_s: float, draft_s: float) -> None:
        if tree:
            fit = self.line()
            if fit is not None:
                intercept = fit[0] - self._s.get("d") / self._s.get("w")
                self._tree.add(w=1.0, r=verify_s / max(intercept + fit[1] * rows, 1e-9))
            return                                # the line is fitted on chains (and decode steps) only
        self._s.add(w=1.0, x=rows, y=verify_s, xx=rows * rows, xy=rows * verify_s, d=draft_s)
        self.cycles += 1

    def line(self) -> tuple[float, float] | None:
        """``(fixed, per_row)`` seconds: the draft's mean plus the verify line's intercept, and its slope; None while
        it cannot be trusted (too few cycles, or widths spread by less than two rows)."""
        if self.cycles < self.min_cycles:
            return None
        s = self._s
        w = s.get("w")
        mx, my = s.get("x") / w, s.get("y") / w
        var = s.get("xx") / w - mx * mx
        if var < 4.0:                 # widths spread by less than two rows: the slope is noise
            return None
        per_row = max(0.0, (s.get("xy") / w - mx * my) / var)
        fixed = my - per_row * mx + s.get("d") / w
        if fixed <= 0:                # noise steeper than the data: no fixed part to share
            return None
        return fixed, per_row

    @property
    def row_ratio(self) -> float:
        """What one more verify row costs, as a share of a cycle's fixed cost (a row dearer than the whole fixed
        cost is noise on a loaded machine, not a cost model)."""
        fit = self.line()
        return self.prior if fit is None else min(1.0, fit[1] / fit[0])

    @property
    def tree_ratio(self) -> float:
        """A tree forward's verify over a chain's of the same rows, as measured (1 until a tree was verified)."""
        w = self._tree.get("w")
        return 1.0 if w == 0 else max(1.0, self._tree.get("r") / w)

    def cycle(self, rows: int, tree: bool) -> float:
        fit = self.line()
        if fit is None:
            return 1.0 + self.prior * rows * (self.tree_ratio if tree else 1.0)
        fixed, per_row = fit
        per_row = min(per_row, fixed)
        draft = self._s.get("d") / self._s.get("w")
        return draft + (fixed - draft + per_row * rows) * (self.tree_ratio if tree else 1.0)


class MeasuredCost(CostModel):
    """:class:`RowCosts` times the recent cycles' measured / predicted verify time, plus their draft time."""

    def __init__(self, costs: RowCosts, decay: float = 0.9) -> None:
        self.costs = costs
        self._s = _Decaying(decay)

    def record(self, rows: int, tree: bool, verify_s: float, draft_s: float) -> None:
        if rows <= 1:
            return      # a plain decode step: not a verify forward the table holds
        self._s.add(w=1.0, r=verify_s * 1e3 / self.costs.verify_ms(rows, tree), d=draft_s * 1e3)

    @property
    def scale(self) -> float:
        w = self._s.get("w")
        return 1.0 if w == 0 else min(4.0, max(0.25, self._s.get("r") / w))

    def cycle(self, rows: int, tree: bool) -> float:
        w = self._s.get("w")
        draft = 0.0 if w == 0 else self._s.get("d") / w
        return draft + self.scale * self.costs.verify_ms(rows, tree)


def measure_graph_costs(chain_graphs: Mapping[int, Any], tree_graphs: Mapping[int, Any], iters: int = 3,
                        key: Mapping[str, Any] | None = None) -> RowCosts | None:
    """:class:`RowCosts` (steps) from replaying captured graphs: ``chain_graphs`` rows -> a CUDA graph of a chain
    verify, ``tree_graphs`` rows -> one of a tree verify; the median of ``iters`` replays each (after one). None
    when either set is empty. The replays write cache rows at whatever position the graphs hold: callers reset the
    cache afterwards."""
    import torch

    if not chain_graphs or not tree_graphs:
        return None

    def ms(graph) -> float:
        graph.replay()
        times = []
        for _ in range(iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]

    chain = {rows: ms(g) for rows, g in chain_graphs.items()}
    tree = {rows: ms(g) for rows, g in tree_graphs.items()}
    return RowCosts(chain, tree, dict(key or {}), step=True)
