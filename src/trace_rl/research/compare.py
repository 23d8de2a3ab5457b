"""`trace-rl compare`: several methods, same seeds, budget and steps; one table.

Every (method, seed) is a full training run in `DIR/<method>/seed_<k>/`; only `rollout.method`
and `seed` differ between them. The starting (warm-started) policy is evaluated once per seed in
`DIR/react/seed_<k>/` (the paper's ReAct row: the agent without RL), the point every accuracy
curve starts from. `DIR/summary.json` holds, per method, the figures averaged over steps (ratios)
and seeds (accuracy), the gain over the starting policy and the difference to the first method's
(the baseline's) final accuracy paired by seed, plus how many rollouts each method needed to first
reach the baseline's final accuracy.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import signal
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from trace_rl.infra.config import (
    MAX_SEED,
    FieldError,
    check_choice,
    check_range,
    from_dict,
    set_dotted,
    to_dict,
)
from trace_rl.planning.methods import METHODS
from trace_rl.run import RunConfig
from trace_rl.storage.rundir import START, RunDir, atomic_write
from trace_rl.training.trainer import StopRequest

Job = Callable[[RunConfig, Path, "StopRequest | None"], None]
"""`job(run, run_dir, stop)`: train (or evaluate) one run into `run_dir`, stopping at a step boundary
once `stop` is requested."""


@dataclass
class CompareConfig:
    """A comparison (`trace-rl compare`): rows run at the same seeds, budget and steps, summarised with
    differences paired by seed."""

    methods: list[str] = field(default_factory=lambda: ["grpo", "prompt_only", "random_tree", "trace"])
    """Rows to run, each a method of the registry or a name in `variants`; the first is the baseline the
    others are measured against."""
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Named rows that change the shared run config: each maps dotted keys of `run` to values and must
    set `rollout.method`, e.g. `trace_tokens: {rollout.method: trace, rollout.budget_unit: tokens,
    rollout.budget: 2200}`; its runs go to `DIR/<name>/seed_<k>/`."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds every row runs at (`run.seed` of each run); differences to the baseline are paired by seed."""
    accuracy: str = "val/accuracy_sampled"
    """The held-out accuracy the table reports (`val/accuracy_greedy` or `val/accuracy_sampled`)."""
    run: RunConfig = field(default_factory=RunConfig)
    """The shared run config; `run.rollout.method` and `run.seed` are set per run."""
    workers: int = 1
    """Runs trained at once, each in its own process. Each run uses `run.model.cpu_threads` threads,
    so on an idle machine `workers × cpu_threads` up to the core count is close to linear."""
    warm_start_per_seed: bool = False
    """Give each seed its own warm start (`run.sft.seed` = the seed), so the seeds' spread includes the
    starting policy's; false: every seed starts from the one warm start of `run.sft.seed`."""
    evaluate_start: bool = True
    """Evaluate the starting policy once per seed (`DIR/react/seed_<k>/`, step 0, no rollouts spent),
    with the same tasks and samples as the runs' evaluations."""

    def __post_init__(self) -> None:
        for name, overrides in self.variants.items():
            if name in METHODS or name == START or not name.replace("_", "").replace("-", "").isalnum():
                raise FieldError(f"variants.{name}", overrides, "a name of letters, digits, - and _ that is no method's (a folder under the comparison)")
            if not isinstance(overrides, dict) or overrides.get("rollout.method") not in METHODS:
                raise FieldError(f"variants.{name}.rollout.method", (overrides or {}).get("rollout.method") if isinstance(overrides, dict) else overrides,
                                 f"one of {', '.join(METHODS)} (a variant names the method it runs)")
        rows = [*METHODS, *self.variants]
        unknown = [m for m in self.methods if m not in rows]
        if unknown or not self.methods or len(set(self.methods)) < len(self.methods):
            raise FieldError("methods", self.methods, f"a non-empty list of distinct names from the methods {', '.join(METHODS)} or the variants")
        if not self.seeds or len(set(self.seeds)) < len(self.seeds):
            raise FieldError("seeds", self.seeds, "a non-empty list of distinct seeds")
        for index, seed in enumerate(self.seeds):
            if not 0 <= seed <= MAX_SEED:
                raise FieldError(f"seeds[{index}]", seed, f"in [0, {MAX_SEED}]")
        check_range(self, "workers", ge=1)
        check_choice(self, "accuracy", ("val/accuracy_greedy", "val/accuracy_sampled"))
        for name in self.variants:  # listed or not, a variant that cannot run is refused (errors name its key)
            self.run_config(name)
        for method in self.methods:  # each run's config is this one with its method: check them all now
            if method in self.variants:
                continue
            try:
                replace(self.run, rollout=replace(self.run.rollout, method=method))
            except FieldError as exc:
                raise FieldError(f"run.{exc.name}", exc.value, f"{exc.accepted} for method {method}", exc.hint) from exc
            except ValueError as exc:
                raise ValueError(f"run, for method {method}: {exc}") from exc

    def run_config(self, name: str, seed: int | None = None) -> RunConfig:
        """The run config of one row (a method, or a variant's overrides on `run`), at `seed` if given."""
        if name in self.variants:
            data = to_dict(self.run)
            for key, value in self.variants[name].items():
                set_dotted(data, str(key), value, what=f"variants.{name}.{key}")
            run = from_dict(RunConfig, data, prefix=f"variants.{name}.")
        else:
            run = copy.deepcopy(self.run)
            run.rollout.method = name  # type: ignore[assignment]
        if seed is not None:
            run.seed = seed
            if self.warm_start_per_seed:
                run.sft.seed = seed
        return run

    def start_configs(self) -> list[RunConfig]:
        """One run config per distinct warm start the rows begin from (one, or one per seed)."""
        seeds = self.seeds if self.warm_start_per_seed else self.seeds[:1]
        return [self.start_config(seed) for seed in seeds]

    def start_config(self, seed: int) -> RunConfig:
        """The shared run config at `seed`: what `DIR/react/seed_<k>/` evaluates."""
        run = copy.deepcopy(self.run)
        run.seed = seed
        if self.warm_start_per_seed:
            run.sft.seed = seed
        return run


