"""scripts/results.py: reproduce (a run folder's first steps, rerun with its own code, give its numbers), signal, trees."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_reward_trees
from repo_files import load

from trace_rl.storage.rundir import code_version

REPO = Path(__file__).resolve().parents[1]
results = load("scripts/results.py")


def test_compare_steps_names_every_value_that_differs_and_ignores_wall_clock_times() -> None:
    recorded = {1: {"step": 1, "critic/score/mean": 0.25, "timing_s/gen": 3.0, "tree/leaves": 16, "only/recorded": 1.0}}
    same = {1: {"step": 1, "critic/score/mean": 0.25, "timing_s/gen": 9.9, "tree/leaves": 16, "only/rerun": 2.0}}
    assert results.compare_steps(recorded, same, 1) == (3, [])  # step, score, leaves: the times and one-sided keys are left out
    changed = {1: {**same[1], "critic/score/mean": 0.25 + 1e-6}}
    compared, mismatches = results.compare_steps(recorded, changed, 1)
    assert compared == 3 and mismatches == [{"step": 1, "key": "critic/score/mean", "recorded": 0.25, "rerun": 0.25 + 1e-6}]


def _clean_checkout() -> bool:
    """Whether a run made now records a commit git holds (`code.json`, from `code_version`)."""
    commit = code_version()["commit"]
    return commit is not None and not commit.endswith("+dirty")


@pytest.mark.skipif(not _clean_checkout(), reason="src/ differs from HEAD: the run's code.json names a dirty tree git cannot check out")
def test_reproduce_reruns_a_run_with_its_own_code_and_finds_its_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACE_RL_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    command = [sys.executable, "-m", "trace_rl", "train", "--config", str(REPO / "configs" / "smoke.yaml"), "--out", str(run),
               "train.steps=2", "train.eval_every=0", "rollout.budget=8", "prompts_per_step=2", "task.test_tasks=2"]
    subprocess.run(command, env={**os.environ, "PYTHONPATH": str(REPO / "src")}, check=True, capture_output=True, timeout=900)
    assert "+dirty" not in json.loads((run / "code.json").read_text())["commit"]
    from trace_rl.storage.rundir import pack_runs

    pack_runs(tmp_path)  # as committed: its config.yaml, log and code.json read from runs.tar.xz
    assert not (run / "config.yaml").exists()
    result = results.reproduce(run, steps=2)
    assert result["reproduced"], result["mismatches"]
    assert result["values_compared"] > 40 and result["resumed_within"] == []
    with pytest.raises(ValueError, match="recorded no step 3"):
        results.reproduce(run, steps=3)


def test_reproduce_refuses_a_run_made_from_uncommitted_changes(tmp_path: Path) -> None:
    from trace_rl.storage.rundir import pack_runs

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/score/mean": 0.5}) + "\n")
    (tmp_path / "config.yaml").write_text("train:\n  eval_every: 0\n")
    (tmp_path / "code.json").write_text(json.dumps({"trace_rl": "0.1.0", "commit": "0123abc+dirty"}))
    with pytest.raises(ValueError, match="uncommitted changes"):
        results.reproduce(tmp_path, steps=1)
    pack_runs(tmp_path)  # a committed run: its metrics and code.json read from runs.tar.xz
    assert not (tmp_path / "code.json").exists()
    with pytest.raises(ValueError, match="uncommitted changes"):
        results.reproduce(tmp_path, steps=1)
    with pytest.raises(ValueError, match="recorded no step 2"):
        results.reproduce(tmp_path, steps=2, commit="0123abc")


def test_export_again_from_the_results_folders_own_config(tmp_path: Path) -> None:
    """Re-exporting a comparison that grew (a run finished) names the exported compare.yaml as its
    config, and re-summarising an exported folder names it as the runs too: copying a file onto
    itself must not fail."""
    from trace_rl.storage.rundir import RunDir

    runs, dest = tmp_path / "runs", tmp_path / "results"
    for seed in (0, 1):
        run = RunDir(runs / "grpo" / f"seed_{seed}")
        for step in (1, 2):
            run.append_metrics({"step": step, "tree/effective_ratio": 0.5, "tree/effective_per_candidate": 0.25, "tree/mixed_budget_share": 0.5,
                                "rollout/rollouts_total": 8.0 * step, "rollout/tokens_total": 80.0 * step, "val/accuracy_sampled": 0.4 + seed / 10})
    config = tmp_path / "compare.yaml"
    config.write_text("# a two-seed comparison\nmethods: [grpo]\nseeds: [0, 1]\nrun:\n  train:\n    steps: 2\n")
    results.export(runs, dest, config)
    packed = (dest / "runs.tar.xz").read_bytes()  # the run logs, packed: nothing else of them in the open
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file() and p.parent.name != "plots") == [
        "command.txt", "compare.yaml", "runs.tar.xz", "summary.json", "summary.md"]  # (these runs have no config.yaml)
    assert results.read_metrics(dest / "grpo" / "seed_1" / "metrics.jsonl") == results.read_metrics(runs / "grpo" / "seed_1" / "metrics.jsonl")
    plots = {p.name: p.read_bytes() for p in (dest / "plots").glob("*.png")}
    from PIL import (
        Image,  # the report extra; the TRL, Ray and verl venvs collect this file without it
    )

    assert plots and all(Image.open(dest / "plots" / name).mode == "P" for name in plots)  # 256 colours
    summary = results.export(runs, dest, dest / "compare.yaml")
    assert (dest / "runs.tar.xz").read_bytes() == packed and {p.name: p.read_bytes() for p in (dest / "plots").glob("*.png")} == plots
    assert results.pack(dest) == {"folder": str(dest), "archive": str(dest / "runs.tar.xz"), "plots": []}  # already packed
    assert (dest / "runs.tar.xz").read_bytes() == packed
    assert summary["methods"]["grpo"]["seeds"] == 2
    assert (dest / "compare.yaml").read_text() == config.read_text()
    (dest / "compare.yaml").write_text(config.read_text().replace("seeds: [0, 1]", "seeds: [0]"))
    summary = results.export(dest, dest, dest / "compare.yaml")  # the summary again, from the exported runs themselves
    assert summary["methods"]["grpo"]["seeds"] == 1
    phase = tmp_path / "phase"  # a study's phase: its page draws the study's plots, not its own
    assert results.main(["export", str(dest), str(phase), "--config", str(config), "--no-plots"]) == 0
    assert not (phase / "plots").exists() and results.read_run_file(phase / "grpo" / "seed_0" / "metrics.jsonl")


def _signal_run(folder: Path, method: str, seed: int, *, share: float, gain: float, budget: int = 8, spent: int = 8) -> Path:
    """A finished two-step run with its start: `share` of its budget in mixed groups, `gain` over the start."""
    run = folder / method / f"seed_{seed}"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"seed: {seed}\nrollout:\n  method: {method}\n  budget: {budget}\n")
    lines = [{"step": step, "tree/effective_ratio": share, "tree/mixed_budget_share": share, "tree/prompts_sampled": 4.0,
              "tree/leaves": float(spent), "rollout/rollouts_total": float(spent * step)} for step in (1, 2)]
    lines.append({"step": 2, "val/accuracy_sampled": 0.2 + gain})
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    start = folder / "react" / f"seed_{seed}"
    start.mkdir(parents=True, exist_ok=True)
    (start / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/accuracy_sampled": 0.2}) + "\n")
    return run


def test_signal_ranks_figures_by_how_they_go_with_the_gain_within_each_regime(tmp_path: Path) -> None:
    """Each regime's level is taken out, a run copied into another folder counts once (and joins the two
    folders into one regime), and a run that spent more than the budget (DAPO's redraws) is left out."""
    for name in ("first", "second", "third"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"config": {"run": {"train": {"steps": 2}}}}))
    for seed in (0, 1):  # gain follows the mixed share exactly, on top of each regime's own level (0.3, 0)
        _signal_run(tmp_path / "first", "low", seed, share=0.2, gain=0.3 + 0.02)
        _signal_run(tmp_path / "first", "high", seed, share=0.6, gain=0.3 + 0.06)
        _signal_run(tmp_path / "second", "mid", seed, share=0.4, gain=0.3 + 0.04)
        _signal_run(tmp_path / "second", "redraws", seed, share=0.9, gain=-0.5, spent=32)
        _signal_run(tmp_path / "third", "a", seed, share=0.2, gain=0.02, budget=16, spent=16)
        _signal_run(tmp_path / "third", "b", seed, share=0.6, gain=0.06, budget=16, spent=16)
    shutil.copytree(tmp_path / "first" / "low", tmp_path / "second" / "low")
    found = results.signal(tmp_path)
    for name in ("first", "second", "third"):  # committed, packed: the same answer
        results.pack_runs(tmp_path / name)
    assert not list(tmp_path.rglob("metrics.jsonl")) and results.signal(tmp_path) == found
    joined, alone = "first + second (budget 8)", "third (budget 16)"
    assert set(found["regimes"]) == {joined, alone}
    assert set(found["regimes"][joined]) == {"low", "high", "mid"}
    assert found["points"] == {"methods": 5, "runs": 10}
    assert found["correlation_with_gain"]["methods"]["mixed_budget_share"] == pytest.approx(1.0)
    assert found["correlation_with_gain"]["runs"]["effective_ratio"] == pytest.approx(1.0)
    assert found["correlation_with_gain"]["methods"]["prompts_sampled"] is None  # the same everywhere: no ranking
    assert found["correlation_within_regime"][joined]["mixed_prompts"] == pytest.approx(1.0)
    assert alone not in found["correlation_within_regime"]  # two methods rank nothing on their own
    assert found["regimes"][joined]["high"]["samples_per_mixed_prompt"] == pytest.approx(0.6 * 8 / (0.6 * 4))


