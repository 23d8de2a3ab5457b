"""`trace-rl compare`: several methods, same seeds, budget and steps; one table.

Every (method, seed) is a full training run in `DIR/<method>/seed_<k>/`; only `rollout.method`
and `seed` differ between them. `DIR/summary.json` holds, per method, the figures averaged over
steps (ratios) and seeds (accuracy), plus how many rollouts each method needed to first reach the
first method's (the baseline's) final accuracy.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trace_rl.methods import METHODS, MethodName
from trace_rl.run import RunConfig
from trace_rl.rundir import RunDir


@dataclass
class CompareConfig:
    methods: list[MethodName] = field(default_factory=lambda: ["grpo", "prompt_only", "random_tree", "trace"])
    """Methods to run; the first is the baseline the others are measured against."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    accuracy: str = "val/accuracy_sampled"
    """The held-out accuracy the table reports (`val/accuracy_greedy` or `val/accuracy_sampled`)."""
    run: RunConfig = field(default_factory=RunConfig)
    """The shared run config; `run.rollout.method` and `run.seed` are set per run."""
    workers: int = 1
    """Runs trained at once, each in its own process. Each run uses `run.model.cpu_threads` threads,
    so on an idle machine `workers × cpu_threads` up to the core count is close to linear."""

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"methods must be a non-empty list of {', '.join(METHODS)}; unknown: {unknown}")
        if not self.seeds:
            raise ValueError("seeds must not be empty")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers!r}")
        if self.accuracy not in ("val/accuracy_greedy", "val/accuracy_sampled"):
            raise ValueError(f"accuracy must be val/accuracy_greedy or val/accuracy_sampled, got {self.accuracy!r}")


def run_compare(
    config: CompareConfig,
    out: str | Path,
    train_one: Callable[[RunConfig, Path], None],
) -> dict[str, Any]:
    """Train every (method, seed) with `train_one(config, run_dir)` (skipping finished runs), then summarise.

    With `config.workers > 1` the runs go to that many processes, each calling `train_one`, which
    must then be picklable (a module-level function); make any shared warm start before calling.
    """
    out = Path(out)
    pending = []
    for method in config.methods:
        for seed in config.seeds:
            run_dir = out / method / f"seed_{seed}"
            run = copy.deepcopy(config.run)
            run.rollout.method = method  # type: ignore[assignment]
            run.seed = seed
            if not _finished(run_dir, run.train.steps):
                pending.append((run, run_dir))
    if config.workers == 1:
        for run, run_dir in pending:
            train_one(run, run_dir)
    else:
        context = multiprocessing.get_context("spawn")  # no forked torch threads or open files
        with ProcessPoolExecutor(max_workers=config.workers, mp_context=context) as pool:
            for future in [pool.submit(train_one, run, run_dir) for run, run_dir in pending]:
                future.result()  # the first failed run raises here, naming its error
    summary = summarise(out, config)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(summary_table(summary))
    return summary


def _finished(run_dir: Path, steps: int) -> bool:
    return RunDir(run_dir).finished_steps() >= steps


def _run_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return RunDir(run_dir).metrics()


def summarise(out: Path, config: CompareConfig) -> dict[str, Any]:
    """Per method: ratios averaged over steps and seeds; final accuracy over seeds with its 95%
    interval (Student t); the evaluation's own standard error; rollouts and generated tokens spent,
    and how many each method needed to first reach the baseline's final accuracy."""
    acc_key = config.accuracy
    methods: dict[str, dict[str, float]] = {}
    curves: dict[str, list[tuple[float, float, float]]] = {}
    for method in config.methods:
        runs = [_run_metrics(out / method / f"seed_{seed}") for seed in config.seeds]
        runs = [r for r in runs if r]
        if not runs:
            continue
        final = np.array([next((m[acc_key] for m in reversed(r) if acc_key in m), np.nan) for r in runs])
        eval_se = [next((m[f"{acc_key}_se"] for m in reversed(r) if f"{acc_key}_se" in m), np.nan) for r in runs]
        methods[method] = {
            "effective_ratio": _mean_over_steps(runs, "tree/effective_ratio"),
            "effective_per_candidate": _mean_over_steps(runs, "tree/effective_per_candidate"),
            "mixed_budget_share": _mean_over_steps(runs, "tree/mixed_budget_share"),
            "final_accuracy": float(np.nanmean(final)),
            "final_accuracy_std": float(np.nanstd(final)),
            "final_accuracy_ci95": _ci95(final),
            "final_accuracy_eval_se": float(np.nanmean(eval_se)) if not np.all(np.isnan(eval_se)) else float("nan"),
            "rollouts": float(np.mean([r[-1]["rollout/rollouts_total"] for r in runs])),
            "tokens": float(np.mean([r[-1]["rollout/tokens_total"] for r in runs])),
            "predictor_brier": _mean_over_steps(runs, "predictor/brier", after_step=5),
            "allocation_overhead_share": _mean_over_steps(runs, "timing_s/allocation_overhead_share"),
            "steps": float(np.mean([r[-1]["step"] for r in runs])),
            "seeds": float(len(runs)),
        }
        curves[method] = _mean_curve(runs, acc_key)
    baseline = config.methods[0]
    if baseline in methods:
        target = methods[baseline]["final_accuracy"]
        for method, figures in methods.items():
            figures["rollouts_to_baseline_accuracy"], figures["tokens_to_baseline_accuracy"] = _first_reach(curves[method], target)
    return {"methods": methods, "baseline": baseline, "accuracy_key": acc_key, "config": asdict(config)}


