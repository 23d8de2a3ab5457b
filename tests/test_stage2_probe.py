"""trace_rl.research.stage2_probe: Stage 2's predicted flips against the flips seen, and where the update's advantage mass lies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trace_rl.core.tree import RolloutTree, write_jsonl
from trace_rl.research.stage2_probe import (
    advantage_mass,
    calibration,
    prefix_records,
    probe_run,
)


def turn(tree: RolloutTree, parent: int, reward: float | None = None, *, continuation: bool = False) -> int:
    """A policy turn of 2 tokens (a non-final one with a 1-token observation); `continuation`: Stage 2 starts it at `parent`."""
    start = True if continuation else None
    if reward is None:
        return tree.add_turn(parent, action="call", observation="obs", token_ids=[40, 41, 42], mask=[1, 1, 0], starts_rollout=start)
    return tree.add_turn(parent, action="answer", token_ids=[50, 51], mask=[1, 1], reward=reward, starts_rollout=start)


def continued_tree() -> RolloutTree:
    """Two bare rollouts and Stage 2's continuations from their first turns.

        0 ─┬ 1 (v 0.7, k 2) ─┬ 2 (1)   bare
           │                 ├ 5 (0)   continuation
           │                 └ 6 (1)   continuation
           └ 3 (v 0.9, Stage 2 valued it 0.4, k 1) ─┬ 4 (0)   bare
                                                   └ 7 (0)   continuation
    """
    tree = RolloutTree.new("t", "prompt", prompt_token_ids=[1, 2, 3])
    first = turn(tree, 0)
    turn(tree, first, 1.0)
    second = turn(tree, 0)
    turn(tree, second, 0.0)
    turn(tree, first, 0.0, continuation=True)
    turn(tree, first, 1.0, continuation=True)
    turn(tree, second, 0.0, continuation=True)
    tree.nodes[first].budget, tree.nodes[first].predicted = 2, 0.7
    tree.nodes[second].budget, tree.nodes[second].predicted, tree.nodes[second].stage2_value = 1, 0.9, 0.4
    tree.nodes[0].budget = 2
    return tree


def test_prefix_records_by_hand() -> None:
    records = prefix_records(continued_tree())
    # prefix 1: bare success, v 0.7, one flip in 2 continuations, predicted 1 - 0.7^2; prefix 3: Stage 2's value 0.4 wins over the predictor's 0.9
    assert records == [
        pytest.approx({"v": 0.7, "r": 1.0, "k": 2.0, "n": 2.0, "flips": 1.0, "predicted": 0.51, "flip_rate_predicted": 0.3}),
        pytest.approx({"v": 0.4, "r": 0.0, "k": 1.0, "n": 1.0, "flips": 0.0, "predicted": 0.4, "flip_rate_predicted": 0.4}),
    ]
    found = calibration(records)
    assert (found["prefixes"], found["continuations"]) == (2, 3.0)
    assert found["predicted_mixed"] == pytest.approx(0.455) and found["mixed"] == pytest.approx(0.5)
    assert found["brier"] == pytest.approx(((0.51 - 1) ** 2 + 0.4**2) / 2) and found["brier_constant"] == pytest.approx(0.25)
    assert found["flip_rate_predicted"] == pytest.approx(1 / 3) and found["flip_rate"] == pytest.approx(1 / 3)
    assert [(b["low"], b["prefixes"], b["mixed"]) for b in found["bins"]] == [(0.4, 2, 0.5)]
    assert calibration([]) == {"prefixes": 0}


def test_advantage_mass_by_hand() -> None:
    # Unscaled TRACE: V(root) 0.4; root terms V(s) - 0.4; prefix terms below node 1 (mixed, V 2/3): +1/3, -2/3, +1/3;
    # none below node 3 (not mixed). |A|: 4/15, 14/15, 16/15, 14/15 and 0.4 three times, 2 policy tokens each: mass 8.8.
    mass = advantage_mass([continued_tree()], "trace", {"scale_rewards": False})
    assert mass["continuation_token_share"] == pytest.approx(6 / 14)  # nodes 5, 6, 7 of the 7 trained nodes
    assert mass["continuation_mass_share"] == pytest.approx(2 * (16 / 15 + 14 / 15 + 0.4) / 8.8)
    assert mass["prefix_term_mass_share"] == pytest.approx(2 * (1 / 3 + 2 / 3 + 1 / 3) / 8.8)
    grpo = advantage_mass([continued_tree()], "grpo")
    assert "prefix_term_mass_share" not in grpo and grpo["continuation_token_share"] > 0


def test_probe_run_reads_the_trees_after_the_warmup_with_the_runs_estimator(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "trees").mkdir(parents=True)
    (run / "config.yaml").write_text("rollout:\n  method: trace\n  success_threshold: 0.5\ntrain:\n  advantage: null\n  advantage_options: {scale_rewards: false}\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    for step in (1, 2, 3):
        write_jsonl([continued_tree()], run / "trees" / f"step_{step:04d}.jsonl")
    found = probe_run(run, warmup=1)
    assert found["steps"] == 2 and found["prefixes"] == 4 and found["estimator"] == "trace"
    assert found["prefix_term_mass_share"] == pytest.approx(2 * (4 / 3) / 8.8)


def test_results_script_probe_reads_a_comparisons_rows_that_have_a_stage2(tmp_path: Path) -> None:
    from repo_files import load

    for row, tree in (("trace", continued_tree()), ("grpo", RolloutTree.new("g", "prompt"))):
        run = tmp_path / "cmp" / row / "seed_0"
        (run / "trees").mkdir(parents=True)
        (run / "config.yaml").write_text(f"rollout:\n  method: {row}\n")
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
        write_jsonl([tree], run / "trees" / "step_0001.jsonl")
    found = load("scripts/results.py").probe([tmp_path / "cmp"], warmup=0)
    assert list(found["rows"]) == ["trace"] and found["rows"]["trace"]["mean"]["prefixes"] == 2.0


def test_the_probe_table_shows_each_rows_means_and_flags_a_row_valued_by_the_expectation(tmp_path: Path) -> None:
    from repo_files import load

    from trace_rl.research.stage2_probe import probe_markdown

    for row, extra in (("trace", ""), ("trace_expected", "  stage2_evidence: true\n  stage2_expected: true\n")):
        run = tmp_path / "cmp" / row / "seed_0"
        (run / "trees").mkdir(parents=True)
        (run / "config.yaml").write_text(f"rollout:\n  method: trace\n{extra}")
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
        write_jsonl([continued_tree()], run / "trees" / "step_0001.jsonl")
    found = load("scripts/results.py").probe([tmp_path / "cmp"], warmup=0)
    assert [seeds["seed_0"]["valued_by"] for seeds in (found["rows"][r]["seeds"] for r in ("trace", "trace_expected"))] == ["point", "expected"]
    text = probe_markdown(found)
    mean = found["rows"]["trace"]["mean"]
    assert f"| trace | 1 | 2 | {mean['predicted_mixed']:.3f} | {mean['mixed']:.3f} |" in text
    assert "| trace_expected * | 1 |" in text and "trace_expected valued prefixes by the posterior expectation" in text
    assert "as saved when" not in text
    assert "Figures of trace/seed_0 as saved when each run finished" in probe_markdown({**found, "from_saved_figures": ["trace/seed_0"]})