def _saved_trees(run: Path, steps: dict[int, list[list[float]]], planned: int = 7) -> None:
    (run / "trees").mkdir(parents=True)
    (run / "config.yaml").write_text(f"train:\n  steps: {planned}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": step}) + "\n" for step in range(1, max(steps) + 1)))
    write_reward_trees(run, steps)


def test_trees_recomputes_where_the_budget_went_from_saved_trees_after_the_warmup(tmp_path: Path) -> None:
    """Runs made before the unmixed-budget figures (and `rollout/unsolved_share`) existed get them from their trees; warm-up steps, the
    starting policy's folder, a run without trees and a run still going are left out."""
    _saved_trees(tmp_path / "trace" / "seed_0", {
        1: [[0.0] * 30],  # the warm-up: not counted
        6: [[1.0, 0.0], [0.0] * 12, [1.0, 1.0]],  # 16 leaves: 12 failed, 2 solved; one prompt 0 for 12
        7: [[1.0, 0.0, 0.0], [0.0, 0.0], [1.0] * 3],  # 8 leaves: 2 failed, 3 solved
    })
    _saved_trees(tmp_path / "trace" / "seed_1", {6: [[0.0, 1.0]]}, planned=6)
    _saved_trees(tmp_path / "trace" / "seed_2", {6: [[0.0] * 20]}, planned=100)  # still going
    _saved_trees(tmp_path / "react" / "seed_0", {6: [[0.0] * 40]})
    (tmp_path / "grpo" / "seed_0").mkdir(parents=True)
    found = results.trees(tmp_path, warmup=5, at_least=12)
    assert set(found["methods"]) == {"trace"} and found["unfinished"] == ["trace/seed_2"]
    assert set(found["methods"]["trace"]["seeds"]) == {"seed_0", "seed_1"}
    seed0 = found["methods"]["trace"]["seeds"]["seed_0"]
    assert seed0["steps"] == 2
    assert seed0["failed_budget_share"] == pytest.approx((12 / 16 + 2 / 8) / 2)
    assert seed0["solved_budget_share"] == pytest.approx((2 / 16 + 3 / 8) / 2)
    assert seed0["most_leaves_unmixed"] == pytest.approx((12 + 3) / 2)
    assert seed0["most_leaves_unmixed_max"] == 12 and seed0["steps_with_12_or_more_unmixed"] == 1
    # prompt 0 was 0 for 30 in the warm-up (the tally counts it), so step 6's 2 rollouts on it were spent
    # on a prompt shown unsolved; prompt 1 is 0 for 12 after step 6, so step 7's 2 on it likewise
    assert seed0["unsolved_share"] == pytest.approx((2 / 16 + 2 / 8) / 2)
    assert found["methods"]["trace"]["mean"]["failed_budget_share"] == pytest.approx((seed0["failed_budget_share"] + 0.0) / 2)


