"""A plain-text progress bar with ETA on stderr (no dependency): redrawn in place on a terminal, one line per
step when stderr is a log file or a pipe (CI), so the log stays readable."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_duration(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``3725`` -> ``1h02m``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class Progress:
    """Counts measurements against an estimated total; the ETA is capped by what is left of the time budget."""

    def __init__(self, total: int, budget_s: float | None, started: float | None = None,
                 stream: TextIO | None = None, width: int = 24) -> None:
        self.total = max(total, 0)
        self.done = 0
        self.budget_s = budget_s
        self.started = time.monotonic() if started is None else started
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._measured = 0        # steps timed in this run (resumed ones cost nothing and would skew the ETA)
        self._measure_s = 0.0
        self._last_len = 0

    def set_total(self, total: int) -> None:
        self.total = max(total, self.done)

    def skip(self, n: int = 1) -> None:
        """Steps already done (read back from the results file)."""
        self.done += n
        self.total = max(self.total, self.done)

    def step(self, label: str, seconds: float) -> None:
        """One measurement finished after ``seconds``."""
        self.done += 1
        self.total = max(self.total, self.done)
        self._measured += 1
        self._measure_s += seconds
        self.show(label)

    def eta(self) -> tuple[float | None, bool]:
        """Seconds left and whether the budget (not the work) bounds it."""
        left_work = None
        if self._measured:
            left_work = (self.total - self.done) * self._measure_s / self._measured
        if self.budget_s is None:
            return left_work, False
        left_budget = max(0.0, self.budget_s - (time.monotonic() - self.started))
        if left_work is None or left_budget < left_work:
            return left_budget, True
        return left_work, False

    def show(self, label: str) -> None:
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        eta, by_budget = self.eta()
        eta_txt = "ETA ?" if eta is None else f"ETA {format_duration(eta)}" + (" (budget)" if by_budget else "")
        elapsed = format_duration(time.monotonic() - self.started)
        line = f"[{bar}] {self.done}/{self.total} {frac:4.0%}  {elapsed} elapsed  {eta_txt}  {label}"
        if self.tty:
            pad = max(0, self._last_len - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._last_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (a skipped candidate, a note) without garbling the bar."""
        if self.tty and self._last_len:
            self.stream.write("\r" + " " * self._last_len + "\r")
            self._last_len = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._last_len:
            self.stream.write("\n")
            self.stream.flush()
            self._last_len = 0
