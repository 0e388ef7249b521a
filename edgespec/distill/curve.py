"""The loss and held-out AL curves of a distillation run, as ``curve.json`` and a plot (``curve.svg``).

The plot is plain SVG written here (no plotting package): two panels over the training step, the per-step loss
(mean over ranks) with its running mean, and the held-out acceptance-length estimates. A browser shows it; it is
rewritten at every checkpoint, so a long run's progress can be watched.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from xml.sax.saxutils import escape

WIDTH, PANEL_H, MARGIN = 720, 220, 56


def running_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (NaNs skipped).

    >>> running_mean([1.0, 3.0, 5.0, 7.0], 2)
    [1.0, 2.0, 4.0, 6.0]
    """
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-window:]
        good = [a for a in acc if not math.isnan(a)]
        out.append(sum(good) / len(good) if good else float("nan"))
    return out


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering ``lo .. hi``."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _panel(top: float, title: str, series: list[tuple[list[tuple[float, float]], str]], x_max: float) -> list[str]:
    """One panel: frame, ticks and a polyline per ``(points, colour)`` series."""
    ys = [y for pts, _ in series for _, y in pts if not math.isnan(y)]
    lo, hi = (min(ys), max(ys)) if ys else (0.0, 1.0)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    left, right, bottom = MARGIN, WIDTH - 16, top + PANEL_H - 28

    def sx(x: float) -> float:
        return left + (right - left) * x / max(x_max, 1e-9)

    def sy(y: float) -> float:
        return bottom - (bottom - top - 20) * (y - lo) / (hi - lo)

    parts = [f'<text x="{left}" y="{top + 12}" font-size="13">{escape(title)}</text>',
             f'<rect x="{left}" y="{top + 20}" width="{right - left}" height="{bottom - top - 20}" fill="none" '
             f'stroke="#888"/>']
    for t in _ticks(lo, hi):
        parts.append(f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" font-size="10" text-anchor="end">{t:.3g}</text>')
    for t in _ticks(0, x_max):
        parts.append(f'<text x="{sx(t):.1f}" y="{bottom + 14}" font-size="10" text-anchor="middle">{t:.0f}</text>')
    for pts, colour in series:
        good = [(x, y) for x, y in pts if not math.isnan(y)]
        if good:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in good)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.4"/>')
            if len(good) < 40:
                parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>' for x, y in good]
    return parts


def curve_svg(curve: Sequence[Sequence[float]], held_out: Sequence[Sequence[float]], title: str = "") -> str:
    """The SVG of a run: ``curve`` rows ``[step, loss, top1]``, ``held_out`` rows ``[step, epoch, AL]``."""
    steps = [r[0] for r in curve]
    losses = [r[1] for r in curve]
    x_max = max([1.0] + steps + [r[0] for r in held_out])
    smooth = running_mean(losses, max(1, len(losses) // 50))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{2 * PANEL_H + 24}" '
             f'font-family="sans-serif">', '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="{MARGIN}" y="16" font-size="14">{escape(title)}</text>']
    raw, mean = list(zip(steps, losses, strict=True)), list(zip(steps, smooth, strict=True))
    parts += _panel(24, "training loss per step (grey) and running mean (blue)", [(raw, "#bbb"), (mean, "#1f5fbf")],
                    x_max)
    parts += _panel(24 + PANEL_H, "held-out acceptance length (bonus included)",
                    [([(r[0], r[2]) for r in held_out], "#c0392b")], x_max)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_curve(folder: Path, curve: Sequence[Sequence[float]], held_out: Sequence[Sequence[float]],
                title: str = "") -> Path:
    """Write ``curve.json`` (every point) and ``curve.svg`` into ``folder``; returns the SVG's path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "curve.json").write_text(json.dumps({"loss": [list(r) for r in curve],
                                                   "held_out_al": [list(r) for r in held_out]}))
    path = folder / "curve.svg"
    path.write_text(curve_svg(curve, held_out, title))
    return path
