"""Stage 2 by the posterior expectation of mixing (`rollout.stage2_expected`): exact by brute force,
equal to the paper's solver at a point mass with independent continuations, and wired end to end."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scripted_engine import FixedValues, ScriptedEngine, make_world
from test_brace import all_succeed

from trace_rl.core.mixing import (
    PrefixPosterior,
    expand_expected,
    fit_repeat_concentration,
    repeat_probabilities,
)
from trace_rl.core.solvers import expand_prefixes
from trace_rl.core.tree import RolloutTree
from trace_rl.infra.config import FieldError
from trace_rl.planning.evidence import Stage2Evidence
from trace_rl.rollout.collector import RolloutConfig, TreeRolloutCollector


def reference_repeat(p: float, strength: float, r: float, k: int, nu: float, grid: int = 4001) -> float:
    """P(all k repeat r), integrated over the Beta posterior on a midpoint grid (a point mass when
    strength is inf), with the group's chance from Beta functions."""
    side = p if r == 1.0 else 1.0 - p
    if math.isinf(strength):
        return all_succeed(side, k, nu)
    a, b = side * strength, (1 - side) * strength
    x = (np.arange(grid) + 0.5) / grid
    log_pdf = (a - 1) * np.log(x) + (b - 1) * np.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    pdf = np.exp(log_pdf)
    return float(np.sum(np.array([all_succeed(t, k, nu) for t in x]) * pdf) / grid)


def objective(posterior: PrefixPosterior, r: np.ndarray, counts: tuple[int, ...]) -> float:
    return sum(1.0 - reference_repeat(p, s, rr, k, posterior.concentration) if k else 0.0
               for p, s, rr, k in zip(posterior.mean, posterior.strength, r, counts))


def test_repeat_probabilities_match_the_write_up():
    p, strength, r = np.array([0.3, 0.8, 0.55]), np.array([4.0, np.inf, 9.5]), np.array([0.0, 1.0, 1.0])
    stay = repeat_probabilities(p, strength, r, 6, 0.7)
    assert stay[:, 0] == pytest.approx(1.0) and np.all(np.diff(stay, axis=1) <= 1e-15)
    for i in range(3):
        for k in (1, 3, 6):
            assert stay[i, k] == pytest.approx(reference_repeat(p[i], strength[i], r[i], k, 0.7), abs=2e-5)


@pytest.mark.parametrize("seed", range(6))
def test_expand_expected_is_exact_by_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, budget, cap = 3, int(rng.integers(2, 7)), int(rng.integers(1, 4))
    posterior = PrefixPosterior(rng.uniform(0.05, 0.95, n), np.where(rng.random(n) < 0.3, np.inf, rng.uniform(1.0, 12.0, n)),
                                float(rng.choice([0.3, 2.0, np.inf])))
    r = rng.integers(0, 2, n).astype(float)
    counts = expand_expected(posterior, r, budget, max_per_prefix=cap)
    total = min(budget, cap * n)
    assert counts.sum() == total and counts.max() <= cap
    best = max(objective(posterior, r, c) for c in itertools.product(range(cap + 1), repeat=n) if sum(c) == total)
    assert objective(posterior, r, tuple(counts)) == pytest.approx(best, abs=1e-6)


def test_at_a_point_mass_with_independent_continuations_it_is_the_papers_stage_2():
    rng = np.random.default_rng(7)
    for _ in range(20):
        n = int(rng.integers(1, 12))
        v, r = rng.uniform(0.01, 0.99, n), rng.integers(0, 2, n).astype(float)
        budget, cap = int(rng.integers(0, 30)), int(rng.integers(1, 6))
        ours = expand_expected(PrefixPosterior(v, np.full(n, np.inf)), r, budget, max_per_prefix=cap)
        paper = expand_prefixes(v, r, budget, max_per_prefix=cap)
        stay = 1.0 - np.abs(r - v)
        assert ours.sum() == paper.sum()
        assert np.sum(1.0 - stay**ours) == pytest.approx(np.sum(1.0 - stay**paper), rel=1e-12)


