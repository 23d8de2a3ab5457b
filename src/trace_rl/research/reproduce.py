"""Rerunning a run with its own code: `code_at` (the source tree of a git commit, in a temporary
folder) and `train_with` (`trace-rl train` under a given source tree, in a fresh process, into a
temporary folder). `scripts/results.py reproduce` checks a committed run's first steps with them;
`benchmarks/step_vs_commit.py` times an older commit beside today's."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trace_rl.storage.rundir import read_metrics


@contextmanager
def code_at(commit: str, paths: Sequence[str] = ("src",), *, repo: str | Path | None = None) -> Iterator[Path]:
    """A temporary folder holding `paths` of the git repository `repo` (default: the one this package
    lives in) as they were at `commit` (`git archive`), removed on exit: to run a run folder's own
    code (`code.json`) or time an older commit beside today's. Put `<folder>/src` on PYTHONPATH."""
    root = Path(repo) if repo is not None else Path(__file__).resolve().parents[3]
    archive = subprocess.run(["git", "-C", str(root), "archive", commit, *paths], capture_output=True, check=False)
    if archive.returncode:
        raise ValueError(f"git cannot show {list(paths)} at {commit!r} in {root}: {archive.stderr.decode(errors='replace').strip()}")
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
        yield Path(folder)


def train_with(src: str | Path, config: str | Path, overrides: Sequence[str] = ()) -> list[dict[str, Any]]:
    """`trace-rl train` of `config` (with dotted `overrides`) run by the trace_rl package under `src`
    (a `code_at` folder's `src`, or today's) in a fresh process, into a temporary run folder; the
    records of its `metrics.jsonl`. Its progress goes to this process's stderr."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "trace_rl", "train", "--config", str(config), "--out", f"{out}/run", *overrides]
        subprocess.run(command, env={**os.environ, "PYTHONPATH": str(src)}, check=True, stdout=subprocess.DEVNULL)
        return read_metrics(Path(out) / "run" / "metrics.jsonl")