def evaluate_starting_policy(
    run: RunConfig, run_dir: Path, stop: StopRequest | None = None, progress: Callable[[int, int], None] | None = None
) -> None:
    """Held-out accuracy of `run`'s starting policy, written as the step-0 record of `run_dir` (one
    evaluation has no step boundary: a stop ends it at once, and it is redone); `progress(done, total)`
    hears its rollouts."""
    from trace_rl.run import evaluate_policy

    figures = evaluate_policy(run, progress=progress)
    write_start(run, run_dir, {k: v for k, v in figures.items() if k.startswith(("val/", "timing_s/"))})


def write_start(run: RunConfig, run_dir: Path, figures: dict[str, float]) -> None:
    folder = RunDir(run_dir)
    folder.write_config(run)
    folder.append_metrics({"step": 0, "rollout/rollouts_total": 0.0, "rollout/tokens_total": 0.0, **figures})


def run_compare(
    config: CompareConfig,
    out: str | Path,
    train_one: Job,
    evaluate_one: Job = evaluate_starting_policy,
    stop: StopRequest | None = None,
) -> dict[str, Any] | None:
    """Train every (method, seed) with `train_one(config, run_dir, stop)` and, with
    `config.evaluate_start`, evaluate each seed's starting policy with `evaluate_one` (both skip what
    is finished, so an interrupted comparison continues where it stopped), then summarise.

    With `config.workers > 1` the jobs go to that many processes, so `train_one` and `evaluate_one`
    must be picklable (module-level functions); make any shared warm start before calling. Once
    `stop` is requested (a signal in this process) no further job starts, running ones stop after
    their current step, and the result is None: the comparison is unfinished.
    """
    out = Path(out)
    pending: list[tuple[Job, RunConfig, Path]] = []
    if config.evaluate_start:
        for seed in config.seeds:
            run = config.start_config(seed)
            if not RunDir(out / START / f"seed_{seed}").metrics():
                pending.append((evaluate_one, run, out / START / f"seed_{seed}"))
    for seed in config.seeds:  # seed by seed, so a comparison cut short compares the methods on the same seeds
        for method in config.methods:
            run_dir = out / method / f"seed_{seed}"
            run = config.run_config(method, seed)
            if not _finished(run_dir, run.train.steps):
                pending.append((train_one, run, run_dir))
    if config.workers == 1:
        for job, run, run_dir in pending:
            if stop is not None and stop.requested:
                break
            job(run, run_dir, stop)
    else:
        _run_in_workers(pending, config.workers, stop)
    if stop is not None and stop.requested:
        return None
    summary = summarise(out, config)
    atomic_write(out / "summary.json", lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=1)))
    atomic_write(out / "summary.md", lambda tmp: Path(tmp).write_text(summary_table(summary)))
    return summary


