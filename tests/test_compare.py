"""compare's summary: figures as Knapsack-RL and the paper define them, checked on hand-made runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from repo_files import load

from trace_rl.research.compare import CompareConfig, summarise, summary_table
from trace_rl.storage.rundir import RunDir


def _run(folder, accuracies, *, tokens_per_step=100.0, ratio=0.5):
    run = RunDir(folder)
    for step, accuracy in enumerate(accuracies, 1):
        record = {
            "step": step,
            "tree/effective_ratio": ratio,
            "tree/effective_per_candidate": ratio / 2,
            "tree/mixed_budget_share": ratio + 0.1,
            "rollout/rollouts_total": 64.0 * step,
            "rollout/tokens_total": tokens_per_step * step,
            "timing_s/allocation_overhead_share": 0.01,
            "predictor/brier": 0.3 if step <= 5 else 0.2,
            "val/accuracy_sampled": accuracy,
            "val/accuracy_sampled_se": 0.01,
        }
        run.append_metrics(record)


def _config(methods, seeds, steps):
    """A comparison whose runs are `steps` long (only finished runs count in its summary)."""
    config = CompareConfig(methods=methods, seeds=seeds)
    config.run.train.steps = steps
    return config


def test_summary_reports_intervals_and_what_reaching_the_baseline_cost(tmp_path):
    finals = {"grpo": [0.40, 0.42, 0.44], "trace": [0.45, 0.47, 0.49]}
    for seed in range(3):
        _run(tmp_path / "grpo" / f"seed_{seed}", [0.30] * 5 + [finals["grpo"][seed]] * 3, ratio=0.3)
        _run(tmp_path / "trace" / f"seed_{seed}", [0.30, 0.43] + [finals["trace"][seed]] * 6, tokens_per_step=50.0, ratio=0.6)
    config = _config(["grpo", "trace"], [0, 1, 2], steps=8)
    summary = summarise(tmp_path, config)
    grpo, trace = summary["methods"]["grpo"], summary["methods"]["trace"]
    assert grpo["final_accuracy"] == pytest.approx(0.42) and trace["final_accuracy"] == pytest.approx(0.47)
    assert trace["final_accuracy_ci95"] == pytest.approx(4.303 * np.std(finals["trace"], ddof=1) / math.sqrt(3))
    assert trace["effective_ratio"] == pytest.approx(0.6) and trace["mixed_budget_share"] == pytest.approx(0.7)
    assert trace["predictor_brier"] == pytest.approx(0.2)  # steps after the 5-step warm-up only
    assert trace["final_accuracy_eval_se"] == pytest.approx(0.01)
    assert trace["rollouts_to_baseline_accuracy"] == 128.0 and trace["tokens_to_baseline_accuracy"] == 100.0  # step 2
    assert grpo["rollouts_to_baseline_accuracy"] == 6 * 64.0
    table = summary_table(summary)
    assert "| trace | 3 | 0.600 | 0.700 | 0.470 ± " in table and "tokens to it" in table


def test_the_predictors_steps_over_a_quarter_are_counted_after_the_warm_up_and_beyond_their_noise(tmp_path):
    run = RunDir(tmp_path / "trace" / "seed_0")
    # steps 1-5 (warm-up, not counted) all over 0.25; then 0.20 (under), 0.26 within 2 SE, 0.40 beyond, 0.25 exactly
    briers = [0.5] * 5 + [0.20, 0.26, 0.40, 0.25]
    for step, brier in enumerate(briers, 1):
        run.append_metrics({"step": step, "tree/effective_ratio": 0.5, "tree/effective_per_candidate": 0.25,
                            "tree/mixed_budget_share": 0.5, "rollout/rollouts_total": 64.0 * step,
                            "rollout/tokens_total": 100.0 * step, "predictor/brier": brier, "predictor/brier_se": 0.03,
                            "predictor/brier_constant": 0.24 if step > 5 else 0.9, "val/accuracy_sampled": 0.3})
    summary = summarise(tmp_path, _config(["trace"], [0], steps=len(briers)))
    trace = summary["methods"]["trace"]
    assert trace["predictor_brier_over_quarter"] == pytest.approx(3 / 4)  # 0.26, 0.40 and 0.25 of the four after step 5
    assert trace["predictor_brier_over_quarter_2se"] == pytest.approx(1 / 4)  # only 0.40 - 2 x 0.03 is past 0.25
    assert trace["predictor_brier_constant"] == pytest.approx(0.24)
    assert "| 0.240 | 75.0% (25.0%) |" in summary_table(summary)


def test_runs_that_did_not_log_the_brier_standard_error_leave_that_share_unknown(tmp_path):
    _run(tmp_path / "trace" / "seed_0", [0.3] * 8)  # predictor/brier 0.2 after the warm-up, no predictor/brier_se
    trace = summarise(tmp_path, _config(["trace"], [0], steps=8))["methods"]["trace"]
    assert trace["predictor_brier_over_quarter"] == 0.0 and math.isnan(trace["predictor_brier_over_quarter_2se"])
    assert math.isnan(trace["predictor_brier_constant"])


def test_holding_the_baseline_accuracy_ignores_an_early_lucky_evaluation(tmp_path):
    _run(tmp_path / "grpo" / "seed_0", [0.30, 0.45, 0.30, 0.42, 0.42], tokens_per_step=10.0)  # a spike at step 2
    _run(tmp_path / "trace" / "seed_0", [0.43, 0.44, 0.45, 0.46, 0.41])  # ends below grpo's final 0.42
    summary = summarise(tmp_path, _config(["grpo", "trace"], [0], steps=5))
    grpo, trace = summary["methods"]["grpo"], summary["methods"]["trace"]
    assert grpo["rollouts_to_baseline_accuracy"] == 128.0  # first reached at the spike
    assert grpo["rollouts_to_hold_baseline_accuracy"] == 256.0 and grpo["tokens_to_hold_baseline_accuracy"] == 40.0
    assert trace["rollouts_to_baseline_accuracy"] == 64.0 and math.isnan(trace["rollouts_to_hold_baseline_accuracy"])
    assert "| 128 | 20 | 256 | — |" in summary_table(summary)  # grpo: first reach, its tokens, holds from; no step after 5


def test_a_runs_own_evaluation_of_its_start_counts_as_nothing_spent(tmp_path):
    """`train.eval_on_start` logs a step-0 line with the accuracy and no rollout counters."""
    for method, start, accuracies in (("grpo", 0.30, [0.31, 0.35]), ("trace", 0.36, [0.33, 0.40])):
        run = RunDir(tmp_path / method / "seed_0")
        run.append_metrics({"step": 0, "val/accuracy_sampled": start, "val/accuracy_sampled_se": 0.01})
        _run(tmp_path / method / "seed_0", accuracies)
    summary = summarise(tmp_path, _config(["grpo", "trace"], [0], steps=2))
    trace = summary["methods"]["trace"]
    assert trace["final_accuracy"] == pytest.approx(0.40)
    # trace's start (0.36) is already at grpo's final 0.35, then it dips below and ends above: first reach at
    # no cost, held from step 2
    assert trace["rollouts_to_baseline_accuracy"] == 0.0 and trace["tokens_to_baseline_accuracy"] == 0.0
    assert trace["rollouts_to_hold_baseline_accuracy"] == 128.0


def test_one_seed_has_no_interval(tmp_path):
    _run(tmp_path / "grpo" / "seed_0", [0.5])
    summary = summarise(tmp_path, _config(["grpo"], [0], steps=1))
    assert math.isnan(summary["methods"]["grpo"]["final_accuracy_ci95"])
    assert "0.500 ± —" in summary_table(summary)


def test_the_starting_policy_is_the_react_row_and_where_every_curve_starts(tmp_path):
    from trace_rl.research.compare import write_start

    config = _config(["grpo", "trace"], [0, 1], steps=2)
    for seed, start in enumerate([0.30, 0.34]):
        write_start(config.run, tmp_path / "react" / f"seed_{seed}", {"val/accuracy_sampled": start, "val/accuracy_sampled_se": 0.01})
        _run(tmp_path / "grpo" / f"seed_{seed}", [0.31, 0.31])  # below the start on seed 1
        _run(tmp_path / "trace" / f"seed_{seed}", [0.40, 0.45 + seed / 100])
    summary = summarise(tmp_path, config)
    assert summary["react"]["final_accuracy"] == pytest.approx(0.32) and summary["react"]["seeds"] == 2
    assert summary["methods"]["trace"]["accuracy_gain"] == pytest.approx(np.mean([0.45 - 0.30, 0.46 - 0.34]))  # per seed
    assert summary["methods"]["grpo"]["accuracy_gain"] == pytest.approx(np.mean([0.01, -0.03]))
    # GRPO ends at 0.31, below the start's mean 0.32: every method "reaches" it before spending a rollout
    assert summary["methods"]["trace"]["rollouts_to_baseline_accuracy"] == 0.0
    table = summary_table(summary)
    assert "| react (start, no RL) | 2 | — | — | 0.320 ± " in table
    assert "grpo ends at 0.310, not above the start (0.320)" in table  # and so the 0 says nothing: the table says so


def test_no_warning_under_the_table_when_the_baseline_ends_above_the_start(tmp_path):
    from trace_rl.research.compare import write_start

    config = _config(["grpo"], [0], steps=2)
    write_start(config.run, tmp_path / "react" / "seed_0", {"val/accuracy_sampled": 0.30, "val/accuracy_sampled_se": 0.01})
    _run(tmp_path / "grpo" / "seed_0", [0.32, 0.36])
    summary = summarise(tmp_path, config)
    assert summary["methods"]["grpo"]["rollouts_to_baseline_accuracy"] == 128.0
    assert "not above the start" not in summary_table(summary)


def test_without_a_start_evaluation_there_is_no_react_row(tmp_path):
    _run(tmp_path / "grpo" / "seed_0", [0.5])
    summary = summarise(tmp_path, _config(["grpo"], [0], steps=1))
    assert "react" not in summary and math.isnan(summary["methods"]["grpo"]["accuracy_gain"])


def test_an_unfinished_run_is_listed_not_counted(tmp_path):
    for seed in (0, 1):
        _run(tmp_path / "grpo" / f"seed_{seed}", [0.40, 0.50])
    _run(tmp_path / "trace" / "seed_0", [0.40, 0.60])
    _run(tmp_path / "trace" / "seed_1", [0.90])  # cut short after step 1: its last evaluation is no final accuracy
    summary = summarise(tmp_path, _config(["grpo", "trace"], [0, 1], steps=2))
    assert summary["methods"]["grpo"]["seeds"] == 2 and summary["methods"]["trace"]["seeds"] == 1
    assert summary["methods"]["trace"]["final_accuracy"] == pytest.approx(0.60)
    assert summary["unfinished"] == {"trace": {1: 1}}
    table = summary_table(summary)
    assert "| trace | 1 | " in table and "trace seed 1 at step 1" in table


def test_exported_results_hold_the_runs_and_reproduce_the_summary_and_the_results_page(tmp_path):
    import json

    import yaml

    from trace_rl.research.compare import write_start

    results = load("scripts/results.py")
    runs, dest = tmp_path / "runs", tmp_path / "docs" / "results" / "toy"
    config_path = tmp_path / "toy.yaml"
    config_path.write_text("# A toy comparison.\n#   trace-rl compare --config toy.yaml --out runs\n" + yaml.safe_dump({"methods": ["grpo", "trace"], "seeds": [0, 1], "run": {"train": {"steps": 2}}}))
    config = _config(["grpo", "trace"], [0, 1], steps=2)
    for seed in (0, 1):
        write_start(config.run, runs / "react" / f"seed_{seed}", {"val/accuracy_sampled": 0.3})
        _run(runs / "grpo" / f"seed_{seed}", [0.35, 0.40 + seed / 100], ratio=0.3)
        _run(runs / "trace" / f"seed_{seed}", [0.40, 0.45], ratio=0.6)
        (runs / "trace" / f"seed_{seed}" / "checkpoints").mkdir()
        (runs / "trace" / f"seed_{seed}" / "checkpoints" / "step_0002.pt").write_bytes(b"weights")
    summary = results.export(runs, dest, config_path)
    assert json.dumps(summary["methods"]) == json.dumps(summarise(runs, config)["methods"])  # the copies give the same numbers (NaN too)
    assert json.loads((dest / "summary.json").read_text())["methods"]["trace"]["effective_ratio"] == pytest.approx(0.6)
    assert (dest / "runs.tar.xz").is_file() and not (dest / "react").exists()  # every run's files packed, folders too
    assert results.read_run_file(dest / "react" / "seed_0" / "config.yaml") == (runs / "react" / "seed_0" / "config.yaml").read_bytes()
    assert results.read_metrics(dest / "trace" / "seed_1" / "metrics.jsonl") == results.read_metrics(runs / "trace" / "seed_1" / "metrics.jsonl")
    assert not list(dest.rglob("*.pt")) and (dest / "plots" / "effective_ratio.png").is_file()
    assert (dest / "command.txt").read_text().startswith("trace-rl compare --config")
    (dest / "command.txt").write_text("trace-rl compare --config toy.yaml --out runs\n# seed 1 ran apart, at another commit\n")
    assert json.dumps(results.export(dest, dest, dest / "compare.yaml")["methods"]) == json.dumps(summary["methods"])  # from the copy
    assert "seed 1 ran apart" in (dest / "command.txt").read_text()  # an existing record is kept, not overwritten
    hooks = load("scripts/docs_hooks.py")  # the site's page for it, made from the exported files alone
    assert hooks.comparisons(tmp_path / "docs") == [dest]
    text = hooks.page(dest)
    assert text.startswith("# toy\n") and "A toy comparison." in text and "trace-rl compare --config toy.yaml" in text
    assert summary_table(summary) in text and "![Budget in mixed-outcome trees](toy/plots/mixed_budget_share.png)" in text
    # a study over this and other folders draws every row of it: the page shows those plots, packed too
    from PIL import Image

    (dest / "study_plots").mkdir()
    Image.new("RGBA", (8, 8), (255, 0, 0, 255)).save(dest / "study_plots" / "accuracy.png")
    assert results.shrink_plots(dest) == [dest / "study_plots" / "accuracy.png"]
    with Image.open(dest / "study_plots" / "accuracy.png") as image:
        assert image.mode == "P"
    text = hooks.page(dest)
    assert "![Held-out accuracy](toy/study_plots/accuracy.png)" in text and "toy/plots/" not in text
    # where the budget went (`results.py trees`) and what Stage 2 bought (`results.py probe`), when committed
    figures = {"failed_budget_share": 0.5, "solved_budget_share": 0.25, "unsolved_share": 0.125, "most_leaves_unmixed_max": 12.0,
               "steps_with_12_or_more_unmixed": 3}
    (dest / "trees.json").write_text(json.dumps({"warmup": 5, "at_least": 12, "methods": {"grpo": {"seeds": {"seed_0": figures}, "mean": figures}},
                                                 "unfinished": []}))
    probe = {"prefixes": 10.0, "predicted_mixed": 0.5, "mixed": 0.25, "valued_by": "point"}
    (dest / "probe.json").write_text(json.dumps({"warmup": 5, "rows": {"trace": {"seeds": {"seed_0": probe}, "mean": probe}}}))
    text = hooks.page(dest)
    assert "## Where the budget went" in text and "| grpo | 1 | 0.500 | 0.250 | 0.125 | 12.0 | 3.0 |" in text
    assert "## What Stage 2 bought" in text and "| trace | 1 | 10 | 0.500 | 0.250 | — |" in text
    assert "as saved when" not in text
    (dest / "trees.json").write_text(json.dumps({**json.loads((dest / "trees.json").read_text()), "from_saved_figures": ["grpo/seed_0"]}))
    assert "Figures of grpo/seed_0 as saved when each run finished" in hooks.page(dest)


def test_a_variant_row_runs_its_method_with_its_overrides_into_its_own_folder(tmp_path):
    from trace_rl.research.compare import run_compare

    config = CompareConfig(
        methods=["trace", "trace_tokens"], seeds=[0], evaluate_start=False,
        variants={"trace_tokens": {"rollout.method": "trace", "rollout.budget_unit": "tokens", "rollout.budget": 2200, "train.steps": 3}},
    )
    config.run.train.steps = 2
    made = {}

    def train_one(run, run_dir, stop):
        made[run_dir.relative_to(tmp_path).as_posix()] = (run.rollout.method, run.rollout.budget_unit, run.rollout.budget, run.seed)
        _run(run_dir, [0.3] * run.train.steps)

    summary = run_compare(config, tmp_path, train_one)
    assert made == {"trace/seed_0": ("trace", "leaves", 64, 0), "trace_tokens/seed_0": ("trace", "tokens", 2200, 0)}
    assert config.run.rollout.budget_unit == "leaves"  # the shared config is untouched
    assert set(summary["methods"]) == {"trace", "trace_tokens"}  # each row counts as finished at its own steps
    assert summary["config"]["variants"]["trace_tokens"]["rollout.budget"] == 2200


@pytest.mark.parametrize(
    "variants, methods, match",
    [
        ({"trace": {"rollout.method": "trace"}}, ["trace"], "variants.trace"),
        ({"mine": {"rollout.budget": 32}}, ["mine"], "variants.mine.rollout.method"),
        ({"mine": {"rollout.method": "trace", "rollout.budgte": 32}}, ["mine"], "unknown config key 'variants.mine.rollout.budgte'"),
        ({"mine": {"rollout.method": "knapsack", "rollout.budget_unit": "tokens", "rollout.budget": 999}}, ["mine"], "variants.mine.rollout.budget_unit"),
        ({}, ["mine"], "methods"),
    ],
)
def test_a_bad_variant_is_refused_naming_its_key(variants, methods, match):
    from trace_rl.infra.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        CompareConfig(methods=methods, seeds=[0], variants=variants)


def test_the_difference_to_the_baseline_is_paired_by_seed_over_the_seeds_both_finished(tmp_path):
    grpo, trace = [0.20, 0.30, 0.40], [0.23, 0.32, 0.44]  # seeds far apart, trace ahead on each by 2-4 points
    for seed in range(3):
        _run(tmp_path / "grpo" / f"seed_{seed}", [grpo[seed]] * 2)
        _run(tmp_path / "trace" / f"seed_{seed}", [trace[seed]] * 2)
    _run(tmp_path / "pcl" / "seed_0", [0.25] * 2)
    _run(tmp_path / "pcl" / "seed_1", [0.9])  # unfinished: no pair
    summary = summarise(tmp_path, _config(["grpo", "trace", "pcl"], [0, 1, 2], steps=2))
    paired = summary["methods"]["trace"]
    differences = np.subtract(trace, grpo)
    assert paired["accuracy_vs_baseline"] == pytest.approx(0.03) and paired["accuracy_vs_baseline_seeds"] == 3
    assert paired["accuracy_vs_baseline_ci95"] == pytest.approx(4.303 * np.std(differences, ddof=1) / math.sqrt(3))
    unpaired = paired["final_accuracy_ci95"] + summary["methods"]["grpo"]["final_accuracy_ci95"]
    assert paired["accuracy_vs_baseline_ci95"] < unpaired / 10  # what the seeds share is left out
    assert summary["methods"]["pcl"]["accuracy_vs_baseline"] == pytest.approx(0.05) and summary["methods"]["pcl"]["accuracy_vs_baseline_seeds"] == 1
    assert math.isnan(summary["methods"]["pcl"]["accuracy_vs_baseline_ci95"])
    assert "accuracy_vs_baseline" not in summary["methods"]["grpo"]
    table = summary_table(summary)
    assert "against grpo, paired by seed" in table and "| +0.030 ± 0.0" in table and "| +0.050 ± — |" in table


def test_the_95_percent_interval_uses_student_t_beyond_ten_degrees_of_freedom() -> None:
    from trace_rl.research.compare import t975

    # published t_0.975 quantiles (to 3 decimals) for 11, 12, 20, 30 and 120 degrees of freedom
    for dof, exact in ((11, 2.201), (12, 2.179), (20, 2.086), (30, 2.042), (120, 1.980)):
        assert t975(dof) == pytest.approx(exact, abs=6e-4)
    assert t975(4) == 2.776 and t975(10) == 2.228
    widths = [t975(dof) for dof in range(1, 200)]
    assert all(a > b for a, b in zip(widths, widths[1:])) and widths[-1] > 1.96  # never narrower than the normal's
    with pytest.raises(ValueError):
        t975(0)


def test_warm_start_per_seed_gives_each_seed_its_own_starting_policy():
    from trace_rl.research.compare import CompareConfig

    shared = CompareConfig(methods=["grpo", "trace"], seeds=[3, 5])
    assert {shared.run_config(m, s).sft.seed for m in shared.methods for s in shared.seeds} == {0}
    assert [c.sft.seed for c in shared.start_configs()] == [0]
    own = CompareConfig(methods=["grpo", "trace"], seeds=[3, 5], warm_start_per_seed=True)
    assert [own.run_config("trace", s).sft.seed for s in own.seeds] == [3, 5]
    assert [(c.seed, c.sft.seed) for c in own.start_configs()] == [(3, 3), (5, 5)]
    assert own.start_config(5).rollout.method == own.run.rollout.method
