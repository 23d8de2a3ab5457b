"""A pre-registered study read as one: the comparison folders of its phases, its rows seed by seed, and
the paired contrasts its plan names.

`trace-rl compare` summarises one folder against that folder's first row. A plan that runs in phases
(other rows after a first set, more seeds of some rows later) spreads a row's seeds over several
folders and names contrasts between rows of different folders, one of them chosen from the results
("the strongest baseline": the plan fixes the rule, the runs pick the row). `study` joins the
folders by (row, seed), applies that rule, and reports each contrast paired by seed with a Student t
interval and a two-sided sign test: the seeds of a contrast share their warm start and their candidate
prompts, so their differences leave out what the two runs share.

Wall-clock is a cost axis only when the machine was not shared. A run paused (SIGSTOP) while something
else used the machine counts the pause in the `timing_s/*` of the step or evaluation it fell in, so
`clock` takes logged pauses out, from the step's end (its tree file's mtime) and its logged
duration, and `study` counts a step or evaluation still over `UNLOGGED_PAUSE` times its run's median
(a pause nobody logged) at the median.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from trace_rl.report.plots import RunMetrics, load_run
from trace_rl.research.compare import t975
from trace_rl.research.stage2_probe import PROBE_COLUMNS, finite_mean, probe_markdown
from trace_rl.storage.rundir import (
    START,
    RunDir,
    read_run_file,
    run_file_exists,
    seed_runs,
)

STRONGEST = "@strongest"
"""In a contrast, the row the plan's rule chose as the strongest baseline (`strongest_baseline`)."""

CLOCK_FILE = "clock.json"
"""Per run, per step: the wall-clock seconds of the step and of its evaluation with logged pauses taken
out (`clock`); `scripts/results.py export --pauses` writes it, packed with the copied runs, which carry
no trees (so no step end times) to redo it from."""

UNLOGGED_PAUSE = 10.0
"""A step or evaluation over this many times its run's median of the same kind is counted at the median."""

PROBE_FILE = "probe.json"
"""What Stage 2 bought, per row and seed of one folder (`scripts/results.py probe --out`, from the saved trees)."""


# ---------------------------------------------------------------- paired contrasts


def sign_test(differences: Iterable[float]) -> float:
    """Two-sided exact sign test of a zero median: ties (differences of 0) are dropped, and the p-value
    is the chance under Binomial(n, 1/2) of a split at least as uneven as the one seen (1 with no
    untied pair)."""
    values = [d for d in differences if not math.isnan(d)]
    wins, losses = sum(d > 0 for d in values), sum(d < 0 for d in values)
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(a: Mapping[int, float], b: Mapping[int, float]) -> dict[str, Any]:
    """`a` − `b` over the seeds both have: the mean difference with its 95% Student t interval
    (NaN half-width under two seeds), wins, losses and ties of `a`, the sign test's p-value and the
    difference per seed."""
    seeds = sorted(set(a) & set(b))
    diff = np.array([a[s] - b[s] for s in seeds], dtype=float)
    half = float(t975(diff.size - 1) * diff.std(ddof=1) / math.sqrt(diff.size)) if diff.size >= 2 else math.nan
    mean = float(diff.mean()) if diff.size else math.nan
    return {
        "seeds": len(seeds),
        "mean": mean,
        "ci95": half,
        "low": mean - half,
        "high": mean + half,
        "wins": int((diff > 0).sum()),
        "losses": int((diff < 0).sum()),
        "ties": int((diff == 0).sum()),
        "sign_p": sign_test(diff),
        "per_seed": {str(s): float(d) for s, d in zip(seeds, diff)},
    }


def strongest_baseline(finals: Mapping[str, Mapping[int, float]], candidates: Sequence[str], seeds: Sequence[int]) -> dict[str, Any]:
    """The plan's rule: among `candidates` (in the plan's order), the row with the highest mean final
    accuracy over `seeds`, ties to the earlier row. A row missing any of those seeds cannot be chosen
    yet (its mean is reported as NaN)."""
    means = {}
    for row in candidates:
        have = finals.get(row, {})
        means[row] = float(np.mean([have[s] for s in seeds])) if all(s in have for s in seeds) else math.nan
    ready = [row for row in candidates if not math.isnan(means[row])]
    chosen = max(ready, key=lambda row: (means[row], -candidates.index(row))) if len(ready) == len(candidates) else None
    return {"row": chosen, "seeds": list(seeds), "means": means}


# ---------------------------------------------------------------- wall-clock