class JobInterrupted(KeyboardInterrupt):
    """A worker's job ended at once by a second stop (or a stop outside any training loop); a
    KeyboardInterrupt, so no `except Exception` on the way (a tool's crash record) takes it for an error."""


_worker_stop = StopRequest()
"""In a worker process: the stop request its jobs run under, set by the main process's SIGTERM."""
_worker_busy = False
"""In a worker process: whether a job is running (an idle worker only notes a stop)."""


def _start_worker() -> None:
    """A worker ignores the terminal's SIGINT (it reaches the whole process group); the main process
    forwards a stop as SIGTERM: the first one stops a training loop after its step, the next (or one
    during a job with no step to stop at, such as an evaluation) at once. An idle worker only notes it."""

    def handle(signum: int, frame: object) -> None:
        first = _worker_stop.signal is None
        _worker_stop.signal = signum
        if not _worker_busy or (first and _worker_stop.listening):
            return
        raise JobInterrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, handle)


def _run_job(job: Job, run: RunConfig, run_dir: Path) -> None:
    global _worker_busy
    if _worker_stop.requested:  # a job queued before the stop reached this worker does not start
        return
    _worker_busy = True
    try:
        job(run, run_dir, _worker_stop)
    finally:
        _worker_busy = False


def _run_in_workers(pending: list[tuple[Job, RunConfig, Path]], workers: int, stop: StopRequest | None) -> None:
    """Run `pending` in `workers` processes. A failed job stops the others after their step and raises;
    `stop` (requested in this process) is forwarded to the workers; a second request stops them at once."""
    context = multiprocessing.get_context("spawn")  # no forked torch threads or open files
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_start_worker)
    futures = [pool.submit(_run_job, job, run, run_dir) for job, run, run_dir in pending]
    forwarded = False

    def forward() -> None:  # to every live worker; each counts the stops it gets
        for future in futures:
            future.cancel()
        for child in multiprocessing.active_children():
            try:
                child.terminate()  # SIGTERM
            except OSError:  # gone meanwhile
                pass

    if stop is not None:
        stop.listening = True
    drained = False  # every job has ended: nothing left to stop
    try:
        waiting: set[Future] = set(futures)
        while waiting:
            done, waiting = wait(waiting, timeout=0.2, return_when=FIRST_EXCEPTION)
            failed = next((f for f in done if not f.cancelled() and f.exception() is not None), None)
            if failed is not None and not (stop is not None and stop.requested and isinstance(failed.exception(), JobInterrupted)):
                if not forwarded:
                    forward()
                    forwarded = True
                wait(waiting)
                drained = True
                failed.result()  # raises the job's error, naming it
            if stop is not None and stop.requested and not forwarded:
                forward()
                forwarded = True
    except BaseException:  # a second stop here: the workers stop at once
        if not drained:
            forward()
        raise
    finally:
        if stop is not None:
            stop.listening = False
        pool.shutdown(wait=True, cancel_futures=True)


def _finished(run_dir: Path, steps: int) -> bool:
    return RunDir(run_dir).finished_steps() >= steps


def _run_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return RunDir(run_dir).metrics()


