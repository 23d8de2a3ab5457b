"""Stage 2's evidence posterior (`trace_rl.planning.evidence`): worked by hand, fitted, wired into the collector."""

import numpy as np
import pytest
from scripted_engine import FixedValues, ScriptedEngine, make_world

from trace_rl.core.tree import RolloutTree
from trace_rl.infra.config import FieldError
from trace_rl.planning.evidence import (
    Evidence,
    Stage2Evidence,
    bare_evidence,
    fit,
    posterior,
)
from trace_rl.planning.methods import get_method
from trace_rl.planning.planner import Estimates, Planner, prefix_candidates
from trace_rl.rollout.collector import RolloutConfig, TreeRolloutCollector


@pytest.fixture(scope="module")
def world():
    return make_world()


def _tree() -> RolloutTree:
    """Three bare rollouts of one prompt (two turns then an answer; outcomes 1, 0, 0) and one
    continuation (a failure, as its bare rollout) from the first turn of the second."""
    tree = RolloutTree.new("t", "q")
    firsts = []
    for reward in (1.0, 0.0, 0.0):
        firsts.append(tree.add_turn(0, action="search", observation="obs"))
        second = tree.add_turn(firsts[-1], action="search", observation="obs")
        tree.add_turn(second, action="answer", reward=reward)
    tree.nodes[firsts[1]].predicted = 0.4
    tree.add_turn(firsts[1], action="answer", reward=0.0, starts_rollout=True)
    return tree


def test_the_posterior_matches_a_hand_worked_prefix():
    # turn 2, κ = 2 so κ_t = 1; r = 1 and the prompt's other three bare rollouts hold one success, w = 1/4:
    # (1 · 0.4 + 1 + 0.25 · 1) / (1 + 1 + 0.25 · 3) = 1.65 / 2.75
    evidence = Evidence(np.array([2.0]), np.array([1.0]), np.array([2.0]), np.array([4.0]))
    assert posterior(np.array([0.4]), evidence, 2.0, 0.25) == pytest.approx([0.6])
    # κ = ∞ is the paper's value: the prediction unchanged
    assert posterior(np.array([0.4]), evidence, np.inf, 0.25).tolist() == [0.4]


def test_bare_evidence_counts_the_bare_rollouts_only():
    tree = _tree()
    second_first_turn = tree.nodes[0].children[1]
    ev = bare_evidence([tree], [(0, second_first_turn)], threshold=0.5)
    # the continuation from that prefix is not evidence Stage 2 had when it chose
    assert (ev.depth.tolist(), ev.outcome.tolist(), ev.successes.tolist(), ev.count.tolist()) == ([1.0], [0.0], [1.0], [3.0])


def test_the_fit_trusts_the_evidence_when_continuations_repeat_their_bare_rollout():
    rng = np.random.default_rng(0)
    n = 2000
    v, r = rng.uniform(0.2, 0.8, n), rng.integers(0, 2, n).astype(float)
    rows = np.column_stack([v, np.ones(n), r, r, np.ones(n), r])  # one bare rollout; every continuation repeats it
    kappa, _ = fit(rows)
    assert kappa == 0.125, kappa  # the smallest on the grid: the bare outcome is all there is to know
    # continuations drawn from the prediction alone, whatever the bare rollout did: the paper's value wins
    y = (rng.uniform(size=n) < v).astype(float)
    kappa, weight = fit(np.column_stack([v, np.ones(n), r, r, np.ones(n), y]))
    assert kappa >= 32 and weight == 0.0


def test_the_model_keeps_the_papers_value_until_it_has_seen_enough_continuations():
    model = Stage2Evidence(min_examples=2)
    tree = _tree()
    prefix = [(0, tree.nodes[0].children[1])]
    assert model.adjust([tree], prefix, np.array([0.4]), 0.5).tolist() == [0.4]
    metrics = model.observe([tree], 0.5)
    assert metrics["stage2/continuations"] == 1.0
    assert metrics["stage2/brier_predictor"] == metrics["stage2/brier_evidence"] == pytest.approx(0.16)
    assert metrics["stage2/own_weight"] == 0.0 and model.prior_strength == np.inf
    model.observe([tree], 0.5)  # a second continuation seen: now it fits, and a repeat of r says trust r
    assert model.prior_strength == 0.125


def test_stage2_evidence_needs_a_stage_2_that_reads_values():
    with pytest.raises(FieldError, match="stage2_evidence must be false for method 'random_tree'"):
        RolloutConfig(method="random_tree", stage2_evidence=True)
    RolloutConfig(method="trace_stage2", stage2_evidence=True)


def test_the_collector_allocates_stage_2_with_the_posterior_and_a_resumed_one_with_the_fit_it_had(world):
    taskset, env, tokenizer, turns = world
    config = RolloutConfig(method="trace", budget=40, stage1_share=0.5, max_new_tokens=32, stage2_evidence=True)

    def collector():
        made = TreeRolloutCollector(ScriptedEngine(tokenizer, turns), tokenizer, env, FixedValues(), config, seed=3)
        made.evidence = Stage2Evidence(min_examples=1)
        return made

    unbroken = collector()
    first = unbroken.collect(taskset.tasks[:8])
    assert first.stats["stage2/continuations"] > 0 and np.isfinite(unbroken.evidence.prior_strength)
    state = unbroken.state_dict()
    fitted = (unbroken.evidence.prior_strength, unbroken.evidence.prompt_weight)
    expected = unbroken.collect(taskset.tasks[:8]).trees

    # replay the planner on the bare rollouts with the posterior of the fit it had: the same Stage 2
    from test_rollout import _bare

    replay = [_bare(t) for t in expected]
    originals = [[n.id for n in t.nodes if n.id == 0 or n.rollout_start == 0] for t in expected]
    candidates = prefix_candidates(replay, lambda i, n: expected[i].nodes[originals[i][n]].predicted is not None)
    values = np.array([expected[i].nodes[originals[i][n]].predicted for i, n in candidates])
    allocate_with = posterior(values, bare_evidence(replay, candidates, 0.5), *fitted)
    assert not np.allclose(allocate_with, values), "the posterior equals the predictions: the test tells nothing"
    recorded = np.array([expected[i].nodes[originals[i][n]].stage2_value for i, n in candidates])
    assert np.allclose(recorded, allocate_with)  # the tree says what Stage 2 allocated with, beside `predicted`
    for tree, bare in zip(expected, replay):
        bare.root.budget = tree.root.budget
    Planner(get_method("trace"), config.allocation()).prefixes(replay, candidates, Estimates(values, allocate_with=allocate_with), np.random.default_rng(0))
    assert [n.budget for t in replay for n in t.nodes[1:]] == [expected[i].nodes[j].budget for i, ids in enumerate(originals) for j in ids[1:]]

    resumed = collector()
    resumed.load_state_dict(state)
    again = resumed.collect(taskset.tasks[:8]).trees
    assert [n.budget for t in again for n in t.nodes] == [n.budget for t in expected for n in t.nodes]
