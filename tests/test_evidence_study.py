"""experiments/evidence_study.py: a finished run saved into the repository comes back on a fresh
machine as a run the comparison skips, and its tree figures stand in for the trees it lost."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
from repo_files import load

from trace_rl.core.tree import RolloutTree, write_jsonl

study = load("experiments/evidence_study.py")
results = load("scripts/results.py")

STEPS = {1: [[0.0] * 8], 6: [[1.0, 0.0], [0.0] * 12], 7: [[1.0, 1.0, 0.0], [0.0, 0.0]]}


def _run(run: Path, last: int, trees: dict[int, list[list[float]]] = STEPS) -> None:
    (run / "trees").mkdir(parents=True)
    (run / "config.yaml").write_text(f"train:\n  steps: {study.STEPS}\n")
    (run / "code.json").write_text('{"commit": "abc"}')
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "timing_s/step": 2.0}) + "\n" for s in range(1, last + 1)))
    for step, prompts in trees.items():
        batch = []
        for number, rewards in enumerate(prompts):
            tree = RolloutTree.new(f"p{number}", f"prompt {number}")
            for reward in rewards:
                tree.add_turn(0, reward=reward)
            batch.append(tree)
        write_jsonl(batch, run / "trees" / f"step_{step:04d}.jsonl")


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
    merged = study._merge({}, study._saved_figures("evidence_tiny", "trees"))
    assert json.dumps(merged, sort_keys=True) == json.dumps(live["methods"], sort_keys=True)
    clocks = study._saved_figures("evidence_tiny", "clock")
    assert clocks["trace"]["seed_0"]["7"] == {"step": 2.0}


def test_merge_keeps_what_was_recomputed_and_adds_only_the_missing_seeds() -> None:
    found = {"trace": {"seeds": {"seed_1": {"x": 1.0, "note": "live"}}}}
    saved = {"trace": {"seed_0": {"x": 3.0}, "seed_1": {"x": 99.0}}, "brace": {"seed_0": {"x": 5.0}}}
    merged = study._merge(found, saved)
    assert merged["trace"]["seeds"] == {"seed_0": {"x": 3.0}, "seed_1": {"x": 1.0, "note": "live"}}
    assert merged["trace"]["mean"] == {"x": 2.0} and merged["brace"]["mean"] == {"x": 5.0}