def summarise(out: Path, config: CompareConfig) -> dict[str, Any]:
    """Per method: ratios averaged over steps and seeds; final accuracy over seeds with its 95%
    interval (Student t); the evaluation's own standard error; rollouts and generated tokens spent,
    how many each method needed to first reach the baseline's final accuracy, and its final accuracy
    against the baseline's paired by seed (`accuracy_vs_baseline`, with its own interval).

    Only finished runs (all `run.train.steps` steps) count: an unfinished one's last evaluation is not
    its final accuracy. Runs begun but unfinished are listed under `unfinished` (method -> seed -> steps)."""
    acc_key = config.accuracy
    methods: dict[str, dict[str, float]] = {}
    curves: dict[str, list[tuple[float, float, float]]] = {}
    start_runs = {seed: _run_metrics(out / START / f"seed_{seed}") for seed in config.seeds}
    start_by_seed = {seed: _last(r, acc_key) for seed, r in start_runs.items() if r}
    start = _start_figures(list(start_runs.values()), acc_key)
    unfinished: dict[str, dict[int, int]] = {}
    finals: dict[str, dict[int, float]] = {}
    for method in config.methods:
        begun = {seed: _run_metrics(out / method / f"seed_{seed}") for seed in config.seeds}
        steps = config.run_config(method).train.steps
        by_seed = {seed: r for seed, r in begun.items() if r and r[-1]["step"] >= steps}
        if cut := {seed: int(r[-1]["step"]) for seed, r in begun.items() if r and seed not in by_seed}:
            unfinished[method] = cut
        if not by_seed:
            continue
        runs = list(by_seed.values())
        final_by_seed = finals[method] = {seed: _last(r, acc_key) for seed, r in by_seed.items()}
        final = np.array(list(final_by_seed.values()))
        eval_se = [_last(r, f"{acc_key}_se") for r in runs]
        gains = _per_seed_difference(final_by_seed, start_by_seed)
        methods[method] = {
            "effective_ratio": _mean_over_steps(runs, "tree/effective_ratio"),
            "effective_per_candidate": _mean_over_steps(runs, "tree/effective_per_candidate"),
            "mixed_budget_share": _mean_over_steps(runs, "tree/mixed_budget_share"),
            "final_accuracy": _nanmean(final),
            "final_accuracy_std": float(np.nanstd(final)),
            "final_accuracy_ci95": _ci95(final),
            "final_accuracy_eval_se": _nanmean(eval_se),
            "rollouts": float(np.mean([r[-1]["rollout/rollouts_total"] for r in runs])),
            "tokens": float(np.mean([r[-1]["rollout/tokens_total"] for r in runs])),
            "predictor_brier": _mean_over_steps(runs, "predictor/brier", after_step=5),
            "predictor_brier_constant": _mean_over_steps(runs, "predictor/brier_constant", after_step=5),
            **_brier_steps_over_quarter(runs),
            "allocation_overhead_share": _mean_over_steps(runs, "timing_s/allocation_overhead_share"),
            "accuracy_gain": _nanmean(gains),
            "accuracy_gain_ci95": _ci95(gains),
            "steps": float(np.mean([r[-1]["step"] for r in runs])),
            "seeds": float(len(runs)),
        }
        curve = _mean_curve(runs, acc_key)
        curves[method] = ([(0.0, 0.0, start["final_accuracy"])] if start else []) + curve
    baseline = config.methods[0]
    if baseline in methods:
        target = methods[baseline]["final_accuracy"]
        for method, figures in methods.items():
            figures["rollouts_to_baseline_accuracy"], figures["tokens_to_baseline_accuracy"] = _first_reach(curves[method], target)
            figures["rollouts_to_hold_baseline_accuracy"], figures["tokens_to_hold_baseline_accuracy"] = _holds_from(curves[method], target)
            if method != baseline:
                paired = _per_seed_difference(finals[method], finals[baseline])
                figures["accuracy_vs_baseline"], figures["accuracy_vs_baseline_ci95"] = _nanmean(paired), _ci95(paired)
                figures["accuracy_vs_baseline_seeds"] = float(np.count_nonzero(~np.isnan(paired)))
    summary: dict[str, Any] = {"methods": methods, "baseline": baseline, "accuracy_key": acc_key, "config": asdict(config)}
    if unfinished:
        summary["unfinished"] = unfinished
    if start:
        summary[START] = start
    return summary


def _nanmean(values: Any) -> float:
    """The mean of the values that are not NaN (NaN, without a warning, if none is)."""
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    return float(values.mean()) if values.size else float("nan")


def _last(run: list[dict[str, Any]], key: str) -> float:
    """The run's latest value of `key` (NaN if it never logged it)."""
    return next((float(m[key]) for m in reversed(run) if key in m), float("nan"))


def _start_figures(runs: list[list[dict[str, Any]]], acc_key: str) -> dict[str, float]:
    """The starting policy's held-out accuracy over the seeds evaluated ({} if none was)."""
    runs = [r for r in runs if r]
    if not runs:
        return {}
    accuracy = np.array([_last(r, acc_key) for r in runs])
    return {
        "final_accuracy": _nanmean(accuracy),
        "final_accuracy_ci95": _ci95(accuracy),
        "final_accuracy_eval_se": _nanmean([_last(r, f"{acc_key}_se") for r in runs]),
        "accuracy_greedy": _nanmean([_last(r, "val/accuracy_greedy") for r in runs]),
        "seeds": float(len(runs)),
    }


