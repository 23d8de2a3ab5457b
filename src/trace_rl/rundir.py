"""The run folder: the one place that knows its layout.

    RUN_DIR/
      config.yaml              the full config the run was started with
      metrics.jsonl            one JSON object per step (`step` first), appended as the run goes
      trees/step_XXXX.jsonl    every tree a step sampled (`trace_rl.tree.write_jsonl`)
      checkpoints/step_XXXX.pt the last two checkpoints; `checkpoints/latest` names the newest
      report.html, *.png       written by `trace-rl report`

A comparison (`trace-rl compare`) is a folder of run folders, `DIR/<method>/seed_<k>/`, plus
`DIR/react/seed_<k>/` (`START`): the starting policy's evaluation, one record at step 0.

The trainer writes it, `compare`, `eval`, `report` and the CLI read it, all through `RunDir`.
Writes that replace a file are atomic (a temporary file, fsynced, then renamed), so a run killed at
any moment leaves either the old file or the new one.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from trace_rl.tree import RolloutTree, write_jsonl

_STEP_FILE = re.compile(r"step_(\d+)\.jsonl$")

START = "react"
"""A comparison's folder (and table row) of its starting policy, evaluated without RL (the paper's ReAct row)."""


class RunDir:
    """A run folder at `path` (not created until something is written)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def trees_dir(self) -> Path:
        return self.path / "trees"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    # ------------------------------------------------------------ config

    def write_config(self, config: Any) -> None:
        from trace_rl.config import dump_yaml

        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write(self.config_path, lambda tmp: dump_yaml(config, tmp))

    # ------------------------------------------------------------ metrics

    def append_metrics(self, record: dict[str, Any]) -> None:
        """Add one step's record to `metrics.jsonl`, flushed and fsynced."""
        if "step" not in record:
            raise ValueError("a metrics record needs a 'step'")
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def metrics(self) -> list[dict[str, Any]]:
        """The run's records, one per step, in step order (`latest_per_step` of the file); [] if none."""
        return latest_per_step(read_metrics(self.metrics_path)) if self.metrics_path.is_file() else []

    def last_metrics(self) -> dict[str, Any]:
        """Every key's latest value over the run (an evaluation figure may sit on an earlier step)."""
        merged: dict[str, Any] = {}
        for record in self.metrics():
            merged.update(record)
        return merged

    def finished_steps(self) -> int:
        """The last step with a record (0 for none)."""
        records = self.metrics()
        return int(records[-1]["step"]) if records else 0

    def truncate_metrics(self, step: int) -> None:
        """Keep the records of steps up to `step` (resuming from a checkpoint there drops the rest,
        and a line the kill cut short)."""
        if self.metrics_path.is_file():
            kept = [m for m in self.metrics() if m["step"] <= step]
            atomic_write(self.metrics_path, lambda tmp: Path(tmp).write_text("".join(json.dumps(m) + "\n" for m in kept)))

    # ------------------------------------------------------------ trees

    def trees_path(self, step: int) -> Path:
        return self.trees_dir / f"step_{step:04d}.jsonl"

    def write_trees(self, trees: Iterable[RolloutTree], step: int) -> None:
        self.trees_dir.mkdir(parents=True, exist_ok=True)
        write_jsonl(trees, self.trees_path(step))

    def tree_files(self) -> dict[int, Path]:
        """`trees/step_XXXX.jsonl` files by step, ascending."""
        files = {}
        if self.trees_dir.is_dir():
            for path in self.trees_dir.iterdir():
                match = _STEP_FILE.search(path.name)
                if match and path.is_file():
                    files[int(match.group(1))] = path
        return dict(sorted(files.items()))

    # ------------------------------------------------------------ checkpoints

    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints_dir / f"step_{step:04d}.pt"

    def save_checkpoint(self, state: dict[str, Any], step: int, *, keep: int = 2) -> Path:
        """Write `checkpoints/step_XXXX.pt` atomically, point `latest` at it, keep the last `keep`."""
        import torch

        self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        path = self.checkpoint_path(step)
        atomic_write(path, lambda tmp: torch.save(state, tmp))
        atomic_write(self.checkpoints_dir / "latest", lambda tmp: Path(tmp).write_text(path.name))
        for old in sorted(self.checkpoints_dir.glob("step_*.pt"))[:-keep]:
            old.unlink()
        return path

    def latest_checkpoint(self) -> Path:
        """The checkpoint file `checkpoints/latest` names; FileNotFoundError, naming it, if there is none."""
        pointer = self.checkpoints_dir / "latest"
        if not pointer.exists():
            raise FileNotFoundError(f"{self.path} has no checkpoint ({pointer} is missing)")
        return self.checkpoints_dir / pointer.read_text().strip()

    def load_checkpoint(self) -> dict[str, Any]:
        import torch

        return torch.load(self.latest_checkpoint(), weights_only=False)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a `metrics.jsonl`, in file order.

    A last line cut short (a run killed mid-write) is dropped; any other line that is not a JSON
    object with a `step` raises ValueError naming the file and line.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not JSON: {exc}") from exc
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}:{number}: expected a JSON object with a 'step' key")
        records.append(record)
    return records


def latest_per_step(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step, in step order. Where the file goes back to an earlier step (a run started
    again, or resumed, over old lines), the later lines replace that step and everything after it;
    consecutive lines of one step (a separate evaluation line) merge, later keys winning.

    [1, 2, 3, 2', 3'] -> [1, 2', 3'];  [1, 2, 2e] -> [1, 2 + 2e].
    """
    kept: list[dict[str, Any]] = []
    for record in records:
        step = record["step"]
        if kept and step < kept[-1]["step"]:
            while kept and kept[-1]["step"] >= step:
                kept.pop()
        if kept and kept[-1]["step"] == step:
            kept[-1] = {**kept[-1], **record}
        else:
            kept.append(dict(record))
    return kept


def atomic_write(path: Path, write: Callable[[str], Any]) -> None:
    """`write(tmp)` a temporary file beside `path`, fsync it, then rename it over `path`."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(str(tmp))
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