_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
"""Student t quantiles t_0.975 for 1..10 degrees of freedom (1.96 beyond)."""


def _ci95(values: np.ndarray) -> float:
    """Half-width of the 95% interval of the mean over seeds; NaN with fewer than two."""
    values = values[~np.isnan(values)]
    if values.size < 2:
        return float("nan")
    t = _T975[values.size - 2] if values.size - 1 <= len(_T975) else 1.96
    return float(t * values.std(ddof=1) / np.sqrt(values.size))


def _mean_over_steps(runs: list[list[dict[str, Any]]], key: str, *, after_step: int = 0) -> float:
    values = [m[key] for r in runs for m in r if key in m and m["step"] > after_step]
    return float(np.mean(values)) if values else float("nan")


def _mean_curve(runs: list[list[dict[str, Any]]], key: str) -> list[tuple[float, float, float]]:
    """(rollouts spent, tokens generated, accuracy) at each evaluated step, averaged over the seeds that have it."""
    by_step: dict[int, list[tuple[float, float, float]]] = {}
    for run in runs:
        for m in run:
            if key in m:
                by_step.setdefault(int(m["step"]), []).append((m["rollout/rollouts_total"], m["rollout/tokens_total"], m[key]))
    return [tuple(float(x) for x in np.mean(v, axis=0)) for _, v in sorted(by_step.items())]  # type: ignore[misc]


def _first_reach(curve: list[tuple[float, float, float]], target: float) -> tuple[float, float]:
    """Rollouts and tokens spent when the mean accuracy first reached `target` (NaN if it never did)."""
    for rollouts, tokens, accuracy in curve:
        if accuracy >= target - 1e-12:
            return rollouts, tokens
    return float("nan"), float("nan")


def summary_table(summary: dict[str, Any]) -> str:
    """The comparison as a Markdown table (the README's results tables are made from summary.json
    with this function)."""
    baseline = summary.get("baseline", "the baseline")
    header = (
        "| method | effective ratio | effective gradient ratio (budget share in mixed groups) | final accuracy (95% CI over seeds) "
        f"| evaluation SE | rollouts | rollouts to {baseline}'s final accuracy | tokens to it | predictor Brier (after step 5) |"
    )
    lines = [header, "|" + "---|" * 9]
    for method, f in summary["methods"].items():
        reach, tokens = f.get("rollouts_to_baseline_accuracy", float("nan")), f.get("tokens_to_baseline_accuracy", float("nan"))
        ci, se, brier = f.get("final_accuracy_ci95", float("nan")), f.get("final_accuracy_eval_se", float("nan")), f.get("predictor_brier", float("nan"))
        lines.append(
            f"| {method} | {f['effective_ratio']:.3f} | {f['mixed_budget_share']:.3f} "
            f"| {f['final_accuracy']:.3f} ± {_or_dash(ci, '.3f')} | {_or_dash(se, '.3f')} | {f['rollouts']:.0f} "
            f"| {_or_dash(reach, '.0f')} | {_or_dash(tokens, '.0f')} | {_or_dash(brier, '.3f')} |"
        )
    return "\n".join(lines) + "\n"


def _or_dash(value: float, spec: str) -> str:
    return "—" if value is None or np.isnan(value) else format(value, spec)