_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
"""Student t quantiles t_0.975 for 1..10 degrees of freedom (`t975` expands beyond)."""


def t975(dof: int) -> float:
    """Student t quantile t_0.975 for `dof` degrees of freedom: the table to 10, then the Cornish-Fisher
    expansion about the normal quantile (within 2e-4 of the exact value from 11 on). A normal 1.96 in its
    place would narrow a 12-seed interval by 11%."""
    if dof < 1:
        raise ValueError(f"t975 needs at least one degree of freedom, got {dof}")
    if dof <= len(_T975):
        return _T975[dof - 1]
    z = 1.959963984540054
    return (z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * dof**3))


def _ci95(values: np.ndarray) -> float:
    """Half-width of the 95% interval of the mean over seeds; NaN with fewer than two."""
    values = values[~np.isnan(values)]
    if values.size < 2:
        return float("nan")
    t = t975(values.size - 1)
    return float(t * values.std(ddof=1) / np.sqrt(values.size))


def _brier_steps_over_quarter(runs: list[list[dict[str, Any]]], after_step: int = 5) -> dict[str, float]:
    """The issue's per-step test of the predictor: the share of logged steps after the warm-up whose Brier
    is 0.25 (a constant 0.5's) or more, and the share more than two of that step's standard errors above it
    (`predictor/brier_se`): a step's Brier over 64 outcomes is noisy, so a sound predictor still crosses
    0.25 now and then (experiments/brier_floor.py), and only the second share says it is broken."""
    scored = [m for r in runs for m in r if "predictor/brier" in m and m["step"] > after_step]
    if not scored:
        return {"predictor_brier_over_quarter": float("nan"), "predictor_brier_over_quarter_2se": float("nan")}
    brier = np.array([m["predictor/brier"] for m in scored])
    se = np.array([m.get("predictor/brier_se", float("nan")) for m in scored])
    beyond = brier - 2 * se >= 0.25
    return {
        "predictor_brier_over_quarter": float(np.mean(brier >= 0.25)),
        "predictor_brier_over_quarter_2se": float("nan") if np.isnan(se).any() else float(np.mean(beyond)),
    }


def _mean_over_steps(runs: list[list[dict[str, Any]]], key: str, *, after_step: int = 0) -> float:
    values = [m[key] for r in runs for m in r if key in m and m["step"] > after_step]
    return float(np.mean(values)) if values else float("nan")


def _mean_curve(runs: list[list[dict[str, Any]]], key: str) -> list[tuple[float, float, float]]:
    """(rollouts spent, tokens generated, accuracy) at each evaluated step, averaged over the seeds that have it.
    What was spent is carried forward from the last line that logged it (0 before any), as the report's
    curves do: a run's `train.eval_on_start` line (step 0) has spent nothing and logs no counters."""
    by_step: dict[int, list[tuple[float, float, float]]] = {}
    for run in runs:
        rollouts = tokens = 0.0
        for m in run:
            rollouts, tokens = m.get("rollout/rollouts_total", rollouts), m.get("rollout/tokens_total", tokens)
            if key in m:
                by_step.setdefault(int(m["step"]), []).append((rollouts, tokens, m[key]))
    return [tuple(float(x) for x in np.mean(v, axis=0)) for _, v in sorted(by_step.items())]  # type: ignore[misc]


def _per_seed_difference(final: dict[int, float], reference: dict[int, float]) -> np.ndarray:
    """`final` minus `reference`, seed by seed, over the seeds both have: a run against its own seed's
    start (the gain), or against the baseline's run of that seed. Both runs of a seed start from the same
    policy and draw the same candidate prompts each step (DAPO's extra draws aside), so the difference
    leaves out what they share: the test of "ahead of the baseline" the paper's tables imply."""
    return np.array([final[seed] - reference[seed] for seed in sorted(set(final) & set(reference))], dtype=float)


def _first_reach(curve: list[tuple[float, float, float]], target: float) -> tuple[float, float]:
    """Rollouts and tokens spent when the mean accuracy first reached `target` (NaN if it never did)."""
    for rollouts, tokens, accuracy in curve:
        if accuracy >= target - 1e-12:
            return rollouts, tokens
    return float("nan"), float("nan")


