"""Replay recorded rollout trees through success predictors, online, and score them as training does.

For each run, the steps are replayed in order. At each step every predictor is first scored on that
step's trees, *before* it learns from them, exactly as training logs `predictor/brier`: each
rollout's 0/1 outcome against the estimate at the node it started from (`Node.rollout_start`: the
root for a bare rollout, the prefix for a continuation; `trace_rl.planning.metrics.allocator_outcomes`). The
recorded `Node.predicted` is the recording predictor's, so every predictor here makes its own
estimate at those same nodes. Then each predictor updates on `backup_targets(trees)`, as the trainer
does, and its `predictor/loss` (before) and `predictor/loss_after` are kept.

Rows (all learn from the same trees):

- `shared`: `build_predictor("shared", config)` with the `--set` overrides, as training builds it: the default
  unless `--set` changes it (`--set guard=true` wraps it in the `GuardedPredictor`);
- `shared_previous`: the `HashedNgramPredictor` of commit `--previous` (default: the last one before
  the real-tree fix), loaded from git with its own defaults; left out when git cannot show it;
- `running_mean`: a constant, the mean of every outcome of the steps before (0.5 at the first);
- `last_step_mean`: a constant, the mean outcome of the step before (a harder constant under drift);
- `prompt_history`: `PromptHistoryPredictor` (each prompt's own past root outcomes, Beta(1, 1));
- `half`: the constant 0.5.

Per step and row: `brier`, `ece` (over all scored rollouts), `brier_roots` / `brier_prefixes`
(rollouts that started at a root / at a prefix), `brier_nodes` (the count-weighted Brier of the
backup targets of every non-terminal node, `calibration_report`'s figure: it also scores the
intermediate prefixes of bare rollouts, fair draws, so it covers prefixes on GRPO trees too), and for
learned rows `loss` / `loss_after`, `update_s` (wall time of the update) and, where the row reports
them, `calibration_slope` / `calibration_intercept`. `summary` averages each figure over the steps after `--warmup`
steps, with `max_brier`; `acceptance` checks that `shared`'s Brier is below 0.25 on every step after
the warm-up and below `running_mean`'s on average.

The same replay runs on the simulator (`trace_rl.research.sim`): batches of the allocation benchmark's `trace`
row (planned by a `shared` predictor learning online from them, `trace_rl.research.bench.run_batch`) and of its
`grpo` row, with the benchmark's predictor settings (`BenchConfig().predictor`, plus `--set`); each
step's figures are averaged over `--sim-seeds` worlds before the summary. Two 20-step runs and the
simulator take about a minute.

    python experiments/predictor_replay.py [RUN_DIR ...] [--warmup 5] [--set key=value ...]
        [--sim-seeds 2] [--sim-batches 40] [--previous REV] [--steps]

RUN_DIR is a `trace-rl train` run folder (`trees/step_XXXX.jsonl`). Prints one JSON object; with
`--steps` it holds every step's figures too.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trace_rl.core.tree import RolloutTree, read_jsonl
from trace_rl.infra.config import from_dict, set_dotted
from trace_rl.predictor import (
    HashedNgramPredictor,
    PredictorConfig,
    PromptHistoryPredictor,
    backup_targets,
    brier_score,
    build_predictor,
    expected_calibration_error,
)
from trace_rl.research.bench import BenchConfig, run_batch
from trace_rl.research.sim import LatentTreeSimulator

PREVIOUS = "145a511"
"""The last commit before the real-tree fix: its HashedNgramPredictor is the `shared_previous` row."""
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- rows


class _Constant:
    """A constant estimate learned from the outcomes (leaf rewards) of earlier steps."""

    def __init__(self, mode: str) -> None:
        self.mode, self.sums, self.counts = mode, [], []

    def predict(self, histories: Sequence[Any]) -> np.ndarray:
        if self.mode == "half" or not self.counts:
            return np.full(len(histories), 0.5)
        if self.mode == "last":
            return np.full(len(histories), self.sums[-1] / self.counts[-1])
        return np.full(len(histories), sum(self.sums) / sum(self.counts))

    def observe(self, trees: Sequence[RolloutTree]) -> None:
        rewards = np.concatenate([t.leaf_rewards() for t in trees]) if trees else np.zeros(0)
        if rewards.size:
            self.sums.append(float(rewards.sum()))
            self.counts.append(int(rewards.size))


def previous_predictor_class(rev: str) -> type | None:
    """`HashedNgramPredictor` as it was at commit `rev`, imported from `git show`; None when git cannot show it."""
    try:
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:src/trace_rl/predictor/hashed.py"], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    folder = Path(tempfile.mkdtemp(prefix="predictor_replay_"))
    path = folder / f"hashed_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"_hashed_{rev}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module.HashedNgramPredictor


def make_rows(config: PredictorConfig, previous: type | None, previous_config: dict[str, Any], seed: int) -> dict[str, Any]:
    rows: dict[str, Any] = {"shared": build_predictor("shared", config, seed=seed)}  # as training builds it (`guard`)
    if previous is not None:
        module = sys.modules[previous.__module__]
        known = {f.name for f in dataclasses.fields(module.PredictorConfig)}
        flat = {**{k: v for k, v in previous_config.items() if k != "advanced"}, **previous_config.get("advanced", {})}  # code from before `advanced`
        rows["shared_previous"] = previous(module.PredictorConfig(**{k: v for k, v in flat.items() if k in known}), seed=seed)
    rows["running_mean"] = _Constant("mean")
    rows["last_step_mean"] = _Constant("last")
    rows["prompt_history"] = PromptHistoryPredictor()
    rows["half"] = _Constant("half")
    return rows


# ---------------------------------------------------------------- replay


def _queries(trees: Sequence[RolloutTree]) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray]:
    """Distinct start nodes (tree, node), and per rollout: index of its start node and its outcome."""
    starts: dict[tuple[int, int], int] = {}
    which, outcomes = [], []
    for index, tree in enumerate(trees):
        for leaf in tree.leaves():
            key = (index, tree.nodes[int(leaf)].rollout_start)
            which.append(starts.setdefault(key, len(starts)))
            outcomes.append(float(tree.nodes[int(leaf)].reward))
    return list(starts), np.array(which, dtype=np.int64), np.array(outcomes, dtype=np.float64)


def _figures(p: np.ndarray, y: np.ndarray, at_root: np.ndarray) -> dict[str, float]:
    out = {"brier": brier_score(p, y), "ece": expected_calibration_error(p, y)}
    for name, mask in (("roots", at_root), ("prefixes", ~at_root)):
        if mask.any():
            out[f"brier_{name}"] = brier_score(p[mask], y[mask])
    return out


def replay(steps: Sequence[Sequence[RolloutTree]], rows: dict[str, Any]) -> list[dict[str, Any]]:
    """Score every row on each step before it learns from it; one dict per step."""
    per_step = []
    for trees in steps:
        starts, which, y = _queries(trees)
        if not starts:
            continue
        histories = [trees[i].history(n) for i, n in starts]
        at_root = np.array([n == 0 for _, n in starts])[which]
        node_histories, node_y, node_w = backup_targets(trees)
        figures: dict[str, dict[str, float]] = {}
        for name, row in rows.items():
            p = np.asarray(row.predict(histories), dtype=np.float64)[which]
            figures[name] = _figures(p, y, at_root)
            figures[name]["brier_nodes"] = brier_score(row.predict(node_histories), node_y, node_w)
        for name, row in rows.items():
            if isinstance(row, _Constant):
                row.observe(trees)
                continue
            begin = time.perf_counter()
            metrics = row.update(node_histories, node_y, node_w)
            figures[name]["update_s"] = time.perf_counter() - begin
            for key in ("loss", "loss_after", "calibration_slope", "calibration_intercept"):
                if f"predictor/{key}" in metrics:
                    figures[name][key] = float(metrics[f"predictor/{key}"])
        per_step.append(
            {
                "rollouts": int(y.size),
                "from_prefixes": int((~at_root).sum()),
                "success_rate": float(y.mean()),
                "rows": figures,
            }
        )
    return per_step


def summarise(per_step: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Mean of each figure over the steps after `warmup`, `max_brier`, and the acceptance check."""
    kept = per_step[warmup:]
    if not kept:
        return {"steps": len(per_step), "scored_steps": 0}
    names = list(kept[0]["rows"])
    summary: dict[str, Any] = {}
    for name in names:
        figures: dict[str, list[float]] = {}
        for step in kept:
            for key, value in step["rows"][name].items():
                figures.setdefault(key, []).append(value)
        summary[name] = {key: float(np.mean(values)) for key, values in figures.items()}
        summary[name]["max_brier"] = float(max(step["rows"][name]["brier"] for step in kept))
    out: dict[str, Any] = {
        "steps": len(per_step),
        "scored_steps": len(kept),
        "success_rate": float(np.mean([s["success_rate"] for s in kept])),
        "summary": summary,
    }
    if "shared" in summary and "running_mean" in summary:
        shared, mean = summary["shared"], summary["running_mean"]
        out["acceptance"] = {
            "brier_below_quarter_every_step": shared["max_brier"] < 0.25,
            "beats_running_mean": shared["brier"] < mean["brier"],
            "shared_brier": shared["brier"],
            "running_mean_brier": mean["brier"],
        }
    if "shared_previous" in summary and "acceptance" in out:
        out["acceptance"]["previous_brier"] = summary["shared_previous"]["brier"]
    return out


