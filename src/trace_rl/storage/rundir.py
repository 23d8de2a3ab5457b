"""The run folder: the one place that knows its layout.

    RUN_DIR/
      config.yaml              the full config the run trains with
      config.step_XXXX.yaml    the config before a resume at step XXXX changed it (see `archive_config`)
      metrics.jsonl            one JSON object per step (`step` first), appended as the run goes
      trees/step_XXXX.jsonl    every tree a step sampled (`trace_rl.core.tree.write_jsonl`)
      checkpoints/step_XXXX.pt the last two checkpoints; `checkpoints/latest` names the newest. Each holds
                               the config its steps were trained with and its step's metrics record
      code.json                the code the run was started with (`record_code`), and each resume: the
                               step it continued from, the code it continued with, when (`record_resume`)
      .lock                    held (flock) by the one process writing the folder (`RunDir.lock`)
      report.html, *.png       written by `trace-rl report`

A comparison (`trace-rl compare`) is a folder of run folders, `DIR/<method>/seed_<k>/`, plus
`DIR/react/seed_<k>/` (`START`): the starting policy's evaluation, one record at step 0.

A committed result (`docs/results/<name>/`, `scripts/results.py pack`) keeps its run folders' logs packed:
every `metrics.jsonl` and `code.json` under the folder goes into one `runs.tar.xz` at its top (`PACKED`,
members by their path below it), and the run folders keep their `config.yaml`. Readers take a run file
through `read_run_file` / `run_file_exists` (`read_metrics` does), which find the file in its folder, or
else in the nearest `runs.tar.xz` above it, so a live run and a packed one read the same.

The trainer writes it, `compare`, `eval`, `report` and the CLI read it, all through `RunDir`.
Writes that replace a file are atomic (a temporary file, fsynced, renamed, then the folder fsynced),
so a run killed at any moment, or a machine that loses power, leaves either the old file or the new
one. Resuming from a checkpoint at step k rewinds the folder to k (`rewind`): the metrics and trees of
later steps are dropped, since the resumed run makes them again, so `metrics.jsonl` holds each step
once, and a step's line that the kill cut short is written again from its checkpoint's record. A
checkpoint that is empty or cut short (a full disk, an interrupted copy) is skipped with a warning
naming it and the one used instead; that is why the trainer keeps the previous one.

One writer at a time: `train` holds an exclusive lock on `.lock` while it writes, so a second `train`
into the same folder refuses at once, naming the process that holds it; the kernel drops the lock when
that process dies, so a killed run leaves none behind. A write that fails (a full disk, a read-only
folder) is a `RunDirError` naming the path, and leaves the file it would have replaced as it was.

A run folder from someone else. Checkpoints are data, not code: they are read with
`torch.load(weights_only=True)`, which rebuilds tensors, numbers, strings, lists and dicts and
refuses anything else (a pickled function or class), so loading one runs nothing; `checkpoints/latest`
must name a `step_XXXX.pt` file inside the folder, never a path elsewhere. `metrics.jsonl` and the
trees are JSON; `config.yaml` is YAML read with `safe_load` into typed, checked fields. What such a
folder can still make `eval` or `train --resume` do is what its config asks for, as a command line
would: load the model `model.name` names (a hub name or a local path; transformers loads it without
remote code), send prompts to `engine.server_urls` and queries to `task.search_url`, log to
`train.wandb_project`, and spend the compute its budget and steps ask for. Read its config.yaml first.
"""

from __future__ import annotations

import datetime
import functools
import io
import json
import lzma
import os
import re
import subprocess
import tarfile
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from trace_rl.core.tree import RolloutTree, write_jsonl
from trace_rl.infra.config import ConfigError, load_yaml

_STEP_FILE = re.compile(r"step_(\d+)\.jsonl$")
_CHECKPOINT = re.compile(r"step_(\d+)\.pt")
_TEMPORARY = re.compile(r"\..+\.tmp(\d+)")
"""`atomic_write`'s temporary file, `.NAME.tmpPID`: left behind only by a process killed mid-write."""

_HELD: set[Path] = set()
"""Run folders whose lock this process holds (an inner `RunDir.lock` block of the same folder passes)."""

