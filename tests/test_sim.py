"""The latent-tree simulator and the allocation benchmark built on it."""

from __future__ import annotations

import re

import numpy as np
import pytest

from trace_rl.core.tree import RolloutTree
from trace_rl.planning.metrics import FIGURES, tree_metrics
from trace_rl.research.bench import (
    ROWS,
    TOKEN_FIGURES,
    UNMIXED_FIGURES,
    BenchConfig,
    learned_rows,
    run_batch,
    run_benchmark,
)
from trace_rl.research.sim import LatentTreeSimulator, SimConfig


def _grown(sim: LatentTreeSimulator, seed: int, prompts: int = 8, per_prompt: int = 4) -> list[RolloutTree]:
    rng = np.random.default_rng(seed)
    trees = [sim.new_tree(p) for p in sim.sample_prompts(prompts, rng)]
    for tree in trees:
        for _ in range(per_prompt):
            sim.rollout(tree, 0, rng)
    return trees


def test_prefix_probabilities_match_monte_carlo() -> None:
    sim = LatentTreeSimulator(seed=0)
    rng = np.random.default_rng(1)
    prompts = [p for p in sim.sample_prompts(200, rng) if 0.2 < p.p0 < 0.8][:3]
    checked = 0
    for prompt in prompts:
        tree = sim.new_tree(prompt)
        leaf = sim.rollout(tree, 0, rng)
        for node in tree.path(leaf)[:-1]:  # the root and every intermediate prefix
            p = sim.true_value(tree, node)
            draws = 4000
            rewards = [tree.nodes[sim.rollout(tree, node, rng)].reward for _ in range(draws)]
            assert abs(np.mean(rewards) - p) < 4.0 * np.sqrt(p * (1 - p) / draws) + 1e-3
            checked += 1
    assert checked >= 4
    assert sim.true_value(tree, 0) == prompts[-1].p0


def test_expected_root_value_from_topic_matches_monte_carlo() -> None:
    sim = LatentTreeSimulator(seed=2)
    prompts = sim.sample_prompts(20_000, np.random.default_rng(0))
    topic, hops = prompts[0].topic, prompts[0].hops
    same = [p.p0 for p in prompts if (p.topic, p.hops) == (topic, hops)]
    assert len(same) > 50
    assert abs(np.mean(same) - sim.expected_p0(topic, hops)) < 4.0 * np.std(same) / np.sqrt(len(same)) + 1e-3


def test_simulation_is_reproducible_with_a_seed() -> None:
    first = [t.to_dict() for t in _grown(LatentTreeSimulator(seed=5), seed=9)]
    second = [t.to_dict() for t in _grown(LatentTreeSimulator(seed=5), seed=9)]
    assert first == second
    other_world = [t.to_dict() for t in _grown(LatentTreeSimulator(seed=6), seed=9)]
    assert other_world != first


def test_trees_have_the_allocated_leaf_counts_and_valid_structure() -> None:
    sim = LatentTreeSimulator(seed=0)
    rng = np.random.default_rng(0)
    allocation = [0, 2, 5, 3]
    trees = [sim.new_tree(p) for p in sim.sample_prompts(len(allocation), rng)]
    for tree, count in zip(trees, allocation):
        for _ in range(count):
            sim.rollout(tree, 0, rng)
        tree.validate()
        assert tree.leaves().size == count == len(tree.root.children)
        for node in tree.nodes[1:]:
            assert 1 <= node.depth <= sim.config.max_turns + 1
            assert 0.0 <= node.info["p_true"] <= 1.0
        assert all(tree.nodes[int(leaf)].reward in (0.0, 1.0) for leaf in tree.leaves())


def test_text_never_states_a_probability() -> None:
    for tree in _grown(LatentTreeSimulator(seed=0), seed=0):
        texts = [tree.prompt] + [f"{n.thought} {n.action} {n.observation}" for n in tree.nodes]
        assert not any(re.search(r"\d\.\d|%", text) for text in texts)


def test_continuing_a_finished_rollout_raises() -> None:
    sim = LatentTreeSimulator(seed=0)
    rng = np.random.default_rng(0)
    tree = sim.new_tree(sim.sample_prompts(1, rng)[0])
    leaf = sim.rollout(tree, 0, rng)
    with pytest.raises(ValueError, match="finished"):
        sim.rollout(tree, leaf, rng)


def test_sim_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="text_noise"):
        SimConfig(text_noise=1.5)
    with pytest.raises(ValueError, match="hard_share"):
        SimConfig(hard_share=0.8, easy_share=0.3)