# ---------------------------------------------------------------- sources


def run_steps(run_dir: Path) -> list[list[RolloutTree]]:
    files = sorted((run_dir / "trees").glob("step_*.jsonl"))
    if not files:
        raise SystemExit(f"{run_dir}: no trees/step_*.jsonl")
    return [read_jsonl(f) for f in files]


def sim_steps(row: str, seed: int, batches: int, config: PredictorConfig) -> list[list[RolloutTree]]:
    """`batches` batches of the allocation benchmark's `row`, planned by that row's own learning predictor."""
    cfg = BenchConfig()
    sim = LatentTreeSimulator(cfg.sim, seed=seed)
    planner = HashedNgramPredictor(config, seed=seed)
    steps = []
    for batch in range(batches):
        prompts = sim.sample_prompts(cfg.prompts_per_batch, np.random.default_rng([seed, batch, 1]))
        trees = run_batch(row, prompts, sim, cfg, np.random.default_rng([seed, batch, 2]), planner)
        planner.update(*backup_targets(trees))
        steps.append(trees)
    return steps


def predictor_config(base: dict[str, Any], overrides: dict[str, Any]) -> PredictorConfig:
    """`base` (a PredictorConfig as a dict) with each dotted override (`advanced.replay_batches`) set."""
    data = copy.deepcopy(base)
    for key, value in overrides.items():
        set_dotted(data, key, value)
    return from_dict(PredictorConfig, data, prefix="predictor.")


