"""Progress bars with live metrics for long work (rich), quiet when stderr is not a terminal."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class Bars:
    """A thin wrapper so callers pass plain dicts of metrics."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def task(self, name: str, *, total: int, completed: int = 0) -> TaskID:
        return self.progress.add_task(name, total=total, completed=completed, metrics="")

    def update(self, task: TaskID, completed: int, metrics: dict[str, Any]) -> None:
        text = "  ".join(f"{k.split('/')[-1] if '/' in k else k}={v:.3g}" for k, v in metrics.items())
        self.progress.update(task, completed=completed, metrics=text)


@contextmanager
def progress_bar() -> Iterator[Bars]:
    console = Console(file=sys.stderr)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[metrics]}"),
    )
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        yield Bars(progress)