def test_default_regime_gives_uniform_allocation_an_effective_ratio_near_the_papers() -> None:
    # Expected share of prompts whose 6 rollouts disagree, over several worlds: the paper starts at 26.8%.
    ratios = []
    for seed in range(10):
        sim = LatentTreeSimulator(seed=seed)
        p = np.array([x.p0 for x in sim.sample_prompts(2000, np.random.default_rng(seed))])
        ratios.append(np.mean(1.0 - p**6 - (1.0 - p) ** 6))
    assert 0.25 <= np.mean(ratios) <= 0.35


# ---------------------------------------------------------------- the benchmark

SMALL = {"prompts_per_batch": 16, "budget": 96, "seeds": 1, "batches": 2, "warmup_batches": 1, "workers": 1}


@pytest.mark.parametrize("row", ROWS)
def test_every_row_spends_exactly_the_budget(row: str) -> None:
    from trace_rl.planning.methods import get_method
    from trace_rl.predictor import PredictorConfig, build_predictor
    from trace_rl.research.bench import parse_row

    cfg = BenchConfig(prompts_per_batch=16, budget=96, stage1_share=0.6)
    sim = LatentTreeSimulator(seed=0)
    prompts = sim.sample_prompts(cfg.prompts_per_batch, np.random.default_rng(0))
    spec = get_method(parse_row(row)[0])
    trees = run_batch(row, prompts, sim, cfg, np.random.default_rng(1), build_predictor(spec.predictor, PredictorConfig(), seed=0))
    assert tree_metrics(trees)["tree/leaves"] == cfg.budget
    bare = sum(1 for t in trees for leaf in t.leaves() if t.nodes[leaf].rollout_start == 0)
    assert bare == sum(t.root.budget for t in trees)
    assert bare >= spec.stage1_budget(cfg.allocation())  # Stage 2 budget no prefix took goes to roots
    for tree in trees:
        tree.validate()
        assert tree.root.budget == len(tree.root.children)
        for node in tree.nodes[1:]:
            if node.budget:  # an expanded prefix: its bare rollout's child plus its continuations
                assert len(node.children) == node.budget + 1


def test_small_benchmark_returns_every_method_and_figure() -> None:
    result = run_benchmark(**SMALL)
    assert set(result["methods"]) == set(ROWS)
    for figures in result["methods"].values():
        names = FIGURES + TOKEN_FIGURES + UNMIXED_FIGURES
        assert set(figures) == set(names) | {f"{name}_std" for name in names}
        assert figures["failed_budget_share"] + figures["solved_budget_share"] + figures["mixed_budget_share"] == pytest.approx(1.0)
        assert all(0.0 <= figures[name] <= 1.0 for name in FIGURES)
        assert figures["leaves"] == 96 and figures["tokens_generated"] > 0
    assert set(result["warmup"]) == set(result["predictor"]) == set(learned_rows(ROWS))
    assert set(learned_rows(ROWS)) == {"trace_stage1", "trace", "prompt_only", "knapsack", "pcl", "trace_stage2"}
    assert {"predictor/brier", "predictor/ece", "predictor/mse_true"} <= set(result["predictor"]["trace"])
    assert set(result["targets"]) == {"oracle_vs_uniform", "learned_vs_oracle"}
    assert result["config"]["budget"] == 96 and result["seconds"] > 0.0


def test_benchmark_does_not_depend_on_workers_or_the_methods_run_beside() -> None:
    base = {**SMALL, "seeds": 2, "methods": ["grpo", "trace@oracle"]}
    one = run_benchmark(**base)
    two = run_benchmark(**{**base, "workers": 2, "methods": ["trace@oracle"]})
    assert one["methods"]["trace@oracle"] == two["methods"]["trace@oracle"]


def test_benchmark_rows_are_registry_methods_with_named_values() -> None:
    with pytest.raises(ValueError, match="unknown method 'trace_learned'"):
        run_benchmark(**{**SMALL, "methods": ["trace_learned"]})
    with pytest.raises(ValueError, match="grpo reads no values"):
        run_benchmark(**{**SMALL, "methods": ["grpo@oracle"]})
    with pytest.raises(ValueError, match="dapo's resampling is the trainer's"):
        run_benchmark(**{**SMALL, "methods": ["dapo"]})
    with pytest.raises(ValueError, match="values must be one of oracle, topic, noisy"):
        run_benchmark(**{**SMALL, "methods": ["trace@truth"]})


def test_benchmark_rejects_unknown_keys_and_keeps_defaults_for_none() -> None:
    with pytest.raises(ValueError, match="did you mean 'budget'"):
        run_benchmark(budgett=10)
    with pytest.raises(ValueError, match="stage1_share"):
        run_benchmark(stage1_share=0.0)
    result = run_benchmark(**SMALL, noise=None)
    assert result["config"]["noise"] == BenchConfig().noise