COMMITTED = sorted(p.parent for p in (REPO / "docs" / "results").glob("*/summary.json"))


@pytest.mark.parametrize("folder", COMMITTED, ids=[p.name for p in COMMITTED])
def test_a_committed_result_summarises_from_its_packed_runs_to_its_summary_json(folder: Path) -> None:
    """Every number of docs/results/<name>/summary.json, recomputed from the run logs in its runs.tar.xz
    (the config block aside: it echoes today's config fields, added since)."""
    from trace_rl.infra.config import load_config
    from trace_rl.research.compare import CompareConfig, summarise

    summary = json.loads(json.dumps(summarise(folder, load_config(CompareConfig, folder / "compare.yaml"))))
    committed = json.loads((folder / "summary.json").read_text())
    assert sorted(summary) == sorted(committed)
    for key in summary.keys() - {"config"}:
        assert json.dumps(summary[key]) == json.dumps(committed[key]), key  # NaN included


def test_the_committed_results_are_packed() -> None:
    """docs/results keeps its run logs in runs.tar.xz and its plots as 256-colour PNGs (`results.py pack`),
    so that it stays small; an export packs what it writes."""
    folder = REPO / "docs" / "results"
    assert not [p for p in folder.rglob("*") if p.name in ("metrics.jsonl", "code.json", "config.yaml")]
    from PIL import Image

    assert all(Image.open(p).mode == "P" for p in folder.glob("*/plots/*.png"))


