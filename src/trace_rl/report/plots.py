"""Training curves as PNG files: one line per method, the mean over its seeds with a min–max band.

Input is one or more run folders (`metrics.jsonl`, one JSON object a line with `step`, or its copy packed
in a committed result's `runs.tar.xz`: `trace_rl.storage.rundir.read_run_file`). Lines that
share a step are merged, later lines winning, so a resumed run or a separate eval line for the same
step reads as one row. A key a run never logged (an older version, a method without a predictor) is
simply absent from the figures; a figure with no data at all is not written.

Drawing uses matplotlib's object API on a bare `Figure` (no pyplot, no backend switch), so it works
headless and never changes the caller's matplotlib state. matplotlib is the `report` extra.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from trace_rl.planning.methods import METHODS
from trace_rl.storage.rundir import (
    START,
    atomic_write,
    read_metrics,
    run_file_exists,
    run_folders,
)

METHOD_ORDER = tuple(METHODS)
"""The registry's method names, in its order; they keep one colour each across every figure and table."""

Z95 = 1.96
"""Normal quantile of a two-sided 95% interval (one run's evaluation: hundreds of samples)."""

ROLLOUTS_KEY = "rollout/rollouts_total"
"""Cumulative rollouts (leaves) so far: the x axis of accuracy-per-budget curves."""

TOKENS_KEY = "rollout/tokens_total"
"""Cumulative generated tokens so far: the x axis of accuracy-per-token curves."""

CLOCK_KEYS = ("timing_s/step", "timing_s/eval")
"""A run's wall-clock, summed over its rows: its steps and its evaluations (the start's, at step 0,
is shared by every method of a seed and left out)."""

X_LABELS = {
    "step": "training step",
    "rollouts": "rollouts spent (cumulative)",
    "tokens": "generated tokens (cumulative)",
    "minutes": "wall-clock minutes (steps and evaluations, cumulative)",
}

XAxis = Literal["step", "rollouts", "tokens", "minutes"]


@dataclass(frozen=True)
class RunMetrics:
    """One run folder's `metrics.jsonl`, merged by step, numeric values only."""

    path: Path
    method: str
    rows: dict[int, dict[str, float]]
    """step -> {key: finite value}; steps ascending."""

    def keys(self) -> set[str]:
        return {key for row in self.rows.values() for key in row}


@dataclass(frozen=True)
class Panel:
    """One PNG: some metric keys of every method against steps or cumulative rollouts."""

    name: str
    """File stem: `<name>.png`."""
    title: str
    keys: tuple[tuple[str, str], ...]
    """(metric key, legend label); each key gets its own line style."""
    ylabel: str
    x: XAxis = "step"
    unit_range: bool = False
    """Fix the y axis to [0, 1] (shares). Accuracies keep matplotlib's range: on [0, 1] a 5-point gain
    between two curves near 0.2 was too thin to read."""
    bars: str = "each evaluation's own sampling noise"
    """What a single run's error bars (1.96 x a key's logged `<key>_se`) are the 95% interval of."""


