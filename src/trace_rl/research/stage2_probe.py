"""What Stage 2 bought, measured on a run's saved trees: did the prefixes it chose mix at the rate its
values predicted, and does the update use the contrast they made?

Stage 2 gives prefix c of a bare rollout with outcome r_c some k_c continuations, valuing it by the chance
that at least one of them flips that outcome, 1 − (1 − |r_c − v_c|)^k_c, where v_c is the success estimate
it allocated with (`stage2_value` where the run valued prefixes by the evidence posterior, else the
predictor's `predicted`). The saved trees say what happened: a continuation's leaf carries
`rollout_start` = its prefix, the bare rollout's leaf `rollout_start` = 0. So per chosen prefix the probe
sets the predicted chance of a flip beside whether one came (calibration by bins of the prediction),
and the predicted per-continuation flip rate beside the observed one. (A run that valued prefixes by
the posterior expectation, `rollout.stage2_expected`, records the posterior's mean as `stage2_value`;
the probe's prediction for it is the formula at that mean, which overstates what the expectation
with the correlation fitted on the run's groups predicted.)

The update side: the run's advantage estimator recomputed on the same trees. A continuation's tokens
are those of nodes a continuation made (`rollout_start` > 0); the advantage mass is Σ weight · |A| ·
policy tokens over nodes, and for TRACE's estimator the prefix-level term (the part Stage 2 adds over
GRPO's root-level contrast, `trace_rl.core.advantage.trace_contrast`) is the difference to the same
estimator with `prefix_coef` 0. Where continuations hold a share of the tokens but little of the
mass, the tree was bought and not used.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trace_rl.core.advantage import get_estimator
from trace_rl.core.tree import RolloutTree, read_jsonl
from trace_rl.planning.methods import METHODS
from trace_rl.storage.rundir import RunDir

BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
"""Edges of the calibration bins of a prefix's predicted chance of a flip."""


def prefix_records(tree: RolloutTree, threshold: float = 0.5) -> list[dict[str, float]]:
    """One record per prefix Stage 2 continued (a non-root node with `budget` > 0): the estimate it
    allocated with, the bare outcome r, the continuations asked for (k) and finished (n), how many of
    those flipped r, and the predicted chance of at least one flip."""
    leaves = [node for node in tree.nodes if node.is_terminal]
    records = []
    for node in tree.nodes:
        if node.parent is None or node.budget <= 0:
            continue
        v = node.stage2_value if node.stage2_value is not None else node.predicted
        below = _below(tree, node.id)
        bare = [leaf for leaf in leaves if leaf.id in below and leaf.rollout_start == 0]
        own = [leaf for leaf in leaves if leaf.rollout_start == node.id]
        if v is None or len(bare) != 1:
            continue  # not a prefix of one bare rollout, or no estimate recorded: nothing to check against
        r = float(bare[0].reward > threshold)
        flip = abs(r - float(v))
        flips = sum(float(leaf.reward > threshold) != r for leaf in own)
        records.append({
            "v": float(v), "r": r, "k": float(node.budget), "n": float(len(own)), "flips": float(flips),
            "predicted": 1.0 - (1.0 - flip) ** len(own) if own else math.nan, "flip_rate_predicted": flip,
        })
    return records


def _below(tree: RolloutTree, node_id: int) -> set[int]:
    found, stack = set(), [node_id]
    while stack:
        current = stack.pop()
        found.add(current)
        stack.extend(tree.nodes[current].children)
    return found


def advantage_mass(trees: Sequence[RolloutTree], estimator: str = "trace", options: dict[str, Any] | None = None) -> dict[str, float]:
    """Where the update's advantage mass lies: the share of policy tokens (each counted by its loss
    weight) that continuations wrote, the share of Σ weight · |A| · tokens on them, and for `trace` the
    share of the whole mass that its prefix-level term carries (A with that term less A without it)."""
    options = dict(options or {})
    fn = get_estimator(estimator)
    full = fn(trees, **options)
    root_only = fn(trees, **{**options, "prefix_coef": 0.0}) if estimator == "trace" else None
    tokens = continuation_tokens = mass = continuation_mass = prefix_mass = 0.0
    for index, tree in enumerate(trees):
        policy = np.array([sum(node.mask) for node in tree.nodes], dtype=np.float64)
        continued = np.array([node.rollout_start > 0 for node in tree.nodes])
        counted = full[index].weight * policy
        node_mass = counted * np.abs(full[index].advantage)
        tokens += float(counted.sum())
        continuation_tokens += float(counted[continued].sum())
        mass += float(node_mass.sum())
        continuation_mass += float(node_mass[continued].sum())
        if root_only is not None:
            prefix_mass += float((counted * np.abs(full[index].advantage - root_only[index].advantage)).sum())
    out = {
        "continuation_token_share": continuation_tokens / tokens if tokens else math.nan,
        "continuation_mass_share": continuation_mass / mass if mass else math.nan,
    }
    if root_only is not None:
        out["prefix_term_mass_share"] = prefix_mass / mass if mass else math.nan
    return out


