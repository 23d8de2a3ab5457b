"""The run folder: one reader and writer of its layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trace_rl.rundir import RunDir, latest_per_step, read_metrics


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
    from trace_rl.tree import RolloutTree

    run = RunDir(tmp_path)
    for step in (10, 2):
        run.write_trees([RolloutTree.new("t", "q")], step)
    (run.trees_dir / "notes.txt").write_text("x")
    assert list(run.tree_files()) == [2, 10]


def test_a_run_folder_records_the_code_it_was_started_with_and_says_when_it_continues_on_other_code(tmp_path, monkeypatch):
    import trace_rl.rundir as rundir

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

    from trace_rl.rundir import code_version

    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    commit = code_version()["commit"]
    assert commit is None or commit.removesuffix("+dirty") == head