PANELS: tuple[Panel, ...] = (
    Panel("reward", "Training reward (mean leaf reward)", (("critic/score/mean", "reward"),), "mean reward"),
    Panel(
        "accuracy",
        "Held-out accuracy",
        (("val/accuracy_greedy", "greedy"), ("val/accuracy_sampled", "sampled")),
        "accuracy",
    ),
    Panel(
        "accuracy_vs_rollouts",
        "Held-out accuracy per rollout spent",
        (("val/accuracy_greedy", "greedy"), ("val/accuracy_sampled", "sampled")),
        "accuracy",
        x="rollouts",
    ),
    Panel(
        "accuracy_vs_tokens",
        "Held-out accuracy per generated token",
        (("val/accuracy_greedy", "greedy"), ("val/accuracy_sampled", "sampled")),
        "accuracy",
        x="tokens",
    ),
    Panel(
        "accuracy_vs_minutes",
        "Held-out accuracy per minute of wall-clock",
        (("val/accuracy_greedy", "greedy"), ("val/accuracy_sampled", "sampled")),
        "accuracy",
        x="minutes",
    ),
    Panel(
        "effective_ratio",
        "Effective ratio (prompts with mixed outcomes)",
        (("tree/effective_ratio", "of the prompts sampled"), ("tree/effective_per_candidate", "of every candidate prompt")),
        "share of prompts",
        unit_range=True,
    ),
    Panel(
        "mixed_budget_share",
        "Budget in mixed-outcome trees",
        (("tree/mixed_budget_share", "mixed budget share"),),
        "share of rollouts",
        unit_range=True,
    ),
    Panel(
        "unmixed_budget",
        "Budget in trees that never mixed (cannot teach)",
        (("tree/failed_budget_share", "all failed"), ("tree/solved_budget_share", "all succeeded")),
        "share of rollouts",
        unit_range=True,
    ),
    Panel(
        "most_leaves_unmixed",
        "Most rollouts one prompt got without mixing (0 for 12 reads 12)",
        (("tree/most_leaves_unmixed", "rollouts"),),
        "rollouts",
    ),
    Panel(
        "per_ktoken",
        "What 1,000 generated tokens buy (rollout.budget_unit: tokens spends them)",
        (("tree/mixed_leaves_per_ktoken", "leaves in mixed trees"), ("tree/mixed_prompts_per_ktoken", "mixed prompts")),
        "per 1,000 generated tokens",
    ),
    Panel(
        "tool_errors",
        "Tool calls that failed (a server that went down reads 1)",
        (("tool/error_rate", "any error"), ("tool/unavailable_rate", "tool unavailable or timed out")),
        "share of tool calls",
        unit_range=True,
    ),
    Panel(
        "calibration",
        "Success predictor calibration (lower is better)",
        (
            ("predictor/brier", "Brier"),
            ("predictor/ece", "ECE"),
            ("predictor/brier_constant", "Brier, running-mean constant"),
            ("predictor/brier_history", "Brier, per-prompt history"),
        ),
        "error",
        bars="each step's Brier over its prompts",
    ),
    Panel(
        "calibration_census",
        "Success predictor on every estimate it learns from (lower is better)",
        (
            ("predictor/brier_census", "Brier"),
            ("predictor/brier_constant_census", "Brier, running-mean constant"),
            ("predictor/brier_history_census", "Brier, per-prompt history"),
        ),
        "error",
    ),
    Panel(
        "calibration_stage2",
        "Stage 2's estimates against the continuations it started (lower is better)",
        (
            ("stage2/brier_predictor", "Brier, predictor (the paper's value)"),
            ("stage2/brier_evidence", "Brier, evidence posterior"),
        ),
        "error",
    ),
)

_LINESTYLES = ("-", "--", ":", "-.")
_LEGEND_WIDTH = 20
"""Characters a legend line holds in the figure's right margin (0.24 of 7.6 inches at font size 8)."""


# ---------------------------------------------------------------- reading run folders


