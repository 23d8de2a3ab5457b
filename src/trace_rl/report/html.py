"""`report.html` for a run folder or a comparison folder: tables, plots and the tree viewer in one file.

The page is self-contained (plots inlined as base64 PNG, viewer JS and data inline), so it can be
mailed or opened offline; the PNGs are also written next to it for slides and papers.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trace_rl.infra.config import ConfigError
from trace_rl.report.plots import (
    RunMetrics,
    find_runs,
    load_run,
    method_sort_key,
    plot_metrics,
)
from trace_rl.report.viewer import ViewerLimits, viewer_data, viewer_section
from trace_rl.rollout.collector import RolloutConfig
from trace_rl.storage.rundir import RunDir, atomic_write, read_run_file, run_file_exists

HEADLINE_KEYS = (
    "critic/score/mean",
    "val/accuracy_greedy",
    "val/accuracy_sampled",
    "tree/effective_ratio",
    "tree/mixed_budget_share",
    "tree/anchor_mixed_ratio",
    "tree/leaves_per_prompt",
    "predictor/brier",
    "predictor/ece",
    "rollout/rollouts_total",
    "response_length/mean",
    "num_turns/mean",
    "timing_s/step",
)
"""Metrics shown first in the summary tables, when a run logged them."""

SUMMARY_COLUMNS = (
    ("effective_ratio", "effective ratio"),
    ("mixed_budget_share", "mixed budget share"),
    ("final_accuracy", "final accuracy"),
    ("rollouts", "rollouts"),
    ("tokens", "tokens"),
)
"""Columns of `summary.json`'s per-method figures; `final_accuracy_std` joins `final_accuracy`."""

_HIGHER_IS_BETTER = {"effective_ratio", "mixed_budget_share", "final_accuracy"}


@dataclass(frozen=True)
class ReportFiles:
    html: Path
    plots: list[Path]
    """The PNGs written this time, in panel order (next to the HTML)."""
    warnings: list[str]
    """What the page could not show in full (unreadable step files, texts cut to fit)."""


def write_report(path: str | Path, *, limits: ViewerLimits | None = None) -> Path:
    """Write `report.html` and the plot PNGs into `path` (a run folder or a comparison folder).

    Returns the HTML file. Raises FileNotFoundError when `path` holds no run, ValueError for a
    malformed `metrics.jsonl` or `summary.json`, ModuleNotFoundError without matplotlib.
    """
    return build_report(path, limits=limits).html


def build_report(path: str | Path, *, limits: ViewerLimits | None = None) -> ReportFiles:
    """`write_report`, returning every file written and the warnings."""
    folder = Path(path)
    runs_by_method = find_runs(folder)
    comparison = not run_file_exists(folder / "metrics.jsonl")
    runs = {method: [load_run(p, method) for p in paths] for method, paths in runs_by_method.items()}
    plots = plot_metrics(runs, folder)
    if comparison:  # one seed per method in the viewer keeps the page small
        viewed = [(f"{method} · {paths[0].name}", paths[0]) for method, paths in runs_by_method.items()]
        limits = limits or ViewerLimits(max_steps=6, max_trees_per_step=12)
    else:
        viewed = [(method, paths[0]) for method, paths in runs_by_method.items()]
    data = viewer_data(viewed, limits)
    page = _page(folder, comparison, runs, plots, data)
    out = folder / "report.html"
    atomic_write(out, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))  # a full disk leaves no half page
    return ReportFiles(html=out, plots=plots, warnings=list(data["warnings"]))