def calibration(records: Iterable[dict[str, float]]) -> dict[str, Any]:
    """Predicted chance of a flip against the flips seen: overall, and by bin of the prediction."""
    rows = [r for r in records if r["n"] > 0]
    if not rows:
        return {"prefixes": 0}
    predicted = np.array([r["predicted"] for r in rows])
    seen = np.array([float(r["flips"] > 0) for r in rows])
    n = np.array([r["n"] for r in rows])
    rate = np.array([r["flip_rate_predicted"] for r in rows])
    bins = []
    for low, high in itertools.pairwise(BINS):
        inside = (predicted >= low) & ((predicted < high) | (high == BINS[-1]))
        if inside.any():
            bins.append({"low": low, "high": high, "prefixes": int(inside.sum()), "predicted": float(predicted[inside].mean()), "mixed": float(seen[inside].mean())})
    flips = np.array([r["flips"] for r in rows])
    return {
        "prefixes": len(rows),
        "continuations": float(n.sum()),
        "predicted_mixed": float(predicted.mean()),
        "mixed": float(seen.mean()),
        "brier": float(np.mean((predicted - seen) ** 2)),
        "brier_constant": float(np.mean((seen.mean() - seen) ** 2)),
        "flip_rate_predicted": float((rate * n).sum() / n.sum()),
        "flip_rate": float(flips.sum() / n.sum()),
        "bare_success_share": float(np.mean([r["r"] for r in rows])),
        "bins": bins,
    }


def probe_run(run_dir: str | Path, *, warmup: int = 5) -> dict[str, Any]:
    """The probe over a run's saved trees after `warmup` steps (its own estimator and success threshold)."""
    run = RunDir(run_dir)
    config = run.read_config()
    threshold = float((config.get("rollout") or {}).get("success_threshold", 0.5))
    train = config.get("train") or {}
    method = (config.get("rollout") or {}).get("method", "trace")
    estimator = train.get("advantage") or (METHODS[method].estimator if method in METHODS else "trace")
    records: list[dict[str, float]] = []
    mass = {"continuation_token_share": [], "continuation_mass_share": [], "prefix_term_mass_share": []}
    steps = 0
    for step, path in run.tree_files().items():
        if step <= warmup:
            continue
        trees = read_jsonl(path)
        steps += 1
        for tree in trees:
            records += prefix_records(tree, threshold)
        for key, value in advantage_mass(trees, estimator, train.get("advantage_options") or {}).items():
            mass[key].append(value)
    valued = "expected" if (config.get("rollout") or {}).get("stage2_expected") else "point"
    return {
        "run": str(run_dir), "steps": steps, "estimator": estimator, "valued_by": valued,
        **calibration(records),
        **{key: finite_mean(values) for key, values in mass.items() if values},
    }


def finite_mean(values: Sequence[float]) -> float:
    """The mean of the values that are not NaN (a run with no continuation has no share to give); NaN if none is."""
    finite = [v for v in values if not math.isnan(v)]
    return float(np.mean(finite)) if finite else math.nan


PROBE_COLUMNS = (
    ("prefixes", "prefixes continued (a run)", ".0f"),
    ("predicted_mixed", "predicted chance a prefix mixes", ".3f"),
    ("mixed", "prefixes that mixed", ".3f"),
    ("brier", "Brier", ".3f"),
    ("brier_constant", "Brier of the seen rate as a constant", ".3f"),
    ("flip_rate_predicted", "a continuation flips: predicted", ".3f"),
    ("flip_rate", "seen", ".3f"),
    ("continuation_token_share", "continuations' share of trained tokens", ".3f"),
    ("continuation_mass_share", "of the advantage mass", ".3f"),
    ("prefix_term_mass_share", "prefix term's share of the mass", ".3f"),
)
"""The probe's figures a results page shows, each row's mean over its seeds."""


def probe_markdown(result: dict[str, Any]) -> str:
    """The table of `scripts/results.py probe`'s result (`{"warmup", "rows": {row: {"seeds", "mean"}}}`),
    a row per method with its seeds' means, and what a row valued by the posterior expectation means."""
    lines = ["| row | seeds | " + " | ".join(title for _, title, _ in PROBE_COLUMNS) + " |", "|---" * (len(PROBE_COLUMNS) + 2) + "|"]
    expected = []
    for row, figures in result["rows"].items():
        mean = figures["mean"]
        cells = [format(mean[key], spec) if isinstance(mean.get(key), (int, float)) and math.isfinite(mean[key]) else "—" for key, _, spec in PROBE_COLUMNS]
        if any(seed.get("valued_by") == "expected" for seed in figures["seeds"].values()):
            expected.append(row)
            row += " *"
        lines.append(f"| {row} | {len(figures['seeds'])} | " + " | ".join(cells) + " |")
    lines += ["", f"Over the steps after the first {result['warmup']}, from the runs' saved trees."]
    if expected:
        lines.append(f"\\* {', '.join(expected)} valued prefixes by the posterior expectation of mixing; its predictions here are the "
                     "formula at the posterior mean, which overstate what it allocated by.")
    if result.get("from_saved_figures"):
        lines.append("Figures of " + ", ".join(result["from_saved_figures"]) + " as saved when each run finished (its trees are not kept).")
    return "\n".join(lines) + "\n"
