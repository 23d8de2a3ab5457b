"""BRACE's rule (`trace_rl.core.mixing`, `BraceBank`, the `brace` method) against an independent write-up.

The write-up below computes the same quantities another way: the exchangeable Beta-Binomial's
all-agree probability from Beta functions (not the coefficient recursion), its expectation under the
Beta posterior by numerical integration over p (not moments), and the group model's fitted ν by a
likelihood-free grid search over the degenerate fraction.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from trace_rl.core.mixing import (
    BraceConfig,
    agreement_coefficients,
    brace_groups,
    fit_concentration,
    group_mixing,
    point_mixing,
)
from trace_rl.core.tree import History, RolloutTree, write_jsonl
from trace_rl.planning.methods import AllocationSettings, brace_stage1, get_method
from trace_rl.predictor import BraceBank, PromptEvidence, bank_counts

# ---------------------------------------------------------------------- the independent write-up


def _log_beta(x: float, y: float) -> float:
    return math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)


def all_succeed(p: float, k: int, nu: float) -> float:
    """P(all k succeed | p) for a Beta-Binomial with mean p and concentration nu: B(νp + k, ν(1−p)) / B(νp, ν(1−p))."""
    if math.isinf(nu):
        return p**k
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    return math.exp(_log_beta(nu * p + k, nu * (1 - p)) - _log_beta(nu * p, nu * (1 - p)))


def reference_mixing(a: float, b: float, k: int, nu: float, grid: int = 20001) -> float:
    """E[1 − P(all succeed | p) − P(all fail | p)] for p ~ Beta(a, b), integrated on a midpoint grid."""
    p = (np.arange(grid) + 0.5) / grid
    log_pdf = (a - 1) * np.log(p) + (b - 1) * np.log1p(-p) - _log_beta(a, b)
    pdf = np.exp(log_pdf)
    agree = np.array([all_succeed(x, k, nu) + all_succeed(1 - x, k, nu) for x in p])
    return float(np.sum((1.0 - agree) * pdf) / grid)


# ---------------------------------------------------------------------- the mixing value


@pytest.mark.parametrize("a,b,k,nu", [(1, 1, 5, np.inf), (11, 11, 5, np.inf), (1, 21, 5, 0.285), (3, 2, 4, 0.285), (2.5, 7.25, 8, 1.7), (4, 4, 2, 0.05), (1.5, 1.2, 12, 20.0)])
def test_group_mixing_matches_the_write_up(a, b, k, nu):
    assert group_mixing(a, b, k, nu)[0] == pytest.approx(reference_mixing(a, b, k, nu), abs=2e-5)


def test_brace_numbers_as_its_source_states_them():
    # brace/triage.py: a flat prior scores (k-1)/(k+1); at k = 5, s = f = 10 scores 0.9087 against the
    # plug-in's 0.9375, s = 0, f = 20 scores 0.1923 against 0.2076; p = 0.95 plugs in at 0.226 under iid.
    assert group_mixing(1, 1, 5, np.inf)[0] == pytest.approx(4 / 6)
    assert group_mixing(1, 1, 8, np.inf)[0] == pytest.approx(7 / 9)
    assert group_mixing(11, 11, 5, np.inf)[0] == pytest.approx(0.9087, abs=5e-5)
    assert point_mixing(0.5, 5, np.inf)[0] == pytest.approx(0.9375)
    assert group_mixing(1, 21, 5, np.inf)[0] == pytest.approx(0.1923, abs=5e-5)
    assert point_mixing(1 / 22, 5, np.inf)[0] == pytest.approx(0.2076, abs=1e-4)
    assert point_mixing(0.95, 5, np.inf)[0] == pytest.approx(0.226, abs=5e-4)


def test_the_group_model_spans_independent_draws_to_one_repeated_draw():
    p = np.array([0.1, 0.5, 0.83])
    assert point_mixing(p, 6, np.inf) == pytest.approx(1 - p**6 - (1 - p) ** 6)
    assert point_mixing(p, 6, 1e-9) == pytest.approx(0.0, abs=1e-7)  # ν → 0: the group agrees
    for k in (1, 4, 9):
        c = agreement_coefficients(k, 0.7)
        assert c.min() >= 0 and c.sum() == pytest.approx(1.0)
        assert sum(cm * 0.3**m for m, cm in enumerate(c)) == pytest.approx(all_succeed(0.3, k, 0.7))
    assert group_mixing([1.0, 2.0], [1.0, 3.0], 1, 0.5).tolist() == [0.0, 0.0]  # one rollout never mixes


def test_mixing_falls_as_the_correlation_grows_and_is_exact_at_large_k():
    values = [group_mixing(3, 5, 6, nu)[0] for nu in (0.01, 0.1, 1.0, 10.0, np.inf)]
    assert values == sorted(values)
    assert group_mixing(2, 3, 200, 0.5)[0] == pytest.approx(reference_mixing(2, 3, 200, 0.5), abs=1e-4)


def test_fit_concentration_recovers_the_correlation_it_was_drawn_with():
    rng = np.random.default_rng(0)
    n, k, true_nu = 6000, 5, 0.6
    p = rng.beta(2.0, 3.0, size=n)  # each group's prompt rate, drawn from the posterior the fit is told
    q = rng.beta(true_nu * p, true_nu * (1 - p))  # the group's shared rate under the exchangeable model
    successes = rng.binomial(k, q)
    agreed = (successes == 0) | (successes == k)
    nu = fit_concentration(np.full(n, 2.0), np.full(n, 3.0), np.full(n, k), agreed)
    assert nu == pytest.approx(true_nu, rel=0.15)
    # the write-up: the grid point whose predicted degenerate count is nearest the observed one
    grid = np.exp(np.linspace(np.log(0.1), np.log(5.0), 400))
    counts = [n * (1 - reference_mixing(2.0, 3.0, k, g, grid=4001)) for g in grid]
    assert nu == pytest.approx(grid[int(np.argmin(np.abs(np.array(counts) - agreed.sum())))], rel=0.02)
    independent = rng.binomial(k, p)
    assert fit_concentration(np.full(n, 2.0), np.full(n, 3.0), np.full(n, k), (independent == 0) | (independent == k)) > 20


def test_fit_concentration_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="at least 2"):
        fit_concentration([1.0], [1.0], [1], [True])
    with pytest.raises(ValueError, match="no groups"):
        fit_concentration([], [], [], [])


# ---------------------------------------------------------------------- the draw


def test_brace_groups_draws_exactly_the_groups_and_follows_the_weights():
    rng = np.random.default_rng(1)
    w = np.array([0.05, 0.2, 0.9, 0.4, 0.0])
    for _ in range(50):
        chosen = brace_groups(w, 3, eps=0.34, temperature=0.3, rng=rng)
        assert chosen.sum() == 3 and set(chosen.tolist()) <= {0, 1}
    first = np.zeros(5)
    for _ in range(20000):
        first += brace_groups(w, 1, eps=0.0, temperature=0.5, rng=rng)
    expected = np.clip(w, 1e-12, None) ** 2 / np.sum(np.clip(w, 1e-12, None) ** 2)
    assert first / first.sum() == pytest.approx(expected, abs=0.01)
    uniform = np.zeros(5)
    for _ in range(20000):
        uniform += brace_groups(w, 1, eps=1.0, temperature=0.5, rng=rng)
    assert uniform / uniform.sum() == pytest.approx(np.full(5, 0.2), abs=0.015)
    assert brace_groups(w, 9, eps=0.1, temperature=1.0, rng=rng).tolist() == [1] * 5


def test_brace_stage1_spends_the_budget_in_whole_groups():
    rng = np.random.default_rng(2)
    settings = AllocationSettings(brace=BraceConfig(group_size=4))
    evidence = PromptEvidence(successes=np.array([0.0, 3, 9, 1, 0, 5, 2, 0]), failures=np.array([9.0, 3, 0, 1, 0, 4, 6, 0]), concentration=0.5)
    v = np.full(8, 0.5)
    per = brace_stage1(v, 16, settings, evidence, rng)
    assert per.sum() == 16 and set(per.tolist()) <= {0, 4} and (per == 4).sum() == 4
    per = brace_stage1(v, 18, settings, evidence, rng)  # 4 groups and 2 more rollouts for chosen prompts
    assert per.sum() == 18 and (per > 0).sum() == 4 and set(per[per > 0].tolist()) <= {4, 5}
    per = brace_stage1(v, 40, settings, evidence, rng)  # more groups than prompts: all of them, the rest spread
    assert per.sum() == 40 and (per == 5).all()
    with pytest.raises(ValueError, match="counts"):
        brace_stage1(v, 16, settings, None, rng)
    assert get_method("brace").predictor == "brace_bank" and get_method("brace").stage2 is None


def test_brace_prefers_mixed_prompts_to_solved_or_dead_ones():
    rng = np.random.default_rng(3)
    settings = AllocationSettings(brace=BraceConfig(group_size=4, eps=0.0, temperature=0.3))
    evidence = PromptEvidence(successes=np.array([0.0, 20.0, 6.0, 0.0]), failures=np.array([30.0, 0.0, 6.0, 0.0]), concentration=0.285)
    hits = np.zeros(4)
    for _ in range(2000):
        hits += brace_stage1(np.full(4, 0.5), 4, settings, evidence, rng) > 0
    assert hits.argmax() == 2 and hits[2] > hits[3] > hits[0] and hits[3] > hits[1]  # measured mid > unseen > dead, solved


# ---------------------------------------------------------------------- the bank


def root(task_id: str) -> History:
    return History(f"question {task_id}", (), task_id)


def test_bank_counts_decay_and_fit_the_correlation():
    bank = BraceBank(decay=0.5, cycle_steps=2.0, min_groups=2, concentration=None)
    assert bank.predict([root("a")]).tolist() == [0.5]
    bank.update([root("a"), root("b")], np.array([0.25, 1.0]), np.array([4.0, 4.0]))
    assert bank.counts == {"a": [1.0, 3.0], "b": [4.0, 0.0]}
    assert bank.predict([root("a"), root("b")]) == pytest.approx([2 / 6, 5 / 6])
    metrics = bank.update([root("a")], np.array([0.0]), np.array([4.0]))
    half = 0.5**0.5  # γ = 0.5 per pass of 2 steps
    assert bank.counts["a"] == pytest.approx([half, 3 * half + 4]) and bank.counts["b"] == pytest.approx([4 * half, 0.0])
    assert metrics["brace/groups_seen"] == 3 and metrics["brace/correlation"] == 1.0 / (1.0 + bank.concentration) < 1.0
    evidence = bank.evidence([root("b"), root("new")])
    assert evidence.successes == pytest.approx([4 * half, 0.0]) and evidence.concentration == bank.concentration
    restored = BraceBank()
    restored.load_state_dict(bank.state_dict())
    assert restored.state_dict() == bank.state_dict()
    fixed = BraceBank(concentration=2.0)
    fixed.update([root("a")] * 40, np.zeros(40), np.full(40, 4.0))
    assert fixed.concentration == 2.0


def test_the_warm_bank_reads_earlier_runs_bare_rollouts_capped(tmp_path):
    trees = []
    for index, rewards in enumerate([[1.0, 0.0, 0.0], [1.0] * 30]):
        tree = RolloutTree.new(f"t{index}", "q", [1, 2])
        for r in rewards:
            tree.add_turn(0, token_ids=[3], reward=r, starts_rollout=True)
        trees.append(tree)
    first = trees[0].leaves()[0]
    trees[0].add_turn(int(trees[0].nodes[int(first)].parent), token_ids=[4], reward=1.0, starts_rollout=True)
    (tmp_path / "run" / "trees").mkdir(parents=True)
    write_jsonl(trees, tmp_path / "run" / "trees" / "step_0001.jsonl")
    counts = bank_counts([str(tmp_path / "ru*")], 0.5)
    assert counts["t1"] == (30.0, 0.0) and counts["t0"][1] == 2.0
    assert bank_counts([str(tmp_path / "run")], 0.5, tasks={"t0"}).keys() == {"t0"}
    bank = BraceBank()
    bank.add_bank(counts, cap_successes=20, cap_failures=40)
    assert bank.counts["t1"] == [20.0, 0.0]
    with pytest.raises(ValueError, match="no trees"):
        bank_counts([str(tmp_path)], 0.5)


# ---------------------------------------------------------------------- in a training run


def test_a_brace_run_trains_in_whole_groups_and_a_later_run_banks_its_rollouts(tmp_path):
    from test_train import scripted_parts, small_config

    from trace_rl.run import build_predictor, build_trainer, certified_useless

    config = small_config(steps=2)
    config.rollout.method = "brace"
    parts = scripted_parts(config, tmp_path / "cache")
    trainer = build_trainer(config, parts, tmp_path / "first")
    history = [trainer.train_step() for _ in range(2)]
    for metrics in history:
        assert metrics["rollout/leaves"] == 12 and 0.0 <= metrics["brace/correlation"] < 1.0
    bank = parts.predictor
    assert isinstance(bank, BraceBank) and sum(sum(c) for c in bank.counts.values()) > 0
    config.rollout.brace.warm_bank = [str(tmp_path / "fir*")]
    warm = build_predictor(config, parts.train)
    assert set(warm.counts) == set(bank_counts([str(tmp_path / "first")], 0.5))
    assert build_predictor(config, parts.train, own=tmp_path / "first").counts == {}  # never its own folder
    scorer = lambda task, answer: 1.0 if task.task_id == "pays-anything" or answer == task.answers[0] else 0.0
    tasks = parts.train.tasks[:3]
    tasks = [tasks[0], replace(tasks[1], task_id="pays-anything"), replace(tasks[2], answers=("",))]
    assert certified_useless(tasks, scorer, 0.5) == {"pays-anything": "pre-solved", tasks[2].task_id: "pre-solved"}
    assert certified_useless(tasks[:1], lambda task, answer: 0.0, 0.5) == {tasks[0].task_id: "unsatisfiable"}