def _page(folder: Path, comparison: bool, runs: dict[str, list[RunMetrics]], plots: list[Path], data: dict) -> str:
    esc = html.escape
    parts = [
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>trace-rl report · {esc(folder.resolve().name)}</title>",
        f"<style>{PAGE_CSS}</style></head>\n<body>\n<main>",
        f"<h1>trace-rl report · {esc(folder.resolve().name)}</h1>",
        f'<p class="meta">{"Comparison" if comparison else "Run"} folder <code>{esc(str(folder))}</code></p>',
    ]
    if comparison:
        parts.append("<h2>Comparison</h2>")
        parts.append(_summary_json_table(folder / "summary.json", runs))
        parts.append("<h3>Final values per method</h3>")
        parts.append('<p class="meta">Each run\'s last logged value, mean over its seeds.</p>')
        parts.append(_final_table(runs))
    else:
        ((method, (run,)),) = runs.items()
        steps = list(run.rows)
        parts.append("<h2>Summary</h2>")
        parts.append(
            f'<p class="meta">method <b>{esc(method)}</b>{esc(_rollout_options(folder))} · {len(steps)} logged steps'
            + (f" ({steps[0]}–{steps[-1]})" if steps else "")
            + "</p>"
        )
        parts.append(_run_table(run))
    warnings = data["warnings"]
    if warnings:
        parts.append('<ul class="warn">' + "".join(f"<li>{esc(w)}</li>" for w in warnings) + "</ul>")
    parts.append("<h2>Curves</h2>")
    if plots:
        parts.append('<div class="plots">')
        for plot in plots:
            encoded = base64.b64encode(plot.read_bytes()).decode("ascii")
            parts.append(
                f'<figure><img alt="{esc(plot.stem)}" src="data:image/png;base64,{encoded}">'
                f"<figcaption>{esc(plot.name)}</figcaption></figure>"
            )
        parts.append("</div>")
    else:
        parts.append('<p class="meta">No metric to plot yet.</p>')
    parts.append("<h2>Rollout trees</h2>")
    parts.append(
        '<p class="meta">Pick a step and a prompt; click a node to read its turn. Colours: leaves by reward, '
        "inner nodes by backed-up value V̂ (mean reward of the leaves below).</p>"
    )
    parts.append(viewer_section(data))
    parts.append(_config_block(folder, comparison))
    parts.append("</main>\n</body></html>\n")
    return "\n".join(parts)


def _run_table(run: RunMetrics) -> str:
    """key | final | mean | min | max, headline keys first, every other numeric key folded away."""
    keys = sorted(run.keys())
    headline = [k for k in HEADLINE_KEYS if k in keys]
    rest = [k for k in keys if k not in HEADLINE_KEYS]
    if not keys:
        return '<p class="meta">metrics.jsonl has no numeric values yet.</p>'

    def table(rows: Sequence[str]) -> str:
        body = []
        for key in rows:
            values = np.array([row[key] for row in run.rows.values() if key in row])
            cells = [values[-1], values.mean(), values.min(), values.max()]
            body.append(
                f"<tr><th>{html.escape(key)}</th>"
                + "".join(f"<td>{_fmt(v)}</td>" for v in cells)
                + f"<td>{len(values)}</td></tr>"
            )
        head = "<tr><th>metric</th><th>final</th><th>mean</th><th>min</th><th>max</th><th>steps</th></tr>"
        return f'<table class="num"><thead>{head}</thead><tbody>{"".join(body)}</tbody></table>'

    out = table(headline) if headline else ""
    if rest:
        out += f"<details><summary>All other metrics ({len(rest)})</summary>{table(rest)}</details>"
    return out


def _final_table(runs: dict[str, list[RunMetrics]]) -> str:
    keys = [k for k in HEADLINE_KEYS if any(k in r.keys() for rs in runs.values() for r in rs)]
    if not keys:
        return '<p class="meta">No numeric metrics yet.</p>'
    head = "<tr><th>method</th><th>seeds</th>" + "".join(f"<th>{html.escape(k)}</th>" for k in keys) + "</tr>"
    body = []
    for method, method_runs in runs.items():
        cells = []
        for key in keys:
            finals = [_last(r, key) for r in method_runs]
            finals = [v for v in finals if v is not None]
            cells.append(f"<td>{_fmt(float(np.mean(finals))) if finals else '—'}</td>")
        body.append(f"<tr><th>{html.escape(method)}</th><td>{len(method_runs)}</td>{''.join(cells)}</tr>")
    return f'<div class="wide"><table class="num"><thead>{head}</thead><tbody>{"".join(body)}</tbody></table></div>'


def _summary_json_table(path: Path, runs: dict[str, list[RunMetrics]]) -> str:
    if not path.is_file():
        return f'<p class="meta">No <code>{html.escape(path.name)}</code> (the comparison may not have finished).</p>'
    summary = _read_summary(path)
    methods = summary["methods"]
    best = {}
    for key in _HIGHER_IS_BETTER:
        values = [m.get(key) for m in methods.values() if _is_number(m.get(key))]
        if values:
            best[key] = max(values)
    head = "<tr><th>method</th>" + "".join(f"<th>{html.escape(label)}</th>" for _, label in SUMMARY_COLUMNS)
    head += "<th>seeds found</th></tr>"
    body = []
    for name in sorted(methods, key=method_sort_key):
        figures = methods[name]
        cells = []
        for key, _ in SUMMARY_COLUMNS:
            value = figures.get(key)
            text = _fmt(value) if _is_number(value) else "—"
            if key == "final_accuracy" and _is_number(figures.get("final_accuracy_std")):
                text += f" ± {_fmt(figures['final_accuracy_std'])}"
            bold = key in best and _is_number(value) and value == best[key]
            cells.append(f"<td>{'<b>' + text + '</b>' if bold else text}</td>")
        seeds = len(runs.get(name, []))
        body.append(f"<tr><th>{html.escape(str(name))}</th>{''.join(cells)}<td>{seeds}</td></tr>")
    note = '<p class="meta">From <code>summary.json</code>: ratios averaged over steps, accuracy over seeds; best in bold.</p>'
    return f'{note}<table class="num"><thead>{head}</thead><tbody>{"".join(body)}</tbody></table>'