def load_run(run_dir: str | Path, method: str | None = None) -> RunMetrics:
    """Read a run folder's metrics. `method` defaults to the `method` the trainer logged, else the folder name."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not run_file_exists(path):
        raise FileNotFoundError(f"{run_dir} is not a run folder: {path} is missing")
    rows: dict[int, dict[str, float]] = {}
    logged_method = None
    for record in read_metrics(path):
        step = int(record["step"])
        row = rows.setdefault(step, {})
        for key, value in record.items():
            if key == "method" and isinstance(value, str):
                logged_method = value
            elif key != "step" and _is_number(value):
                row[key] = float(value)
    return RunMetrics(path=run_dir, method=method or logged_method or run_dir.name, rows=dict(sorted(rows.items())))


def find_runs(path: str | Path) -> dict[str, list[Path]]:
    """Run folders by method: a run folder itself, or a comparison folder `DIR/<method>/seed_<k>/`.

    Methods come in DESIGN.md's order, then any others alphabetically; seeds in numeric order.
    Raises FileNotFoundError when `path` holds no run folder.
    """
    path = Path(path)
    runs = run_folders(path)  # packed runs (a committed result) have no folder on disk
    if not runs and not path.is_dir():
        raise FileNotFoundError(f"{path} is not a folder")
    if path in runs:
        return {load_run(path).method: [path]}
    found: dict[str, list[Path]] = {}
    for run in runs:
        parts = run.relative_to(path).parts
        if len(parts) == 1:  # DIR/<method>/ with a single run
            found[parts[0]] = [run]
        elif len(parts) == 2 and path / parts[0] not in runs:  # a method folder that is a run has no seeds
            found.setdefault(parts[0], []).append(run)
    found = {method: sorted(seeds, key=_seed_order) for method, seeds in found.items()}
    if not found:
        raise FileNotFoundError(
            f"{path} holds no run: expected {path}/metrics.jsonl or {path}/<method>/seed_<k>/metrics.jsonl"
        )
    return {name: found[name] for name in sorted(found, key=method_sort_key)}


def method_sort_key(name: str) -> tuple[int, str]:
    return (METHOD_ORDER.index(name), "") if name in METHOD_ORDER else (len(METHOD_ORDER), name)


METHOD_COLORS = {
    "grpo": "#7f7f7f",  # the baseline in grey
    "prompt_only": "#1f77b4",
    "knapsack": "#2ca02c",
    "pcl": "#e377c2",
    "random_tree": "#ff7f0e",
    "dapo": "#8c564b",
    "brace": "#bcbd22",
    "trace_stage1": "#9467bd",
    "trace_stage2": "#17becf",
    "trace": "#d62728",  # red, drawn last
}
_OTHER_COLORS = (
    "#393b79", "#637939", "#8c6d31", "#7b4173", "#17becf", "#1f77b4", "#ff7f0e", "#8c564b",
    "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5",
)


def method_colors(names: Sequence[str]) -> dict[str, str]:
    """A fixed colour per registered method (so `trace` looks the same in every figure). A variant
    named after one (`grpo_8`, `dapo_8x4`) takes its method's colour when that method is not in the
    figure, else the first of 16 spare colours no row of the figure has yet, so no two rows share one
    until the spares run out."""
    colors = {name: METHOD_COLORS[name] for name in names if name in METHOD_COLORS}
    for name in names:
        if name in colors:
            continue
        used = set(colors.values())
        bases = [m for m in METHOD_COLORS if name.startswith(m + "_")]
        base = METHOD_COLORS[max(bases, key=len)] if bases else None
        free = [c for c in _OTHER_COLORS if c not in used]
        colors[name] = base if base is not None and base not in used else free[0] if free else _OTHER_COLORS[len(colors) % len(_OTHER_COLORS)]
    return {name: colors[name] for name in names}


# ---------------------------------------------------------------- aggregation over seeds


@dataclass(frozen=True)
class Curve:
    """One method's curve for one key: the mean over runs, with the min and max, at each x."""

    x: np.ndarray  # (T,)
    mean: np.ndarray  # (T,)
    low: np.ndarray  # (T,)
    high: np.ndarray  # (T,)
    runs: int
    """Runs that logged this key at least once."""
    interval: np.ndarray | None = None
    """(T,) half-width of a single run's 95% interval at each x, 1.96 x the `<key>_se` it logged there
    (NaN where it logged none); None for several runs (their band shows the spread) or without an SE.
    It is the evaluation's own noise: two points of one run on the same held-out tasks differ by more
    than it only when the policy changed."""
    window: int = 1
    """Points each drawn value averages (`smoothed`); 1: the values themselves."""