@pytest.mark.parametrize("argv", [
    ["export", "{missing}", "{tmp}/out", "--config", "{tmp}/compare.yaml"],
    ["export", "{tmp}", "{tmp}/out", "--config", "{missing}.yaml"],
    ["study", "{missing}", "--steps", "10"],
    ["study", "{tmp}", "--steps", "10"],  # a folder without runs
    ["study", str(REPO / "docs/results/evidence_tiny"), "--steps", "100", "--contrast", "nosuch:grpo"],
    ["study", str(REPO / "docs/results/evidence_tiny"), "--steps", "0"],
    ["reproduce", "{tmp}"],  # no config.yaml
    ["reproduce", "{missing}"],
    ["trees", "{missing}"],
    ["trees", "{tmp}", "--warmup", "-1"],
    ["probe", "{missing}"],
    ["pack", "{missing}"],
    ["signal", "--results", "{missing}"],
])
def test_every_subcommand_refuses_bad_input_with_one_line_and_exit_2(argv, tmp_path, capsys):
    (tmp_path / "compare.yaml").write_text("methods: [grpo]\n")
    argv = [a.format(tmp=tmp_path, missing=tmp_path / "nope") for a in argv]
    assert results.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"results.py {argv[0]}: ") and "\n" not in err and "Traceback" not in err, err
