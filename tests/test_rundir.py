"""The run folder: one reader and writer of its layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trace_rl.storage.rundir import RunDir, latest_per_step, read_metrics


def test_a_run_started_again_over_old_lines_reads_as_its_last_attempt(tmp_path):
    run = RunDir(tmp_path / "run")
    for attempt, steps in ((1, (1, 2, 3)), (2, (1, 2))):
        for step in steps:
            run.append_metrics({"step": step, "attempt": attempt})
    assert [m["step"] for m in read_metrics(run.metrics_path)] == [1, 2, 3, 1, 2]
    assert [(m["step"], m["attempt"]) for m in run.metrics()] == [(1, 2), (2, 2)]
    assert run.finished_steps() == 2


def test_lines_of_one_step_merge_and_later_keys_win():
    records = [{"step": 1, "a": 1}, {"step": 2, "a": 2}, {"step": 2, "val": 0.5}, {"step": 3, "a": 3}]
    assert latest_per_step(records) == [{"step": 1, "a": 1}, {"step": 2, "a": 2, "val": 0.5}, {"step": 3, "a": 3}]
    assert latest_per_step([{"step": 1}, {"step": 2}, {"step": 3}, {"step": 2, "x": 1}]) == [{"step": 1}, {"step": 2, "x": 1}]


def test_truncate_keeps_the_steps_up_to_a_checkpoint_and_drops_a_cut_line(tmp_path):
    run = RunDir(tmp_path)
    for step in (1, 2, 3):
        run.append_metrics({"step": step, "loss": float(step)})
    with open(run.metrics_path, "a") as handle:
        handle.write('{"step": 4, "lo')  # the kill cut this line short
    assert [m["step"] for m in run.metrics()] == [1, 2, 3]
    run.truncate_metrics(2)
    assert [json.loads(line)["step"] for line in run.metrics_path.read_text().splitlines()] == [1, 2]


def test_last_metrics_merges_keys_over_the_run(tmp_path):
    run = RunDir(tmp_path)
    run.append_metrics({"step": 1, "val/accuracy_greedy": 0.5, "loss": 2.0})
    run.append_metrics({"step": 2, "loss": 1.0})
    assert run.last_metrics() == {"step": 2, "val/accuracy_greedy": 0.5, "loss": 1.0}


def test_a_bad_line_in_the_middle_is_an_error_naming_the_line(tmp_path):
    run = RunDir(tmp_path)
    run.metrics_path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not JSON"):
        run.metrics()


def test_checkpoints_keep_the_last_two_and_latest_names_the_newest(tmp_path):
    run = RunDir(tmp_path)
    for step in (1, 2, 3):
        run.save_checkpoint({"step": step}, step)
    assert sorted(p.name for p in run.checkpoints_dir.glob("step_*.pt")) == ["step_0002.pt", "step_0003.pt"]
    assert run.latest_checkpoint().name == "step_0003.pt" and run.load_checkpoint()["step"] == 3
    with pytest.raises(FileNotFoundError, match="has no checkpoint"):
        RunDir(tmp_path / "empty").latest_checkpoint()


def test_tree_files_are_listed_by_step(tmp_path):
    from trace_rl.core.tree import RolloutTree

    run = RunDir(tmp_path)
    for step in (10, 2):
        run.write_trees([RolloutTree.new("t", "q")], step)
    (run.trees_dir / "notes.txt").write_text("x")
    assert list(run.tree_files()) == [2, 10]


def test_a_run_folder_records_the_code_it_was_started_with_and_says_when_it_continues_on_other_code(tmp_path, monkeypatch):
    import trace_rl.storage.rundir as rundir

    folder = RunDir(tmp_path / "run")
    monkeypatch.setattr(rundir, "code_version", lambda: {"trace_rl": "0.1.0", "commit": "aaa"})
    assert folder.record_code() is None and json.loads(folder.code_path.read_text())["commit"] == "aaa"
    assert folder.record_code() is None  # the same code: nothing to say
    monkeypatch.setattr(rundir, "code_version", lambda: {"trace_rl": "0.1.0", "commit": "bbb"})
    warning = folder.record_code()
    assert "commit aaa" in warning and "continues at bbb" in warning and "defaults" in warning
    assert json.loads(folder.code_path.read_text())["commit"] == "aaa", "the record of the start is kept"
    monkeypatch.setattr(rundir, "code_version", lambda: {"trace_rl": None, "commit": None})
    assert folder.record_code() is None  # not a git checkout: nothing known to compare


def test_code_version_names_this_checkout_s_commit():
    import subprocess

    from trace_rl.storage.rundir import code_version

    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    commit = code_version()["commit"]
    assert commit is None or commit.removesuffix("+dirty") == head


def test_packed_run_files_read_as_the_plain_ones_and_pack_to_the_same_bytes_each_time(tmp_path):
    """A committed result's `runs.tar.xz` (`pack_runs`): every reader gets the same bytes and records as
    from the plain files, packing again or elsewhere gives the same archive, and tar puts them back."""
    import os
    import tarfile

    from trace_rl.storage.rundir import (
        PACKED,
        RunDirError,
        pack_runs,
        read_run_file,
        run_file_exists,
        run_folders,
        seed_runs,
    )

    folder = tmp_path / "results"
    for name in ("trace/seed_0", "trace/seed_1", "react/seed_0"):
        run = RunDir(folder / name)
        for step in (1, 2, 3):
            run.append_metrics({"step": step, "method": name.split("/")[0], "loss": 1 / (step + 0.7), "val/accuracy": step / 3})
        run.code_path.write_text(json.dumps({"trace_rl": "0.1.0", "commit": "abc"}))
        (run.path / "config.yaml").write_text("seed: 0\n")
    with open(folder / "trace" / "seed_0" / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "lo')  # a line the kill cut short: packed as it is, dropped as it was
    (folder / "summary.json").write_text("{}")
    before = {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    records = {p: read_metrics(p) for p in before if p.name == "metrics.jsonl"}
    archive = pack_runs(folder)
    assert archive == folder / PACKED
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == ["runs.tar.xz", "summary.json"]  # run folders too
    assert run_folders(folder) == [folder / "react" / "seed_0", folder / "trace" / "seed_0", folder / "trace" / "seed_1"]
    assert seed_runs(folder) == run_folders(folder) and run_folders(folder / "trace") == [folder / "trace" / "seed_0", folder / "trace" / "seed_1"]
    assert run_folders(folder / "trace" / "seed_1") == [folder / "trace" / "seed_1"] and run_folders(folder / "grpo") == []
    for path, data in before.items():
        assert run_file_exists(path) and read_run_file(path) == data
    for path, lines in records.items():
        assert read_metrics(path) == lines and RunDir(path.parent).metrics() == latest_per_step(lines)
    assert [m["step"] for m in RunDir(folder / "trace" / "seed_0").metrics()] == [1, 2, 3]
    packed = archive.read_bytes()
    assert pack_runs(folder).read_bytes() == packed  # packing a packed folder changes nothing

    again = tmp_path / "again"  # the same files, written later: the same archive
    for path, data in before.items():
        (again / path.relative_to(folder)).parent.mkdir(parents=True, exist_ok=True)
        (again / path.relative_to(folder)).write_bytes(data)
        os.utime(again / path.relative_to(folder), (1e9, 1e9))
    assert pack_runs(again).read_bytes() == packed
    with tarfile.open(archive, "r:xz") as tar:
        assert all(m.mtime == 0 and m.uid == 0 and m.uname == "" for m in tar.getmembers())
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert {p.relative_to(tmp_path / "unpacked"): p.read_bytes() for p in (tmp_path / "unpacked").rglob("*") if p.is_file()} == {
        p.relative_to(folder): data for p, data in before.items() if p.name in ("metrics.jsonl", "code.json", "config.yaml")}

    seed_1 = folder / "trace" / "seed_1" / "metrics.jsonl"
    seed_1.parent.mkdir(parents=True)
    seed_1.write_text('{"step": 1, "loss": 0.0}\n')  # a plain file is read before its packed copy, and replaces it
    assert read_metrics(seed_1) == [{"step": 1, "loss": 0.0}] and run_folders(folder).count(seed_1.parent) == 1
    pack_runs(folder)
    assert not seed_1.parent.exists() and read_metrics(seed_1) == [{"step": 1, "loss": 0.0}]
    assert read_metrics(folder / "react" / "seed_0" / "metrics.jsonl") == records[folder / "react" / "seed_0" / "metrics.jsonl"]
    missing = folder / "trace" / "seed_9" / "metrics.jsonl"
    assert not run_file_exists(missing) and RunDir(missing.parent).metrics() == []
    with pytest.raises(RunDirError, match="seed_9/metrics.jsonl cannot be read"):
        read_metrics(missing)
    assert pack_runs(tmp_path / "empty") is None