def read_pauses(path: str | Path) -> list[tuple[float, float]]:
    """(start, end) POSIX seconds of each pause in a log of `stop <UTC time> [why]` / `cont <UTC time>`
    lines (`#` starts a comment; times like 2026-12-06T16:10Z or 2026-12-06T16:10:05Z). A stop without
    its cont, or a cont without a stop, is an error: the log is what the wall-clock figures rest on."""
    pauses, opened = [], None
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        word, _, rest = line.partition(" ")
        when = _utc(rest.split()[0] if rest else "", f"{path}:{number}")
        if word == "stop" and opened is None:
            opened = when
        elif word == "cont" and opened is not None:
            pauses.append((opened, when))
            opened = None
        else:
            raise ValueError(f"{path}:{number}: {line!r} does not follow a {'cont' if word == 'stop' else 'stop'}")
    if opened is not None:
        raise ValueError(f"{path}: the last stop has no cont (a pause still open: resume the runs, or log when it ended)")
    return pauses


def _utc(text: str, where: str) -> float:
    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d)(:\d\d)?Z", text)
    if not match:
        raise ValueError(f"{where}: {text!r} is not a UTC time like 2026-12-06T16:10Z")
    return datetime.strptime(match.group(1) + (match.group(2) or ":00"), "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()


def _overlap(start: float, end: float, pauses: Sequence[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in pauses)


def clock(run_dir: str | Path, pauses: Sequence[tuple[float, float]]) -> dict[str, dict[str, float]]:
    """step -> {"step": s, "eval": s}: the run's logged step and evaluation times with the logged pauses
    that fell in them taken out. A step ends when its trees are written (its tree file's mtime; the
    trainer writes them last) and began its logged `timing_s/step` before; its evaluation, if any,
    starts there and lasts its `timing_s/eval`. A step without a tree file keeps its logged times."""
    run = RunDir(run_dir)
    ends = {step: path.stat().st_mtime for step, path in run.tree_files().items()}
    out: dict[str, dict[str, float]] = {}
    for record in run.metrics():
        step = int(record["step"])
        if step == 0:
            continue
        times = out.setdefault(str(step), {})
        end = ends.get(step)
        if "timing_s/step" in record:
            seconds = float(record["timing_s/step"])
            times["step"] = seconds - (_overlap(end - seconds, end, pauses) if end is not None else 0.0)
        if "timing_s/eval" in record:
            seconds = float(record["timing_s/eval"])
            times["eval"] = seconds - (_overlap(end, end + seconds, pauses) if end is not None else 0.0)
    return out


def net_times(rows: Mapping[int, Mapping[str, float]], logged_clock: Mapping[str, Mapping[str, float]] | None = None) -> tuple[dict[int, dict[str, float]], int]:
    """Each step's (step, eval) seconds with pauses out: the logged clock where given (`clock`), else the
    logged times; then any still over `UNLOGGED_PAUSE` × its kind's median, counted at the median.
    Returns the times by step and how many were counted at the median."""
    times: dict[int, dict[str, float]] = {}
    for step, row in rows.items():
        if step == 0:
            continue
        logged = (logged_clock or {}).get(str(step), {})
        for kind, key in (("step", "timing_s/step"), ("eval", "timing_s/eval")):
            if kind in logged:
                times.setdefault(step, {})[kind] = float(logged[kind])
            elif key in row:
                times.setdefault(step, {})[kind] = float(row[key])
    capped = 0
    for kind in ("step", "eval"):
        values = [t[kind] for t in times.values() if kind in t]
        if not values:
            continue
        median = float(np.median(values))
        for t in times.values():
            if kind in t and t[kind] > UNLOGGED_PAUSE * median:
                t[kind], capped = median, capped + 1
    return times, capped


# ---------------------------------------------------------------- the study


def study_runs(folders: Sequence[str | Path]) -> dict[str, dict[int, Path]]:
    """row -> seed -> run folder, over comparison folders `DIR/<row>/seed_<k>/` (the starting policy's
    evaluations under `START`). Rows keep the order they first appear in (each folder's `compare.yaml`
    order where it has one). The same (row, seed) in two folders is an error: which one counts?"""
    runs: dict[str, dict[int, Path]] = {}
    for folder in map(Path, folders):
        order = _compare_rows(folder)
        for run in sorted(seed_runs(folder), key=lambda p: (order.index(p.parent.name) if p.parent.name in order else len(order), p.parent.name)):
            row, seed = run.parent.name, int(run.name[5:])
            if seed in runs.get(row, {}):
                raise ValueError(f"{row} seed {seed} is in two folders: {runs[row][seed]} and {run}")
            runs.setdefault(row, {})[seed] = run
    return {row: dict(sorted(seeds.items())) for row, seeds in runs.items()}


def _compare_rows(folder: Path) -> list[str]:
    path = folder / "compare.yaml"
    if not path.exists():
        return [START]
    return [START, *(yaml.safe_load(path.read_text()) or {}).get("methods", [])]


def _rows(run: Path) -> dict[int, dict[str, float]]:
    return dict(load_run(run).rows)


def run_clocks(folders: Sequence[str | Path], pauses: Sequence[tuple[float, float]] | None = None) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """row -> seed -> `clock` of each run: recomputed from its tree files where `pauses` are given and
    the run still has them (a live run folder), else as a folder's `CLOCK_FILE` recorded it."""
    clocks: dict[str, Any] = {}
    for folder in map(Path, folders):
        if run_file_exists(folder / CLOCK_FILE):  # packed with the runs in a committed result
            for row, seeds in json.loads(read_run_file(folder / CLOCK_FILE)).items():
                clocks.setdefault(row, {}).update(seeds)
    if pauses is not None:
        for row, seeds in study_runs(folders).items():
            for seed, run in seeds.items():
                if RunDir(run).tree_files():
                    clocks.setdefault(row, {})[str(seed)] = clock(run, pauses)
    return clocks


def _check_rows_named(folders: Sequence[Path], rows: set[str], contrasts: Sequence[str], reference: str | None) -> None:
    """ValueError unless the folders hold runs and every row a well-formed contrast or the reference names
    is one of theirs: a misspelt row would otherwise read as a contrast of 0 seeds. (The candidates of the
    strongest-baseline rule may not have run yet: that rule waits for them.)"""
    if not rows:
        raise ValueError(f"no runs in {', '.join(map(str, folders))}: a study reads comparison folders (ROW/seed_K/metrics.jsonl)")
    pairs = [spec.partition(":") for spec in contrasts]
    named = [row for a, sep, b in pairs if sep and a and b for row in (a, b) if row != STRONGEST]
    unknown = sorted({row for row in [*named, *([reference] if reference else [])] if row not in rows})
    if unknown:
        raise ValueError(f"no row {', '.join(map(repr, unknown))} in these folders (their rows: {', '.join(sorted(rows))})")


def study(
    folders: Sequence[str | Path],
    *,
    steps: int,
    contrasts: Sequence[str] = (),
    reference: str | None = None,
    candidates: Sequence[str] = (),
    baseline_seeds: Sequence[int] = (),
    accuracy: str = "val/accuracy_sampled",
    pauses: Sequence[tuple[float, float]] | None = None,
    order: Sequence[str] = (),
) -> dict[str, Any]:
    """The study's figures from its comparison folders (live or exported).

    Per row (finished runs only: a run counts once its log reaches `steps`): final accuracy per seed,
    its mean and standard deviation, the gain over its own seed's starting policy and the difference to
    `reference` paired by seed, the effective ratio per sampled prompt and per candidate prompt, the
    budget that could not teach (leaves in groups whose outcomes all agreed), rollouts, generated
    tokens and wall-clock spent. `candidates` and `baseline_seeds` apply the rule of
    `strongest_baseline`; each contrast "A:B" (B may be `STRONGEST`) is `paired`. Wall-clock: `run_clocks`
    with `pauses` (`read_pauses`), then `net_times`. Rows come in `order`, then as the folders list them."""
    runs = study_runs(folders)
    runs = {row: runs[row] for row in sorted(runs, key=lambda r: list(order).index(r) if r in order else len(order))}
    logged = run_clocks(folders, pauses)
    starts = {seed: _final(_rows(run), accuracy) for seed, run in runs.pop(START, {}).items()}
    _check_rows_named(folders, set(runs), contrasts, reference)
    finals: dict[str, dict[int, float]] = {}
    rows_out: dict[str, Any] = {}
    unfinished: dict[str, dict[str, int]] = {}
    for row, seeds in runs.items():
        done = {}
        for seed, run in seeds.items():
            metrics = _rows(run)
            last = max(metrics) if metrics else 0
            if last >= steps:
                done[seed] = metrics
            else:
                unfinished.setdefault(row, {})[str(seed)] = last
        if not done:
            continue
        finals[row] = {seed: _final(m, accuracy) for seed, m in done.items()}
        rows_out[row] = _row_figures(done, finals[row], starts, logged.get(row, {}))
    if reference is not None and reference in finals:
        for row, figures in rows_out.items():
            if row != reference:
                figures["vs_reference"] = paired(finals[row], finals[reference])
    out: dict[str, Any] = {"accuracy": accuracy, "steps": steps, "reference": reference, "start": _start_figures(starts), "rows": rows_out}
    chosen = None
    if candidates:
        rule = out["strongest_baseline"] = strongest_baseline(finals, list(candidates), list(baseline_seeds))
        chosen = rule["row"]
    out["contrasts"] = {}
    for spec in contrasts:
        a, sep, b = spec.partition(":")
        if not sep or not a or not b:
            raise ValueError(f"contrast {spec!r}: expected ROW:ROW (the second may be {STRONGEST})")
        if b == STRONGEST:
            if chosen is None:
                out["contrasts"][spec] = {"seeds": 0, "pending": "the strongest baseline is not chosen yet (some candidate lacks a finished seed)"}
                continue
            b = chosen
        out["contrasts"][spec] = {"a": a, "b": b, **paired(finals.get(a, {}), finals.get(b, {}))}
    if probed := probe_figures(folders):
        out["probe"] = probed
    if unfinished:
        out["unfinished"] = unfinished
    return out


def probe_figures(folders: Sequence[str | Path]) -> dict[str, Any] | None:
    """The folders' `PROBE_FILE`s joined by (row, seed), in the form `scripts/results.py probe` writes
    (`stage2_probe.probe_markdown` renders it), each row's "mean" over all its seeds: a phase's probe
    covers only its own seeds, and the question it answers (do the prefixes Stage 2 picks mix at the rate
    it predicted, and does the update use them?) is asked of all of a row's seeds, as its contrasts
    are. A figure a seed lacks or has as NaN is left out of its mean. None where no folder was probed."""
    joined: dict[str, Any] = {"warmup": None, "rows": {}}
    saved: list[str] = []
    for folder in map(Path, folders):
        if not (folder / PROBE_FILE).is_file():
            continue
        probe = json.loads((folder / PROBE_FILE).read_text())
        if joined["warmup"] not in (None, probe["warmup"]):
            raise ValueError(f"{folder / PROBE_FILE}: warmup {probe['warmup']}, another folder's {joined['warmup']}: the means would mix two windows")
        joined["warmup"] = probe["warmup"]
        saved += probe.get("from_saved_figures", [])
        for row, figures in probe["rows"].items():
            joined["rows"].setdefault(row, {"seeds": {}})["seeds"].update(figures["seeds"])
    if not joined["rows"]:
        return None
    for figures in joined["rows"].values():
        seeds = figures["seeds"].values()
        figures["mean"] = {key: finite_mean([s[key] for s in seeds if isinstance(s.get(key), (int, float))]) for key, _, _ in PROBE_COLUMNS}
    if saved:
        joined["from_saved_figures"] = saved
    return joined


def _final(rows: Mapping[int, Mapping[str, float]], key: str) -> float:
    return next((row[key] for _, row in sorted(rows.items(), reverse=True) if key in row), math.nan)


def _start_figures(starts: Mapping[int, float]) -> dict[str, Any]:
    values = np.array(list(starts.values()), dtype=float)
    return {"per_seed": {str(s): v for s, v in starts.items()}, "mean": float(values.mean()) if values.size else math.nan}


def _row_figures(runs: Mapping[int, dict[int, dict[str, float]]], finals: Mapping[int, float],
                 starts: Mapping[int, float], logged: Mapping[str, Any]) -> dict[str, Any]:
    def over_steps(key: str) -> float:
        values = [r[key] for metrics in runs.values() for step, r in metrics.items() if step > 0 and key in r]
        return float(np.mean(values)) if values else math.nan

    def total(key: str) -> float:
        return float(np.mean([max((r[key] for r in metrics.values() if key in r), default=math.nan) for metrics in runs.values()]))

    minutes, capped = [], 0
    for seed, metrics in runs.items():
        times, count = net_times(metrics, logged.get(str(seed)))
        minutes.append(sum(sum(t.values()) for t in times.values()) / 60.0)
        capped += count
    values = np.array(list(finals.values()), dtype=float)
    return {
        "seeds": len(finals),
        "final_per_seed": {str(s): v for s, v in finals.items()},
        "final_mean": float(values.mean()),
        "final_sd": float(values.std(ddof=1)) if values.size > 1 else math.nan,
        "gain": paired(finals, starts),
        "effective_ratio": over_steps("tree/effective_ratio"),
        "effective_per_candidate": over_steps("tree/effective_per_candidate"),
        "budget_could_not_teach": over_steps("tree/failed_budget_share") + over_steps("tree/solved_budget_share"),
        "rollouts": total("rollout/rollouts_total"),
        "tokens": total("rollout/tokens_total"),
        "minutes": float(np.mean(minutes)),
        "times_counted_at_median": capped,
    }


def corrected_runs(folders: Sequence[str | Path], pauses: Sequence[tuple[float, float]] | None = None) -> dict[str, list[RunMetrics]]:
    """The study's runs as `trace_rl.report.plots.RunMetrics`, their step and evaluation times replaced
    by `net_times`, so the wall-clock curves show the study's clock."""
    logged = run_clocks(folders, pauses)
    out: dict[str, list[RunMetrics]] = {}
    for row, seeds in study_runs(folders).items():
        for seed, run in seeds.items():
            rows = _rows(run)
            times, _ = net_times(rows, logged.get(row, {}).get(str(seed)))
            for step, t in times.items():
                rows[step] = {**rows[step], **{f"timing_s/{kind}": v for kind, v in t.items()}}
            out.setdefault(row, []).append(RunMetrics(path=run, method=row, rows=rows))
    return out


def study_markdown(result: Mapping[str, Any]) -> str:
    """The study as Markdown: the rows, the strongest baseline's choice, the contrasts."""
    ref = result.get("reference") or "the reference"
    lines = [
        (f"| row | seeds | final accuracy (mean ± sd) | gain over its start (95% t) | against {ref}, paired (95% t; wins-losses) "
         "| effective ratio, per sampled prompt | per candidate prompt | budget that could not teach | rollouts | generated tokens | wall-clock minutes |"),
        "|" + "---|" * 11,
    ]
    if result["start"]["per_seed"]:
        lines.append(f"| start (no RL) | {len(result['start']['per_seed'])} | {result['start']['mean']:.3f} | — | — | — | — | — | 0 | 0 | — |")
    for row, f in result["rows"].items():
        versus = f.get("vs_reference")
        against = f"{_interval(versus)} ({versus['wins']}-{versus['losses']})" if versus else "—"
        lines.append(
            f"| {row} | {f['seeds']} | {f['final_mean']:.3f} ± {_fmt(f['final_sd'], '.3f')} | {_interval(f['gain'])} "
            f"| {against} "
            f"| {_fmt(f['effective_ratio'], '.3f')} | {_fmt(f['effective_per_candidate'], '.3f')} | {_fmt(f['budget_could_not_teach'], '.3f')} "
            f"| {f['rollouts']:.0f} | {f['tokens']:.0f} | {f['minutes']:.0f} |"
        )
    if rule := result.get("strongest_baseline"):
        means = ", ".join(f"{row} {_fmt(mean, '.4f')}" for row, mean in rule["means"].items())
        seeds = ", ".join(map(str, rule["seeds"]))
        lines += ["", (f"Strongest baseline (highest mean final accuracy over seeds {seeds}, ties to the earlier row): "
                       f"**{rule['row'] or 'not chosen yet'}** ({means}).")]
    if result["contrasts"]:
        lines += ["", "| contrast | seeds | mean difference | 95% t interval | wins-losses-ties | sign test p |", "|---|---|---|---|---|---|"]
        for spec, c in result["contrasts"].items():
            if "pending" in c:
                lines.append(f"| {spec} | 0 | {c['pending']} | | | |")
                continue
            name = f"{c['a']} − {c['b']}" + (f" ({spec})" if STRONGEST in spec else "")
            lines.append(f"| {name} | {c['seeds']} | {_fmt(c['mean'], '+.3f')} | [{_fmt(c['low'], '+.3f')}, {_fmt(c['high'], '+.3f')}] "
                         f"| {c['wins']}-{c['losses']}-{c['ties']} | {c['sign_p']:.3f} |")
    if result.get("probe"):
        lines += ["", ("What Stage 2 bought, over every seed of each row with a Stage 2 (each folder's `probe.json`, "
                       "`scripts/results.py probe`, joined by row and seed):"), "", probe_markdown(result["probe"]).rstrip("\n")]
    if result.get("unfinished"):
        cut = "; ".join(f"{row} seed {seed} at step {step}" for row, seeds in result["unfinished"].items() for seed, step in seeds.items())
        lines += ["", f"Not counted yet (unfinished): {cut}."]
    return "\n".join(lines) + "\n"


def _interval(c: Mapping[str, Any] | None) -> str:
    if not c or not c.get("seeds"):
        return "—"
    return f"{_fmt(c['mean'], '+.3f')} ± {_fmt(c['ci95'], '.3f')}"


def _fmt(value: float, spec: str) -> str:
    return "—" if value is None or math.isnan(value) else format(value, spec)