def curve(runs: Sequence[RunMetrics], key: str, x: XAxis = "step") -> Curve | None:
    """Aggregate `key` over runs, aligned on step; None when no run logged it.

    With `x="rollouts"` or `"tokens"` each point's x is the runs' mean cumulative rollouts or generated
    tokens at that step, carried forward from the last step that logged it (eval lines need not repeat
    it; before any, 0). Runs without the counter (or, for minutes, without step times) are left out. With `x="minutes"` it
    is the wall-clock the run's rows logged up to that step (`CLOCK_KEYS`), so a run whose step times
    were corrected (paused time taken out: `trace_rl.research.study`) draws its corrected clock.
    """
    per_step: dict[int, list[tuple[float, float]]] = {}
    se_by_step: dict[int, float] = {}
    used = 0
    counter = {"rollouts": ROLLOUTS_KEY, "tokens": TOKENS_KEY}.get(x)
    needed = {"rollouts": ROLLOUTS_KEY, "tokens": TOKENS_KEY, "minutes": CLOCK_KEYS[0]}.get(x)
    for run in runs:
        if needed is not None and needed not in run.keys():
            continue
        spent, logged = 0.0, False
        for step, row in run.rows.items():
            if counter is not None:
                spent = row.get(counter, spent)
            elif x == "minutes" and step > 0:
                spent += sum(row.get(k, 0.0) for k in CLOCK_KEYS) / 60.0
            if key in row:
                per_step.setdefault(step, []).append((float(step) if x == "step" else spent, row[key]))
                logged = True
                if f"{key}_se" in row:
                    se_by_step[step] = row[f"{key}_se"]
        used += logged
    if not per_step:
        return None
    steps = sorted(per_step)
    interval = None
    if used == 1 and se_by_step:
        interval = np.array([Z95 * se_by_step.get(s, math.nan) for s in steps])
    xs = np.array([np.mean([p[0] for p in per_step[s]]) for s in steps])
    ys = [np.array([p[1] for p in per_step[s]]) for s in steps]
    return Curve(
        x=xs,
        mean=np.array([v.mean() for v in ys]),
        low=np.array([v.min() for v in ys]),
        high=np.array([v.max() for v in ys]),
        runs=used,
        interval=interval,
    )


# ---------------------------------------------------------------- drawing


def plot_runs(run_dirs_by_method: Mapping[str, Sequence[str | Path]], out_dir: str | Path) -> list[Path]:
    """Write one PNG per panel in `PANELS` that has data; returns the files written, in panel order.

    `run_dirs_by_method` maps a method name to its run folders (its seeds). Figures show each
    method's mean over seeds, with a shaded min–max band when it has two or more seeds.
    """
    runs = {method: [load_run(path, method) for path in paths] for method, paths in run_dirs_by_method.items()}
    return plot_metrics(runs, out_dir)


def _start_from_react(runs: dict[str, list[RunMetrics]]) -> dict[str, list[RunMetrics]]:
    """A comparison's `react` folder (its starting policy, evaluated at step 0 with no rollouts spent:
    `trace_rl.research.compare`) becomes the first point of every method's run of the same seed."""
    starts = {run.path.name: run.rows.get(0) for run in runs.get(START, [])}
    if not starts:
        return runs
    return {
        method: [
            RunMetrics(run.path, run.method, {0: starts[run.path.name], **run.rows}) if starts.get(run.path.name) and 0 not in run.rows else run
            for run in method_runs
        ]
        for method, method_runs in runs.items()
        if method != START
    }


def plot_metrics(runs: Mapping[str, Sequence[RunMetrics]], out_dir: str | Path) -> list[Path]:
    """`plot_runs` for metrics already loaded with `load_run` (a `START` row becomes every curve's first point)."""
    runs = {method: list(method_runs) for method, method_runs in _start_from_react(dict(runs)).items() if method_runs}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    colors = method_colors(list(runs))
    written = []
    for panel in PANELS:
        curves = {
            (method, key): smoothed(c)
            for method, method_runs in runs.items()
            for key, _ in panel.keys
            if (c := curve(method_runs, key, panel.x)) is not None
        }
        if curves:
            written.append(_draw(panel, curves, colors, out_dir / f"{panel.name}.png"))
    return written


SMOOTHING = 10
"""A curve of n points is drawn as its trailing moving average over n // SMOOTHING points (at least 1):
a per-step figure of a 100-step run over 10 steps, where eight methods' raw steps were a tangle no
one could read; evaluations, a handful of points, are drawn as they are."""