def _parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set takes key=value, got {item!r}")
        out[key] = json.loads(value) if value not in ("", "none") else None
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="trace-rl run folders")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the summary (default 5)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a PredictorConfig key of the `shared` row, dotted (advanced.replay_batches=0; JSON value)")
    parser.add_argument("--sim-seeds", type=int, default=2, help="simulator worlds (0: no simulator section)")
    parser.add_argument("--sim-batches", type=int, default=40, help="simulator batches per world (default 40)")
    parser.add_argument("--previous", default=PREVIOUS, help="git revision of the `shared_previous` row ('none': leave it out)")
    parser.add_argument("--steps", action="store_true", help="include every step's figures")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    overrides = _parse_overrides(args.set)
    previous = None if args.previous == "none" else previous_predictor_class(args.previous)
    result: dict[str, Any] = {"bench": "predictor_replay", "warmup": args.warmup, "overrides": overrides, "previous": args.previous if previous else None}
    result["runs"] = {}
    for run_dir in args.runs:
        steps = run_steps(run_dir)
        rows = make_rows(predictor_config({}, overrides), previous, {}, seed=0)
        per_step = replay(steps, rows)
        entry = summarise(per_step, args.warmup)
        if args.steps:
            entry["per_step"] = per_step
        result["runs"][str(run_dir)] = entry
    bench_predictor = dataclasses.asdict(BenchConfig().predictor)
    result["sim"] = {}
    for row in ("trace", "grpo") if args.sim_seeds else ():
        per_seed = []
        for seed in range(args.sim_seeds):
            config = predictor_config(bench_predictor, overrides)
            steps = sim_steps(row, seed, args.sim_batches, config)
            per_step = replay(steps, make_rows(config, previous, bench_predictor, seed=seed))
            per_seed.append(per_step)
        # Average the seeds step by step, then summarise like a run.
        merged = [
            {
                "rollouts": int(np.sum([s[i]["rollouts"] for s in per_seed])),
                "from_prefixes": int(np.sum([s[i]["from_prefixes"] for s in per_seed])),
                "success_rate": float(np.mean([s[i]["success_rate"] for s in per_seed])),
                "rows": {
                    name: {
                        key: float(np.mean([s[i]["rows"][name][key] for s in per_seed if key in s[i]["rows"][name]]))
                        for key in per_seed[0][i]["rows"][name]
                    }
                    for name in per_seed[0][i]["rows"]
                },
            }
            for i in range(min(len(s) for s in per_seed))
        ]
        entry = summarise(merged, args.warmup)
        entry["seeds"] = args.sim_seeds
        if args.steps:
            entry["per_step"] = merged
        result["sim"][row] = entry
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