RUN_FILES = re.compile(r"config\.yaml|config\.step_\d+\.yaml|code\.json|metrics\.jsonl|trees|checkpoints|\.lock|report\.html|[\w.-]+\.png|tensorboard|wandb")
"""Names a run folder may hold (what trace-rl writes into one); anything else in `--out` is the user's."""

START = "react"
"""A comparison's folder (and table row) of its starting policy, evaluated without RL (the paper's ReAct row)."""

PACKED = "runs.tar.xz"
"""A committed result's run logs in one file at its top (`pack_runs`): the `PACKED_FILES` of every run
folder below it, as members named by their path relative to that folder."""

PACKED_FILES = ("metrics.jsonl", "code.json", "config.yaml")
"""The files of a run folder that `pack_runs` packs: all a committed run keeps, so its folder goes too
(on disk a folder and its small config took two blocks for a few hundred bytes). `run_folders` lists
the runs from the archive; the comparison's own config stays in the open."""


class RunDirError(ConfigError):
    """A run folder that cannot be used as asked (a checkpoint refused or missing, a pointer leaving the
    folder, a resume that would change the run): bad input, so the CLI says it in one line, exit 2."""


class RunDirWarning(UserWarning):
    """Something the folder made us do differently that the user should know (the CLI prints it)."""