def _read_summary(path: Path) -> dict[str, Any]:
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from exc
    if not isinstance(summary, dict) or not isinstance(summary.get("methods"), dict):
        raise ValueError(f'{path}: expected {{"methods": {{NAME: {{...}}}}, "config": {{...}}}}')
    for name, figures in summary["methods"].items():
        if not isinstance(figures, dict):
            raise ValueError(f"{path}: methods.{name} must be an object, got {type(figures).__name__}")
    return summary


def _config_block(folder: Path, comparison: bool) -> str:
    if comparison:
        summary = folder / "summary.json"
        if not summary.is_file():
            return ""
        config = _read_summary(summary).get("config", {})
        text, name = json.dumps(config, indent=2, sort_keys=True, default=str), "summary.json config"
    else:
        path = folder / "config.yaml"
        if not run_file_exists(path):
            return ""
        text, name = read_run_file(path).decode("utf-8", errors="replace"), "config.yaml"
    return f"<h2>Config</h2><details><summary>{html.escape(name)}</summary><pre>{html.escape(text)}</pre></details>"


def _rollout_options(folder: Path) -> str:
    """The run's `rollout.*` settings that differ from their defaults (` (stage2_objective: prompt, ...)`),
    so a variant of a method reads as one; empty where there are none or config.yaml cannot be read."""
    try:
        rollout = RunDir(folder).read_config().get("rollout") or {}  # in the open, or packed with a committed result's logs
    except (ConfigError, AttributeError, OSError, UnicodeDecodeError):
        return ""
    defaults = {f.name: f.default for f in dataclasses.fields(RolloutConfig) if f.default is not dataclasses.MISSING}
    changed = [f"{k}: {v if isinstance(v, str) else json.dumps(v)}" for k, v in rollout.items()
               if k in defaults and k != "method" and v != defaults[k]]
    return f" ({', '.join(changed)})" if changed else ""


def _last(run: RunMetrics, key: str) -> float | None:
    values = [row[key] for row in run.rows.values() if key in row]
    return values[-1] if values else None


def _fmt(value: float) -> str:
    value = float(value)
    if value == int(value) and abs(value) >= 1:
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.1f}"
    return f"{value:.3f}" if abs(value) >= 0.001 or value == 0 else f"{value:.2e}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)


PAGE_CSS = """
body { margin: 0; background: #f3f5f7; color: #1d232a; font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
main { max-width: 1500px; margin: 0 auto; padding: 18px 26px 40px; background: #fff; min-height: 100vh; }
h1 { font-size: 22px; margin: 4px 0 2px; }
h2 { font-size: 18px; margin: 26px 0 8px; border-bottom: 1px solid #e1e5e9; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 16px 0 6px; }
.meta { color: #5b6670; font-size: 13px; margin: 2px 0 8px; }
code { font: 12.5px ui-monospace, Menlo, Consolas, monospace; background: #f4f6f8; padding: 1px 4px; border-radius: 3px; }
table.num { border-collapse: collapse; font-size: 13px; margin: 4px 0 8px; }
table.num th, table.num td { border-bottom: 1px solid #e6e9ec; padding: 3px 10px; text-align: right; }
table.num th:first-child { text-align: left; font-family: ui-monospace, Menlo, Consolas, monospace; font-weight: 500; }
table.num thead th { background: #f4f6f8; font-family: inherit; font-weight: 600; text-align: right; }
table.num thead th:first-child { text-align: left; }
.wide { overflow-x: auto; }
details summary { cursor: pointer; color: #2a5d8f; font-size: 13px; margin: 6px 0; }
details pre { background: #f4f6f8; padding: 8px 10px; border-radius: 4px; font-size: 12px; overflow: auto; max-height: 60vh; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 12px; }
.plots figure { margin: 0; border: 1px solid #e1e5e9; border-radius: 6px; padding: 6px; background: #fff; }
.plots img { width: 100%; height: auto; display: block; }
.plots figcaption { font-size: 11px; color: #8a949c; text-align: right; }
ul.warn { color: #8a5a00; background: #fff8e6; border: 1px solid #f1d9a0; border-radius: 4px; padding: 6px 10px 6px 28px; font-size: 13px; }
"""