def smoothed(c: Curve) -> Curve:
    """`c` as its trailing moving average (`SMOOTHING`): each point the mean of itself and the points
    before it in the window (fewer at the start), mean and band alike; single-run error bars, which
    belong to single points, are dropped from a smoothed curve."""
    window = max(1, len(c.x) // SMOOTHING)
    if window == 1:
        return c

    def average(values: np.ndarray) -> np.ndarray:
        total = np.cumsum(values)
        total[window:] = total[window:] - total[:-window]
        return total / np.minimum(np.arange(1, len(values) + 1), window)

    return Curve(x=c.x, mean=average(c.mean), low=average(c.low), high=average(c.high), runs=c.runs, interval=None, window=window)


def plot_path(path: str | Path, out_dir: str | Path) -> list[Path]:
    """`plot_runs` for a run folder or a comparison folder (see `find_runs`)."""
    return plot_runs(find_runs(path), out_dir)


def _wrap_name(name: str, width: int = _LEGEND_WIDTH) -> str:
    """A method's name on lines of at most `width` characters, broken after its underscores where it can be."""
    lines = [""]
    for part in re.findall(r"[^_]*_|[^_]+", name):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
    return "\n".join(textwrap.fill(line, width, break_on_hyphens=False) for line in lines)


def panel_title(panel: Panel, max_seeds: int, intervals: bool, window: int = 1) -> str:
    """The panel's title and what its bands or bars show: the spread over seeds, or one run's 95%
    intervals, and the moving average's window where its curves were smoothed."""
    average = f"{window}-step moving average" if window > 1 else ""
    if max_seeds > 1:
        return f"{panel.title}\n" + ", ".join(filter(None, [f"mean over seeds (up to {max_seeds}), band: min–max", average]))
    if intervals:
        return f"{panel.title}\nbars: 95% interval of {panel.bars}"
    return f"{panel.title}\n{average}" if average else panel.title


def _draw(panel: Panel, curves: dict[tuple[str, str], Curve], colors: dict[str, str], path: Path) -> Path:
    Figure, Line2D, MaxNLocator = _matplotlib()
    fig = Figure(figsize=(7.6, 3.8), dpi=110)
    fig.subplots_adjust(
        left=0.09, right=0.76, bottom=0.13, top=0.85
    )  # fixed margins: a layout engine doubles the draw time
    ax = fig.add_subplot()
    styles = {key: _LINESTYLES[i % len(_LINESTYLES)] for i, (key, _) in enumerate(panel.keys)}
    max_seeds = max(c.runs for c in curves.values())
    for (method, key), c in curves.items():
        color = colors[method]
        marker = "o" if len(c.x) <= 40 else None
        ax.plot(c.x, c.mean, linestyle=styles[key], color=color, marker=marker, markersize=3.5, linewidth=1.8)
        if c.runs >= 2 and len(c.x) > 1:
            ax.fill_between(c.x, c.low, c.high, color=color, alpha=0.15, linewidth=0)
        elif c.runs >= 2:
            ax.errorbar(c.x, c.mean, yerr=[c.mean - c.low, c.high - c.mean], color=color, capsize=3, linewidth=1)
        elif c.interval is not None and (shown := np.isfinite(c.interval)).any():
            ax.errorbar(c.x[shown], c.mean[shown], yerr=c.interval[shown], fmt="none", color=color, capsize=3, linewidth=1)
    methods = list(dict.fromkeys(method for method, _ in curves))
    handles = [Line2D([], [], color=colors[m], linewidth=2, label=_wrap_name(m)) for m in methods]
    used_keys = [(key, label) for key, label in panel.keys if any(k == key for _, k in curves)]
    if len(used_keys) > 1:
        # wrapped: the legend sits in the right margin, where a long label was cut off at the edge
        handles += [Line2D([], [], color="black", linestyle=styles[k], label=textwrap.fill(label, _LEGEND_WIDTH)) for k, label in used_keys]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    window = max(c.window for c in curves.values())
    ax.set_title(panel_title(panel, max_seeds, any(c.interval is not None for c in curves.values()), window), fontsize=10)
    ax.set_xlabel(X_LABELS[panel.x])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if (formatter := _thousands(max((float(np.nanmax(c.x)) for c in curves.values() if len(c.x)), default=0.0))) is not None:
        ax.xaxis.set_major_formatter(formatter)
    ax.set_ylabel(panel.ylabel)
    if panel.unit_range:
        ax.set_ylim(-0.03, 1.03)
    ax.grid(True, alpha=0.3)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))  # a full disk leaves no 0-byte PNG
    return path