class RunDir:
    """A run folder at `path` (not created until something is written)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config_text: str | None = None
        """The YAML of the config this process trains with (`write_config`), saved in each checkpoint."""
        self._records: dict[int, dict[str, Any]] = {}  # this process's records by step, for the checkpoints

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def read_config(self) -> dict[str, Any]:
        """The run's `config.yaml` as data, in the open or packed (`read_run_file`), parsed as every
        config is (`load_yaml`); {} for an empty file. FileNotFoundError when there is none."""
        return load_yaml(read_run_file(self.config_path).decode("utf-8"), str(self.config_path)) or {}

    @property
    def code_path(self) -> Path:
        return self.path / "code.json"

    def record_code(self) -> str | None:
        """Write `code.json` (the code this run was started with: `code_version()`) if the folder has
        none, and return a warning when the code now running differs from it: config.yaml holds only
        the fields that code had, so fields added since take today's defaults, which may change the
        run. None when they agree or either is unknown."""
        now = code_version()
        if not self.code_path.is_file():
            self.path.mkdir(parents=True, exist_ok=True)
            atomic_write(self.code_path, lambda tmp: Path(tmp).write_text(json.dumps(now)))
            return None
        try:
            started = json.loads(self.code_path.read_text())
        except (OSError, ValueError):
            return f"{self.code_path} is unreadable: which code this run was started with is unknown"
        if not isinstance(started, dict) or None in (started.get("commit"), now["commit"]) or started["commit"] == now["commit"]:
            return None
        return (
            f"{self.path} was started with trace-rl at commit {started['commit']}, and continues at {now['commit']}: "
            "config fields added since take today's defaults (continue it from a checkout of that commit to train it exactly as begun)"
        )

    def record_resume(self, step: int) -> None:
        """Add a resume to `code.json`'s `resumes`: the checkpoint step it continues from, the commit it
        continues with and when (UTC). The steps after it were made by another process, perhaps with
        other code, which whoever reruns or reads the run may need to know. Nothing when `code.json` is
        missing or unreadable (`record_code` has said so)."""
        try:
            record = json.loads(self.code_path.read_text())
        except (OSError, ValueError):
            return
        if not isinstance(record, dict):
            return
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        record.setdefault("resumes", []).append({"step": int(step), "commit": code_version()["commit"], "at": when})
        atomic_write(self.code_path, lambda tmp: Path(tmp).write_text(json.dumps(record)))

    @property
    def trees_dir(self) -> Path:
        return self.path / "trees"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    def has_records(self) -> bool:
        """Whether the folder holds a step's record (a metrics line, a tree file or a checkpoint), which
        a new run written into it would destroy or mix with its own."""
        return bool(self.metrics() or self.tree_files() or self.checkpoint_files())

    def rewind(self, step: int, record: dict[str, Any] | None = None) -> None:
        """Drop the records of steps after `step` (metrics lines, a line the kill cut short, tree files):
        a run resumed at `step` makes them again; -1 drops them all, step 0's evaluation included.
        `record` is the checkpoint's record of `step` itself: written back if the file lost it (a kill
        between the checkpoint and the line, or a line cut short)."""
        records = self.truncate_metrics(step)
        if record is not None and record.get("step") == step and not (records and records[-1]["step"] == step):
            self.append_metrics(record)
        for later, path in self.tree_files().items():
            if later > step:
                path.unlink()

    def foreign_files(self) -> list[str]:
        """Names in the folder that a run does not write (`RUN_FILES`, temporary files aside): the
        user's own, which a new run must not overwrite or bury."""
        if not self.path.is_dir():
            return []
        return sorted(p.name for p in self.path.iterdir() if not (RUN_FILES.fullmatch(p.name) or _TEMPORARY.fullmatch(p.name)))

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the folder's writer lock (`flock` on `.lock`) for the block; RunDirError at once if another
        process holds it, naming that process. The kernel releases it when the holder exits or is killed,
        so a stale lock needs no cleanup. Removes temporary files that killed writers left behind.
        Re-entrant within a process (the CLI takes it before its slow imports, `train_run` again)."""
        import fcntl
        import socket
        import time

        key = self.path.resolve()
        if key in _HELD:
            yield
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            handle = open(self.path / ".lock", "a+", encoding="utf-8")
        except OSError as exc:
            raise RunDirError(f"cannot write to {self.path}: {exc.strerror or exc}") from None
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = " ".join(handle.read(200).split()) or "another process"
                raise RunDirError(
                    f"{self.path} is being written by {holder}: one run folder takes one writer. Wait for it to finish, "
                    "stop it, or choose another --out"
                ) from None
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            handle.flush()
            self.remove_temporary_files()
            _HELD.add(key)
            try:
                yield
            finally:
                _HELD.discard(key)
        finally:
            handle.close()  # closing the descriptor releases the lock

    def remove_temporary_files(self) -> list[Path]:
        """Remove `atomic_write`'s temporary files whose writer is gone (a process killed mid-write):
        they are never read, only take space. Those of a live process are kept."""
        removed = []
        for folder in (self.path, self.trees_dir, self.checkpoints_dir):
            if not folder.is_dir():
                continue
            for path in folder.iterdir():
                match = _TEMPORARY.fullmatch(path.name)
                if match and path.is_file() and not _alive(int(match.group(1))):
                    path.unlink(missing_ok=True)
                    removed.append(path)
        return removed

    # ------------------------------------------------------------ config

    def write_config(self, config: Any) -> None:
        from trace_rl.infra.config import dump_yaml

        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write(self.config_path, lambda tmp: dump_yaml(config, tmp))
        self.config_text = self.config_path.read_text(encoding="utf-8")

    def archive_config(self, step: int, text: str | None = None) -> Path:
        """Keep the config of the steps up to `step` as `config.step_XXXX.yaml`, before a resume there
        replaces `config.yaml`: `text` (a checkpoint's YAML), else `config.yaml` as it is. An archive
        already at `step` is kept: it holds the config those steps were trained with (a later attempt
        that made no checkpoint trained none of them)."""
        archive = self.path / f"config.step_{step:04d}.yaml"
        if not archive.exists():
            data = self.config_path.read_bytes() if text is None else text.encode("utf-8")
            atomic_write(archive, lambda tmp: Path(tmp).write_bytes(data))
        return archive

    # ------------------------------------------------------------ metrics

    def append_metrics(self, record: dict[str, Any]) -> None:
        """Add one step's record to `metrics.jsonl`, flushed and fsynced. A write that fails (a full disk)
        is cut back off, so the file never ends in half a line, and raises RunDirError naming it."""
        if "step" not in record:
            raise ValueError("a metrics record needs a 'step'")
        line = json.dumps(record) + "\n"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            with open(self.metrics_path, "a", encoding="utf-8") as handle:
                size = handle.tell()
                try:
                    handle.write(line)
                    handle.flush()
                    os.fsync(handle.fileno())
                except OSError:
                    handle.truncate(size)
                    raise
        except OSError as exc:
            raise RunDirError(f"cannot write {self.metrics_path}: {exc.strerror or exc}") from None
        step = int(record["step"])
        self._records[step] = {**self._records.get(step, {}), **record}

    def metrics(self) -> list[dict[str, Any]]:
        """The run's records, one per step, in step order (`latest_per_step` of the file, or of its packed
        copy: `read_run_file`); [] if none."""
        return latest_per_step(read_metrics(self.metrics_path)) if run_file_exists(self.metrics_path) else []

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

    def truncate_metrics(self, step: int) -> list[dict[str, Any]]:
        """Keep the records of steps up to `step` (resuming from a checkpoint there drops the rest,
        and a line the kill cut short); returns them."""
        if not self.metrics_path.is_file():
            return []
        kept = [m for m in self.metrics() if m["step"] <= step]
        atomic_write(self.metrics_path, lambda tmp: Path(tmp).write_text("".join(json.dumps(m) + "\n" for m in kept)))
        return kept

    # ------------------------------------------------------------ trees

    def trees_path(self, step: int) -> Path:
        return self.trees_dir / f"step_{step:04d}.jsonl"

    def write_trees(self, trees: Iterable[RolloutTree], step: int) -> None:
        self.trees_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.trees_path(step), lambda tmp: write_jsonl(trees, tmp))

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

    def checkpoint_files(self) -> dict[int, Path]:
        """`checkpoints/step_XXXX.pt` files by step, ascending (by number: step 10000 after 9999)."""
        files = {}
        if self.checkpoints_dir.is_dir():
            for path in self.checkpoints_dir.iterdir():
                match = _CHECKPOINT.fullmatch(path.name)
                if match:
                    files[int(match.group(1))] = path
        return dict(sorted(files.items()))

    def has_checkpoint(self) -> bool:
        return (self.checkpoints_dir / "latest").exists() or bool(self.checkpoint_files())

    def save_checkpoint(self, state: dict[str, Any], step: int, *, keep: int | None = 2) -> Path:
        """Write `checkpoints/step_XXXX.pt` atomically, point `latest` at it, keep the last `keep` (None:
        every one, for a caller with its own policy).

        `state` must be data (`checkpoint_data`): numpy arrays are stored as tensors and come back as
        tensors (`np.asarray` reads them); anything a weights-only load would refuse raises TypeError
        here, naming its key, rather than at the resume that needs it.
        """
        import torch

        data = dict(checkpoint_data(state))
        if self.config_text is not None:
            data.setdefault("config", self.config_text)
        if step in self._records:
            data.setdefault("record", json.dumps(self._records[step]))
        try:
            self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(f"cannot write {self.checkpoints_dir}: {exc.strerror or exc}") from None
        path = self.checkpoint_path(step)
        atomic_write(path, lambda tmp: torch.save(data, tmp))
        atomic_write(self.checkpoints_dir / "latest", lambda tmp: Path(tmp).write_text(path.name))
        if keep is not None:
            for old in list(self.checkpoint_files().values())[:-keep]:
                old.unlink()
        return path

    def latest_checkpoint(self) -> Path:
        """The checkpoint file `checkpoints/latest` names; FileNotFoundError, naming it, if there is none.

        RunDirError if it names anything but a `step_XXXX.pt` file inside the folder (an absolute path,
        `..`, a link out): a folder from someone else must not make us read elsewhere.
        """
        pointer = self.checkpoints_dir / "latest"
        if not pointer.exists():
            raise FileNotFoundError(f"{self.path} has no checkpoint ({pointer} is missing)")
        name = pointer.read_text(encoding="utf-8", errors="replace").strip()
        if not _CHECKPOINT.fullmatch(name):
            raise RunDirError(f"{pointer} names {name!r}; it must name a step_XXXX.pt file in {self.checkpoints_dir}, so it is refused")
        return self._inside(self.checkpoints_dir / name)

    def load_checkpoint(self) -> dict[str, Any]:
        """The newest readable checkpoint, loaded as data (`torch.load(weights_only=True)`).

        The one `latest` names, else the newest other `step_XXXX.pt` that reads, with a `RunDirWarning`
        naming both: a file that is missing, empty or cut short is skipped. A complete file that is not
        data (a pickled function: crafted, or written before checkpoints held only tensors and plain
        values) raises RunDirError and is never skipped past, so its payload does not run and nothing is
        silently lost. FileNotFoundError if the folder has no checkpoint at all.
        """
        candidates = [self.latest_checkpoint()] if (self.checkpoints_dir / "latest").exists() else []
        candidates += [self._inside(p) for p in reversed(self.checkpoint_files().values()) if p not in candidates]
        if not candidates:
            raise FileNotFoundError(f"{self.path} has no checkpoint (no {self.checkpoints_dir / 'step_XXXX.pt'})")
        skipped = []
        for path in candidates:
            try:
                state = _read_checkpoint(path)
            except _Unreadable as exc:
                skipped.append(f"{path.name} ({exc})")
                continue
            if skipped:
                warnings.warn(f"{self.checkpoints_dir}: checkpoint {', '.join(skipped)} cannot be read; using {path.name}, the newest that can", RunDirWarning, stacklevel=2)
            return state
        raise RunDirError(f"{self.path} has no readable checkpoint: {', '.join(skipped)}")

    def read_checkpoint(self, step: int) -> dict[str, Any]:
        """The checkpoint of `step`, loaded as data (`load_checkpoint`'s rules); RunDirError if it is
        missing, cut short or not data."""
        try:
            return _read_checkpoint(self._inside(self.checkpoint_path(step)))
        except _Unreadable as exc:
            raise RunDirError(f"{self.checkpoint_path(step)} cannot be read ({exc})") from None

    def _inside(self, path: Path) -> Path:
        """`path`, if it resolves to a file inside the run folder (a link out of it is refused)."""
        if not path.resolve().is_relative_to(self.path.resolve()):
            raise RunDirError(f"{path} leads outside {self.path} (to {path.resolve()}), so it is refused")
        return path


class _Unreadable(Exception):
    """A checkpoint file that is missing, empty or cut short: skip it for an older one."""


def _read_checkpoint(path: Path) -> dict[str, Any]:
    import torch

    if not path.is_file():
        raise _Unreadable("missing")
    if path.stat().st_size == 0:
        raise _Unreadable("empty")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        if _cut_short(path):
            raise _Unreadable(f"cut short: {str(exc).splitlines()[0]}") from exc
        refused = re.search(r"GLOBAL (\S+) was not an allowed global", str(exc))
        why = f"it would call {refused.group(1)}" if refused else str(exc).splitlines()[0]
        raise RunDirError(
            f"checkpoint {path} is not plain data ({why}), so it is refused: trace-rl never runs code from a "
            "checkpoint. A checkpoint written by trace-rl before checkpoints were data-only is refused the same way; "
            "train it again"
        ) from None
    if not isinstance(state, dict) or "step" not in state:
        raise RunDirError(f"{path} is not a trace-rl checkpoint (expected a dict with a 'step')")
    return state


def _cut_short(path: Path) -> bool:
    """Whether `path` starts as the zip archive `torch.save` writes but is not a whole one."""
    with open(path, "rb") as handle:
        if handle.read(4) != b"PK\x03\x04":
            return False
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is not None
    except (zipfile.BadZipFile, OSError, EOFError):
        return True


def checkpoint_data(value: Any, where: str = "checkpoint") -> Any:
    """`value` as what a weights-only `torch.load` rebuilds: tensors, numbers, strings, None, and lists,
    tuples and dicts of them. numpy arrays become tensors and numpy scalars Python numbers; anything
    else raises TypeError naming its key. Containers holding no numpy value are returned as they are
    (a model's state dict keeps its `_metadata`)."""
    import torch

    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"{where} is a numpy array of {value.dtype}; a checkpoint holds only numeric arrays")
        return torch.from_numpy(np.array(value))
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (torch.Tensor, torch.Size, torch.dtype, torch.device, bool, int, float, str)):
        return value
    if type(value) in (dict, OrderedDict):
        converted = {}
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where} has a key {key!r} of type {type(key).__name__}; a checkpoint's keys are strings or ints")
            converted[key] = checkpoint_data(item, f"{where}.{key}")
        return value if all(converted[k] is value[k] for k in value) else converted
    if type(value) in (list, tuple):
        items = [checkpoint_data(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return value if all(a is b for a, b in zip(items, value)) else type(value)(items)
    raise TypeError(f"{where} is a {type(value).__name__}; a checkpoint holds only tensors, numbers, strings, lists and dicts, so it loads without running code")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a `metrics.jsonl`, in file order: the file, or where a committed result packed
    it, its copy in the `runs.tar.xz` above (`read_run_file`); the same records either way.

    A last line cut short (a run killed mid-write) is dropped (`RunDir.rewind` writes it again from its
    checkpoint); any other line that is not a JSON object with an integer `step` raises RunDirError
    naming the file and line.
    """
    path = Path(path)
    try:
        lines = read_run_file(path).decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise RunDirError(f"{path} cannot be read as a metrics file: {getattr(exc, 'strerror', None) or exc}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise RunDirError(f"{path}:{number}: not JSON ({exc.msg}): not a trace-rl metrics file, or damaged; "
                              "a run folder's metrics.jsonl holds one JSON object per line") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) or isinstance(record.get("step"), bool):
            raise RunDirError(f"{path}:{number}: expected a JSON object with an integer 'step': not a trace-rl metrics file, or damaged")
        records.append(record)
    return records


def read_run_file(path: str | Path) -> bytes:
    """The bytes of a run folder's file `path` (`metrics.jsonl`, `code.json`): the file itself, else its
    packed copy (`packed_member`). FileNotFoundError, naming `path`, when it is neither."""
    path = Path(path)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        found = packed_member(path)
        if found is None:
            raise
    archive, member = found
    return _packed_files(archive)[member]


def run_file_exists(path: str | Path) -> bool:
    """Whether `read_run_file(path)` finds the file: in its folder or packed above it."""
    path = Path(path)
    return path.is_file() or packed_member(path) is not None


def packed_member(path: str | Path) -> tuple[Path, str] | None:
    """The `runs.tar.xz` and member name holding the run file `path` (`pack_runs`): the nearest archive in
    a folder above `path`, if it has the member; None otherwise. The file itself, where it exists, is not
    looked at (`read_run_file` reads that first)."""
    path = Path(path).absolute()
    for folder in path.parents:
        archive = folder / PACKED
        if archive.is_file():
            member = path.relative_to(folder).as_posix()
            return (archive, member) if member in _packed_files(archive) else None
    return None


def _packed_files(archive: Path) -> dict[str, bytes]:
    """A `runs.tar.xz`'s regular files by name, read once while the file stays the same."""
    stat = archive.stat()
    return _read_packed(str(archive.resolve()), stat.st_ino, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _read_packed(archive: str, inode: int, mtime_ns: int, size: int) -> dict[str, bytes]:
    try:
        with tarfile.open(archive, "r:xz") as tar:
            return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    except (tarfile.TarError, lzma.LZMAError, EOFError) as exc:
        raise RunDirError(f"{archive} cannot be read as packed run files ({exc}): damaged, or not made by pack_runs") from None


def pack_runs(folder: str | Path, extra: Sequence[str] = ()) -> Path | None:
    """Move the `PACKED_FILES` of every run folder under `folder` (one holding a `metrics.jsonl`), and
    the files named in `extra` at its top (a comparison's per-step clock), into `folder/runs.tar.xz`,
    kept with the files it already holds (a plain file replaces its packed copy), and remove them and
    the run folders they leave empty; the archive, or None when there is nothing to pack. The same files
    give the same bytes: members in name order, no times or owners (a tar of mode-644 files dated 1970),
    `xz -9e`. Read it with `tar -xJf runs.tar.xz` (restores the plain files), or through `read_run_file`."""
    folder = Path(folder)
    archive = folder / PACKED
    files = dict(_packed_files(archive)) if archive.is_file() else {}
    plain = []
    for path in [run / name for run in run_folders(folder) for name in PACKED_FILES] + [folder / name for name in extra]:
        if path.is_file():
            plain.append(path)
            files[path.relative_to(folder).as_posix()] = path.read_bytes()
    if not files:
        return None
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[name]))
    data = lzma.compress(buffer.getvalue(), preset=9 | lzma.PRESET_EXTREME)
    if not archive.is_file() or archive.read_bytes() != data:
        atomic_write(archive, lambda tmp: Path(tmp).write_bytes(data))
    for path in plain:
        path.unlink()
    for path in sorted({p.parent for p in plain}, key=lambda p: -len(p.parts)):  # the emptied run folders, then their rows
        while path != folder and path.is_dir() and not any(path.iterdir()):
            path.rmdir()
            path = path.parent
    return archive


def run_folders(folder: str | Path) -> list[Path]:
    """The run folders at or under `folder` (each with a `metrics.jsonl`), in name order: those on disk
    and those packed in a `runs.tar.xz` at or above it (`pack_runs`), whose folders exist only as names
    in the archive; `read_run_file` reads the files of either kind."""
    folder = Path(folder)
    found = {p.parent for p in folder.rglob(PACKED_FILES[0]) if p.is_file()} if folder.is_dir() else set()
    here = folder.absolute()
    for base in (here, *here.parents):
        if (base / PACKED).is_file():
            for name in _packed_files(base / PACKED):
                run = base / Path(name).parent
                if Path(name).name == PACKED_FILES[0] and (run == here or here in run.parents):
                    found.add(folder / run.relative_to(here))
            break
    return sorted(found)


def seed_runs(folder: str | Path) -> list[Path]:
    """The runs of a comparison folder, `folder/<row>/seed_<k>` (`run_folders`), in name order."""
    folder = Path(folder)
    return [run for run in run_folders(folder) if len(run.relative_to(folder).parts) == 2 and re.fullmatch(r"seed_\d+", run.name)]


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
    """`write(tmp)` a temporary file beside `path`, fsync it, rename it over `path`, fsync the folder
    (so the rename itself survives a power cut). An interrupted write leaves `path` as it was and
    removes its temporary file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(str(tmp))
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        _discard(tmp)
        raise RunDirError(f"cannot write {path}: {exc.strerror or exc}{_space_left(path)}") from None
    except RuntimeError as exc:  # torch.save's zip writer: "[enforce fail at inline_container.cc:672] ..."
        _discard(tmp)
        if not re.search(r"inline_container|PytorchStreamWriter|iostream|write", str(exc)):
            raise
        raise RunDirError(f"cannot write {path}: {str(exc).splitlines()[0][:200]}{_space_left(path)}") from None
    except BaseException:
        _discard(tmp)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _discard(path: Path) -> None:
    """Remove a temporary file if it can be (on a read-only disk it was never made)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _space_left(path: Path) -> str:
    """' (N MiB free on its disk)' when that is under 1 GiB (the likely reason a write failed), else ''."""
    try:
        stats = os.statvfs(path.parent)
    except OSError:
        return ""
    free = stats.f_bavail * stats.f_frsize
    return f" ({free / 2**20:.1f} MiB free on its disk)" if free < 2**30 else ""


def _alive(pid: int) -> bool:
    """Whether a process `pid` exists (one we may not signal still does)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def code_version() -> dict[str, str | None]:
    """The trace-rl version and the git commit of its source tree (`+dirty` with uncommitted changes;
    None outside a git checkout), recorded in each run folder's `code.json`."""
    package, commit = _code_version()
    return {"trace_rl": package, "commit": commit}


@functools.cache
def _code_version() -> tuple[str | None, str | None]:
    """Asked once a process: the modules it runs were loaded once, so a later answer could only name
    code it does not run (and each answer costs two `git` calls: `record_code`, then `record_resume`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("trace-rl")
    except PackageNotFoundError:
        package = None
    source = Path(__file__).resolve().parents[1]  # the trace_rl package
    try:
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no", "."], capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return package, None
    return package, commit + ("+dirty" if dirty else "")