def _holds_from(curve: list[tuple[float, float, float]], target: float) -> tuple[float, float]:
    """Rollouts and tokens spent from which the mean accuracy stays at or above `target` at every later
    evaluation (NaN if its last one is below). Unlike the first reach, one lucky evaluation does not count:
    with evaluations every 10 steps GRPO's own curve touched its final accuracy at step 20 and held it from
    step 80 (docs/results/learning_curve)."""
    held = (float("nan"), float("nan"))
    for rollouts, tokens, accuracy in reversed(curve):
        if accuracy < target - 1e-12:
            break
        held = (rollouts, tokens)
    return held


def summary_table(summary: dict[str, Any]) -> str:
    """The comparison as a Markdown table (`summary.md`, and the site's results pages, which
    `scripts/docs_hooks.py` makes from each committed summary.json with this function)."""
    baseline = summary.get("baseline", "the baseline")
    header = (
        "| method | seeds | effective ratio | effective gradient ratio (budget share in mixed groups) | final accuracy (95% CI over seeds) "
        f"| gain over the start | against {baseline}, paired by seed | evaluation SE | rollouts | rollouts to {baseline}'s final accuracy | tokens to it "
        "| rollouts from which it stays there | predictor Brier (after step 5) | running-mean constant's Brier "
        "| steps with Brier >= 0.25 (by over 2 SE) |"
    )
    lines = [header, "|" + "---|" * 15]
    nan = float("nan")
    start = summary.get(START)
    if start:
        lines.append(
            f"| {START} (start, no RL) | {start['seeds']:.0f} | — | — | {start['final_accuracy']:.3f} ± {_or_dash(start['final_accuracy_ci95'], '.3f')} "
            f"| — | — | {_or_dash(start['final_accuracy_eval_se'], '.3f')} | 0 | — | — | — | — | — | — |"
        )
    for method, f in summary["methods"].items():
        reach, tokens = f.get("rollouts_to_baseline_accuracy", nan), f.get("tokens_to_baseline_accuracy", nan)
        held = f.get("rollouts_to_hold_baseline_accuracy", nan)
        ci, se, brier = f.get("final_accuracy_ci95", nan), f.get("final_accuracy_eval_se", nan), f.get("predictor_brier", nan)
        gain, gain_ci = f.get("accuracy_gain", nan), f.get("accuracy_gain_ci95", nan)
        versus, versus_ci = f.get("accuracy_vs_baseline", nan), f.get("accuracy_vs_baseline_ci95", nan)
        over, over_2se = f.get("predictor_brier_over_quarter", nan), f.get("predictor_brier_over_quarter_2se", nan)
        crossings = "—" if np.isnan(over) else f"{over:.1%}" + ("" if np.isnan(over_2se) else f" ({over_2se:.1%})")
        lines.append(
            f"| {method} | {f['seeds']:.0f} | {f['effective_ratio']:.3f} | {f['mixed_budget_share']:.3f} "
            f"| {f['final_accuracy']:.3f} ± {_or_dash(ci, '.3f')} | {_or_dash(gain, '+.3f')} ± {_or_dash(gain_ci, '.3f')} "
            f"| {'—' if np.isnan(versus) else f'{versus:+.3f} ± ' + _or_dash(versus_ci, '.3f')} "
            f"| {_or_dash(se, '.3f')} | {f['rollouts']:.0f} "
            f"| {_or_dash(reach, '.0f')} | {_or_dash(tokens, '.0f')} | {_or_dash(held, '.0f')} | {_or_dash(brier, '.3f')} "
            f"| {_or_dash(f.get('predictor_brier_constant', nan), '.3f')} | {crossings} |"
        )
    reached = summary["methods"].get(baseline, {}).get("final_accuracy", nan)
    if start and reached <= start["final_accuracy"]:
        lines.append(
            f"\n{baseline} ends at {reached:.3f}, not above the start ({start['final_accuracy']:.3f}): every curve begins at the "
            f"start, so every method reaches {baseline}'s final accuracy before spending a rollout, and the columns "
            "of what reaching it cost say nothing here."
        )
    if summary.get("unfinished"):
        cut = "; ".join(f"{m} seed {seed} at step {steps}" for m, seeds in summary["unfinished"].items() for seed, steps in seeds.items())
        lines.append(f"\nNot yet counted (unfinished; the same compare command continues them): {cut}.")
    return "\n".join(lines) + "\n"


def _or_dash(value: float, spec: str) -> str:
    return "—" if value is None or np.isnan(value) else format(value, spec)