def test_fit_repeat_concentration_recovers_the_correlation():
    rng = np.random.default_rng(0)
    n, k, true_nu = 5000, 4, 1.5
    p, r = rng.uniform(0.2, 0.8, n), rng.integers(0, 2, n).astype(float)
    q = rng.beta(true_nu * p, true_nu * (1 - p))  # the prefix's shared continuation rate, p known exactly
    ys = rng.random((n, k)) < q[:, None]
    repeated = np.all(ys == r[:, None].astype(bool), axis=1)
    nu = fit_repeat_concentration(p, np.full(n, np.inf), r, np.full(n, k), repeated)
    assert nu == pytest.approx(true_nu, rel=0.2)


def _tree_with_continuations(repeat: bool) -> RolloutTree:
    tree = RolloutTree.new("t", "q", [1])
    first = tree.add_turn(0, token_ids=[2], starts_rollout=True)
    tree.add_turn(first, token_ids=[3], reward=0.0)  # the bare rollout through `first` fails: r = 0
    tree.add_turn(0, token_ids=[2], reward=1.0, starts_rollout=True)
    tree.nodes[first].predicted = 0.4
    for _ in range(3):
        tree.add_turn(first, token_ids=[4], reward=0.0 if repeat else 1.0, starts_rollout=True)
    return tree


def test_the_evidence_model_fits_the_continuations_correlation_and_keeps_it():
    model = Stage2Evidence(min_examples=10**6, min_groups=2)
    model.observe([_tree_with_continuations(True)], 0.5)
    assert np.isinf(model.concentration)  # one group: not yet
    metrics = model.observe([_tree_with_continuations(True)], 0.5)
    assert metrics["stage2/correlation"] == 1.0 / (1.0 + model.concentration) and model.concentration < 1.0  # every group repeated r
    restored = Stage2Evidence()
    restored.load_state_dict(model.state_dict())
    assert restored.concentration == model.concentration and restored.state_dict() == model.state_dict()
    old = {k: v for k, v in model.state_dict().items() if k not in ("concentration", "groups")}
    restored.load_state_dict(old)  # a checkpoint from before: independent continuations
    assert np.isinf(restored.concentration)
    expected = model.expected([_tree_with_continuations(True)], [(0, 1)], np.array([0.4]), 0.5)
    assert expected.mean.tolist() == [0.4] and np.isinf(expected.strength[0]) and expected.concentration == model.concentration


def test_stage2_expected_needs_the_evidence_posterior():
    with pytest.raises(FieldError, match="stage2_expected must be false unless rollout.stage2_evidence"):
        RolloutConfig(method="trace", stage2_expected=True)
    with pytest.raises(FieldError, match="stage2_expected"):
        RolloutConfig(method="trace", stage2_evidence=True, stage2_expected=True, stage2_objective="prompt")
    RolloutConfig(method="trace", stage2_evidence=True, stage2_expected=True)


def test_the_collector_spends_the_budget_with_stage2_expected_and_records_the_posterior_mean():
    taskset, env, tokenizer, turns = make_world()
    for budget in (24, 37):
        config = RolloutConfig(method="trace", budget=budget, max_new_tokens=32, stage2_evidence=True, stage2_expected=True)
        collector = TreeRolloutCollector(ScriptedEngine(tokenizer, turns), tokenizer, env, FixedValues(), config, seed=1)
        collector.evidence = Stage2Evidence(min_examples=1, min_groups=1)
        for _ in range(2):
            batch = collector.collect(taskset.tasks[:8])
            assert sum(t.leaves().size for t in batch.trees) == budget
        assert 0.0 <= batch.stats["stage2/correlation"] < 1.0
        assert any(n.stage2_value is not None for t in batch.trees for n in t.nodes[1:])