def plot_contrasts(result: Mapping[str, Any], path: str | Path) -> Path | None:
    """The forest plot of a pre-registered study (`trace_rl.research.study.study`): each row's final
    accuracy minus the reference's, then each named contrast, as the mean difference paired by seed
    with its 95% t interval and every seed's own difference as a dot. Curves of a dozen rows, each
    with its band, overlap past reading; this is the figure the analysis is about. None when no row
    or contrast has a difference."""
    Figure, _, _ = _matplotlib()
    reference = result["reference"]
    entries = [(f"{row} − {reference}", figures["vs_reference"], row) for row, figures in result["rows"].items() if figures.get("vs_reference")]
    named = [(f"{c['a']} − {c['b']}", c, c["a"]) for c in result.get("contrasts", {}).values() if c.get("seeds")]
    if not entries and not named:
        return None
    colors = method_colors(list(dict.fromkeys(row for _, _, row in entries + named)))
    rows = entries + named
    labels = [f"{label} ({c['seeds']} seeds)" for label, c, _ in reversed(rows)]
    height = 1.1 + 0.3 * len(rows)  # inches: 0.6 under the axes, 0.5 above, 0.3 a line
    fig = Figure(figsize=(7.6, height), dpi=110)
    # A contrast's label is as long as its two rows' names: the margin grows to fit the longest
    # (0.07 inch a character at 8 points), at least 0.3 of the width.
    left = max(0.3, min(0.6, (0.2 + 0.07 * max(map(len, labels))) / 7.6))
    fig.subplots_adjust(left=left, right=0.97, bottom=0.6 / height, top=1 - 0.5 / height)
    ax = fig.add_subplot()
    for i, (label, c, row) in enumerate(rows):
        y = len(rows) - 1 - i
        seeds = np.array(list(c["per_seed"].values()), dtype=float)
        ax.scatter(seeds, np.full(seeds.size, y), s=10, color=colors[row], alpha=0.5, linewidths=0)
        if math.isfinite(c["ci95"]):
            ax.errorbar([c["mean"]], [y], xerr=[[c["ci95"]], [c["ci95"]]], fmt="o", color=colors[row], capsize=3, markersize=5, linewidth=1.6)
        else:  # one seed: no interval to draw
            ax.plot([c["mean"]], [y], "o", color=colors[row], markersize=5)
    if entries and named:
        ax.axhline(len(named) - 0.5, color="grey", linewidth=0.8)
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_xlabel(f"difference in final {result['accuracy']}, paired by seed")
    ax.set_title("Paired differences: mean and 95% t interval, dots: each seed", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png"))
    return Path(path)


def _thousands(largest: float) -> Any | None:
    """Tick labels such as 40k and 1.2M for an axis that reaches 10,000 (generated tokens), whose plain
    labels ran into each other; None for a shorter axis (steps, minutes), labelled as it is."""
    if largest < 10_000:
        return None
    from matplotlib.ticker import EngFormatter

    return EngFormatter(sep="")


def _matplotlib() -> tuple[Any, Any, Any]:
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import MaxNLocator
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "trace-rl report plots need matplotlib: pip install 'trace-rl[report]' (or pip install matplotlib)"
        ) from exc
    return Figure, Line2D, MaxNLocator


def _seed_order(path: Path) -> tuple[int, str]:
    match = re.search(r"(\d+)$", path.name)
    return (int(match.group(1)) if match else 1 << 30, path.name)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
