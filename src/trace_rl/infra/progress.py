"""Progress of long work (warm start, training steps) with live metrics, on stderr.

On a terminal: rich progress bars. Elsewhere (a log file, CI, `make demo | tee`): one plain line per
task every `log_every_s` seconds and at its end, with the rate and the time left, so a run that is
not watched live still says how far it is.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

MIN_ELAPSED_S = 1.0
"""A log line states a rate and a time left only once its task has run this long."""


class Bars:
    """A thin wrapper so callers pass plain dicts of metrics."""

    def __init__(self, progress: Progress, *, log: TextIO | None = None, log_every_s: float = 15.0) -> None:
        self.progress = progress
        self.log = log
        self.log_every_s = log_every_s
        self._tasks: dict[TaskID, dict[str, Any]] = {}

    def task(self, name: str, *, total: int, completed: int = 0) -> TaskID:
        task = self.progress.add_task(name, total=total, completed=completed, metrics="")
        self._tasks[task] = {"name": name, "total": total, "start": time.monotonic(), "first": completed, "printed": 0.0}
        return task

    def update(self, task: TaskID, completed: int, metrics: dict[str, Any]) -> None:
        text = "  ".join(f"{k.split('/')[-1] if '/' in k else k}={v:.3g}" for k, v in metrics.items())
        self.progress.update(task, completed=completed, metrics=text)
        if self.log is not None:
            self._log_line(task, completed, text)

    def set_total(self, task: TaskID, total: int) -> None:
        """Change what the task counts to (an evaluation learns its number of rollouts when it starts)."""
        self.progress.update(task, total=total)
        self._tasks[task]["total"] = total

    def note(self, task: TaskID, text: str) -> None:
        """Says what the task is doing now (a step's rollouts, an evaluation's progress) beside its bar,
        so a long phase inside one step is visible; in a log, at most one line every `log_every_s`."""
        self.progress.update(task, metrics=text)
        if self.log is not None:
            self._log_line(task, int(self.progress.tasks[self._index(task)].completed), text)

    def _index(self, task: TaskID) -> int:
        return next(i for i, t in enumerate(self.progress.tasks) if t.id == task)

    def _log_line(self, task: TaskID, completed: int, text: str) -> None:
        state, now = self._tasks[task], time.monotonic()
        done = completed >= state["total"]
        if not done and now - state["printed"] < self.log_every_s:
            return
        state["printed"] = now
        elapsed = now - state["start"]
        # under MIN_ELAPSED_S the rate is mostly timer noise (the first step of a task: 22,600/s, eta 0:00)
        rate = (completed - state["first"]) / elapsed if elapsed >= MIN_ELAPSED_S else 0.0
        left = (state["total"] - completed) / rate if rate > 0 else float("nan")
        eta = "done" if done else ("eta ?" if left != left else f"eta {_clock(left)}")
        speed = f"{rate:.3g}/s" if rate > 0 else "?/s"
        line = f"{state['name']}: {completed}/{state['total']}  {speed}  elapsed {_clock(elapsed)}  {eta}  {text}".rstrip()
        self.log.write(line + "\n")
        self.log.flush()


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else f"{seconds // 60}:{seconds % 60:02d}"


def warm_start_progress(bars: Bars | None, total: int) -> Callable[[int, float], None]:
    """The `progress(step, loss)` callback of a warm start. Its bar appears at the first step trained,
    so a cached warm start shows none, and counts from there, so a resumed one's rate is its own."""
    tasks: list[TaskID] = []

    def on_step(step: int, loss: float) -> None:
        if bars is None:
            return
        if not tasks:
            tasks.append(bars.task("warm start", total=total, completed=step))
        bars.update(tasks[0], step + 1, {"loss": loss})

    return on_step


@contextmanager
def progress_bar(*, log_every_s: float = 15.0, plain: bool = False) -> Iterator[Bars]:
    """Live bars on a terminal, plain lines elsewhere; `plain` forces the lines (a comparison's worker
    processes, which share one terminal)."""
    console = Console(file=sys.stderr)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[metrics]}"),
    )
    live = console.is_terminal and not plain
    with Progress(*columns, console=console, disable=not live) as progress:
        yield Bars(progress, log=None if live else sys.stderr, log_every_s=log_every_s)
