"""experiments/evidence_study.py: a finished run saved into the repository comes back on a fresh
machine as a run the comparison skips, and its tree figures stand in for the trees it lost."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml
from conftest import write_reward_trees
from repo_files import load
from study_runs import write_run, write_study

study = load("experiments/evidence_study.py")
results = load("scripts/results.py")

STEPS = {1: [[0.0] * 8], 6: [[1.0, 0.0], [0.0] * 12], 7: [[1.0, 1.0, 0.0], [0.0, 0.0]]}


def _run(run: Path, last: int, trees: dict[int, list[list[float]]] = STEPS) -> None:
    (run / "trees").mkdir(parents=True)
    (run / "config.yaml").write_text(f"train:\n  steps: {study.STEPS}\n")
    (run / "code.json").write_text('{"commit": "abc"}')
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "timing_s/step": 2.0}) + "\n" for s in range(1, last + 1)))
    write_reward_trees(run, trees)


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    work, saved = tmp_path / "work", tmp_path / "saved"
    monkeypatch.setattr(study, "WORK", work)
    monkeypatch.setattr(study, "SAVED", saved)
    monkeypatch.setattr(study, "PAUSES", saved / "pauses.log")
    return work, saved


def test_save_packs_finished_runs_only_and_setup_restores_them_where_they_are_missing(places: tuple[Path, Path]) -> None:
    work, saved = places
    folder = work / "runs" / "evidence_tiny"
    _run(folder / "trace" / "seed_0", study.STEPS)
    _run(folder / "trace" / "seed_1", 40)  # still going: not saved
    (folder / "react" / "seed_0").mkdir(parents=True)
    (folder / "react" / "seed_0" / "metrics.jsonl").write_text('{"step": 0, "val/accuracy_sampled": 0.2}\n')
    assert study.save(commit=False) == ["evidence_tiny/react/seed_0", "evidence_tiny/trace/seed_0"]
    assert study.save(commit=False) == []  # saved once
    archive = saved / "evidence_tiny" / "trace" / "seed_0.tar.xz"
    first = archive.read_bytes()
    archive.unlink()
    study.save(commit=False)
    assert archive.read_bytes() == first  # the same run gives the same bytes
    with tarfile.open(archive) as tar:
        assert tar.getnames() == ["code.json", "config.yaml", "figures.json", "metrics.jsonl"]  # no trees, no checkpoints

    # a fresh machine: the worktree (here a stand-in) holds no runs, or an unfinished copy of a saved one
    fresh = work.parent / "fresh"
    study.WORK = fresh
    (fresh / ".git").mkdir(parents=True)
    (fresh / "configs").mkdir()
    _run(fresh / "runs" / "evidence_tiny" / "trace" / "seed_0", 30)
    study.setup()
    restored = fresh / "runs" / "evidence_tiny" / "trace" / "seed_0"
    assert study._finished(restored) and not (restored / "trees").exists()
    for name in ("metrics.jsonl", "config.yaml", "code.json"):
        assert (restored / name).read_bytes() == (folder / "trace" / "seed_0" / name).read_bytes()
    assert study._finished(fresh / "runs" / "evidence_tiny" / "react" / "seed_0")


def test_saved_tree_figures_stand_in_for_lost_trees_as_results_computes_them(places: tuple[Path, Path]) -> None:
    work, saved = places
    folder = work / "runs" / "evidence_tiny"
    _run(folder / "trace" / "seed_0", study.STEPS)
    _run(folder / "trace" / "seed_1", study.STEPS, {1: [[1.0]], 6: [[0.0] * 3, [1.0, 0.0]], 7: [[1.0] * 4]})
    live = results.trees(folder)
    study.save(commit=False)
    for seed in ("seed_0", "seed_1"):  # the trees are lost: only the saved figures are left
        for path in (folder / "trace" / seed / "trees").iterdir():
            path.unlink()
    assert results.trees(folder)["methods"] == {}
    merged, filled = study._merge({}, study._saved_figures("evidence_tiny", "trees"))
    assert filled == ["trace/seed_0", "trace/seed_1"]
    assert json.dumps(merged, sort_keys=True) == json.dumps(live["methods"], sort_keys=True)
    clocks = study._saved_figures("evidence_tiny", "clock")
    assert clocks["trace"]["seed_0"]["7"] == {"step": 2.0}


def test_merge_keeps_what_was_recomputed_and_adds_only_the_missing_seeds() -> None:
    found = {"trace": {"seeds": {"seed_1": {"x": 1.0, "note": "live"}}}}
    saved = {"trace": {"seed_0": {"x": 3.0}, "seed_1": {"x": 99.0}}, "brace": {"seed_0": {"x": 5.0}}}
    merged, filled = study._merge(found, saved)
    assert filled == ["trace/seed_0", "brace/seed_0"]
    assert merged["trace"]["seeds"] == {"seed_0": {"x": 3.0}, "seed_1": {"x": 1.0, "note": "live"}}
    assert merged["trace"]["mean"] == {"x": 2.0} and merged["brace"]["mean"] == {"x": 5.0}


def test_choose_names_the_plans_strongest_baseline_in_config_and_plan_in_one_commit(places: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work, _ = places
    main = tmp_path / "main"
    for name in (study.PHASES[2][1], "docs/results/evidence_tiny/plan.md"):  # as they were before the study chose
        text = (study.MAIN / name).read_text()
        text = re.sub(r"^methods: \[trace_stage1, trace, trace_expected.*$", "methods: [trace_stage1, trace, trace_expected]", text, flags=re.M)
        text = re.sub(r"^   \*\*Chosen \(.*\n", "", text, flags=re.M)
        (main / name).parent.mkdir(parents=True, exist_ok=True)
        (main / name).write_text(text)
    monkeypatch.setattr(study, "MAIN", main)
    for who in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{who}_NAME", "t")
        monkeypatch.setenv(f"GIT_{who}_EMAIL", "t@t")
    subprocess.run(["git", "init", "-q", str(main)], check=True)
    subprocess.run(["git", "-C", str(main), "add", "."], check=True)
    subprocess.run(["git", "-C", str(main), "commit", "-qm", "plan"], check=True)
    finals = {"grpo": 0.20, "grpo_4": 0.25, "grpo_8": 0.22, "dapo_8x4": 0.21, "knapsack": 0.20, "pcl": 0.25, "knapsack_16": 0.24,
              "brace": 0.23, "trace": 0.40}  # pcl ties grpo_4 on the mean: the earlier row stands; trace is no candidate
    for row, final in finals.items():
        folder = "evidence_tiny_brace" if row in ("brace", "knapsack_16") else "evidence_tiny"
        for seed, shift in enumerate((-0.01, 0.0, 0.01)):
            run = work / "runs" / folder / row / f"seed_{seed}"
            run.mkdir(parents=True)
            (run / "metrics.jsonl").write_text(json.dumps({"step": study.STEPS, "val/accuracy_sampled": final + shift}) + "\n")
    missing = work / "runs" / "evidence_tiny_brace" / "brace" / "seed_2" / "metrics.jsonl"
    kept = missing.read_text()
    missing.write_text(json.dumps({"step": 60, "val/accuracy_sampled": 0.9}) + "\n")  # brace seed 2 still going
    with pytest.raises(SystemExit, match="cannot be chosen yet"):
        study.choose()
    missing.write_text(kept)
    assert study.choose() == "grpo_4"
    assert yaml.safe_load((main / study.PHASES[2][1]).read_text())["methods"] == ["trace_stage1", "trace", "trace_expected", "grpo_4"]
    assert "**Chosen (" in (main / "docs/results/evidence_tiny/plan.md").read_text() and "`grpo_4`.**" in (main / "docs/results/evidence_tiny/plan.md").read_text()
    log = subprocess.run(["git", "-C", str(main), "show", "--stat", "--format=%s", "HEAD"], capture_output=True, text=True, check=True).stdout
    assert log.startswith("evidence study: the strongest baseline is grpo_4") and "plan.md" in log and "more_seeds.yaml" in log
    assert study.choose() == "grpo_4"  # chosen once: a second call reads the config


def test_a_bank_run_keeps_its_trees_cut_to_the_outcomes_brace_banks(places: tuple[Path, Path]) -> None:
    """Phase 2's `brace` reads phase 1's `grpo_4` trees: their archive keeps them, each node cut to its
    place and outcome, so a fresh machine banks the same counts and draws the same tree figures."""
    from trace_rl.predictor.bank import bank_counts

    work, saved = places
    run = work / "runs" / "evidence_tiny" / "grpo_4" / "seed_0"
    _run(run, study.STEPS)
    full = sum(p.stat().st_size for p in (run / "trees").iterdir())
    figures = results.tree_figures(run, 5, 12)
    study.save(commit=False)
    with tarfile.open(saved / "evidence_tiny" / "grpo_4" / "seed_0.tar.xz") as tar:
        names = tar.getnames()
        cut = sum(tar.getmember(n).size for n in names if n.startswith("trees/"))
    assert [n for n in names if n.startswith("trees/")] == [f"trees/step_{s:04d}.jsonl" for s in sorted(STEPS)]
    assert cut < full
    fresh = work.parent / "fresh"
    study.WORK = fresh
    (fresh / ".git").mkdir(parents=True)
    (fresh / "configs").mkdir()
    study.setup()
    restored = fresh / "runs" / "evidence_tiny" / "grpo_4" / "seed_0"
    assert bank_counts([restored], 0.5) == bank_counts([run], 0.5) != {}
    assert results.tree_figures(restored, 5, 12) == figures
    for step in STEPS:
        name = f"step_{step:04d}.jsonl"
        assert int((restored / "trees" / name).stat().st_mtime) == int((run / "trees" / name).stat().st_mtime)  # the clock


def test_finish_waits_for_every_phase_then_exports_each_with_saved_clocks_and_the_study(places: tuple[Path, Path], tmp_path: Path,
                                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The study's last command, on two small phases: it refuses while a run is short of its steps; then
    each phase is exported (packed, with its command), a run whose trees are gone keeps the clock saved
    when it finished, and the pre-registered analysis over both folders reads those clocks."""
    pytest.importorskip("matplotlib")
    from trace_rl.storage.rundir import read_run_file

    work, saved = places

    def configs() -> None:  # as the trainer writes each run's
        for run in (work / "runs").glob("*/[!r]*/seed_*"):
            (run / "config.yaml").write_text("train:\n  steps: 4\n")

    one, two = write_study(work / "runs")
    configs()
    main = tmp_path / "main"
    for name, value in (("MAIN", main), ("PHASES", (("one", "configs/one.yaml"), ("two", "configs/two.yaml"))), ("STEPS", 4),
                        ("ROWS", ("grpo", "pcl", "trace_stage1", "trace")), ("CONTRASTS", ("trace:@strongest", "trace:pcl")),
                        ("RESUMES", saved / "resumes.log"), ("MACHINES", saved / "machines.log"), ("_runner", lambda: None)):
        monkeypatch.setattr(study, name, value)
    (main / "configs").mkdir(parents=True)
    for folder, seeds in ((one, "[0, 1]"), (two, "[2]")):
        (main / "configs" / f"{folder.name}.yaml").write_text(f"methods: [grpo, pcl, trace]\nseeds: {seeds}\nrun:\n  train:\n    steps: 4\n")
        (folder / "summary.json").write_text("{}\n")  # as `trace-rl compare` leaves a finished comparison
    saved.mkdir()
    study.PAUSES.write_text("stop 2027-01-15T08:00:05Z\ncont 2027-01-15T08:00:08Z\n")  # 3 s out of every run's first step
    with pytest.raises(SystemExit, match="one is not done .*trace/seed_1"):
        study.finish()
    shutil.rmtree(one / "trace" / "seed_1")
    write_run(one / "trace" / "seed_1", {4: 0.45})
    write_run(two / "pcl" / "seed_2", {4: 0.20})
    configs()
    study.save(commit=False)
    shutil.rmtree(one / "grpo" / "seed_0" / "trees")  # lost with a machine: its clock comes from its saved figures

    study.finish()
    results_dir = main / "docs" / "results"
    for folder in ("one", "two"):
        dest = results_dir / folder
        assert (dest / "command.txt").read_text().startswith("# made by experiments/evidence_study.py start")
        assert (dest / "runs.tar.xz").is_file() and not (dest / "grpo").exists() and not (dest / "plots").exists()
        assert {"summary.json", "trees.json", "probe.json", "compare.yaml"} <= {p.name for p in dest.iterdir()}
    clocks = json.loads(read_run_file(results_dir / "one" / "clock.json"))
    assert clocks["grpo"]["0"]["1"] == {"step": 7.0} and clocks["grpo"]["1"]["1"] == {"step": 7.0}  # saved, and live
    result = json.loads((results_dir / "one" / "study.json").read_text())
    assert result["strongest_baseline"]["row"] == "grpo"  # 0.267 over seeds 0-2 against pcl's 0.233
    assert result["contrasts"]["trace:@strongest"]["per_seed"] == pytest.approx({"0": 0.15, "1": 0.15, "2": 0.10})
    assert result["rows"]["grpo"]["minutes"] == pytest.approx((237 + 137 + 137) / 3 / 60)  # every run's pause taken out
    assert (results_dir / "one" / "pauses.log").read_text() == study.PAUSES.read_text()
