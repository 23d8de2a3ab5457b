"""`trace-rl` command line. Each command prints its headline figures as one JSON object on its last line.

This is the only module that writes to the terminal: every other module returns data (or rendered
text) and raises; commands here print it.

SIGINT (Ctrl-C) and SIGTERM stop a command without a traceback, exiting 128 + the signal's number as
shells do: 130 for SIGINT, 143 for SIGTERM. During `train`'s steps the first one stops at the next
step boundary, which is checkpointed; a second one, or one before the steps begin (loading, the warm
start), stops at once, leaving the last checkpoint. Either way the last line says how to resume.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from trace_rl.agent.sandbox import SandboxUnavailable
from trace_rl.infra.config import ConfigError

if TYPE_CHECKING:
    from trace_rl.training.trainer import StopRequest


def _out_file(path: str) -> Path:
    """`--out FILE`, checked before any work, so that a rollout is never made only to be lost."""
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"--out {path} is a folder; give the path of the JSONL file to write")
    _check_writable(out.parent, path)
    return out


def _out_folder(path: str) -> Path:
    """`--out DIR` (created if missing), checked before any work: an existing folder or one that can be made."""
    out = Path(path)
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--out {path}: {existing} is a file, not a folder")
    _check_writable(existing, path)
    return out


def _check_writable(folder: Path, path: str) -> None:
    if not folder.is_dir():
        raise ConfigError(f"--out {path}: the folder {folder} does not exist")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(f"--out {path}: cannot write in {folder}: {exc.strerror or exc}") from exc


def _positive_int(text: str) -> int:
    """argparse type of counts such as --samples: a typo is refused before any work, not after the model loads."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _bench(args: argparse.Namespace) -> int:
    if args.what == "allocation":
        from trace_rl.research.bench import run_benchmark, summary_table

        result = run_benchmark(seeds=args.seeds, batches=args.batches)
        if not args.json:
            print(summary_table(result), file=sys.stderr)
        print(json.dumps(result))
        return 0
    raise AssertionError(args.what)  # argparse restricts the choices


def _tasks(args: argparse.Namespace) -> int:
    """`trace-rl tasks`. A task set it cannot load (an unknown name, a malformed task file, a missing
    package) is bad input: one line and exit 2, not a traceback (`main` shows a task file's warnings,
    ids renamed, as one line each)."""
    from trace_rl.agent.show import tasks_report
    from trace_rl.agent.tasks import check_name

    try:
        for name in args.names or ():
            check_name(name)
        text, summary = tasks_report(args)
    except ConfigError:
        raise
    except (ValueError, ImportError) as exc:  # a task file (`TaskFileError`), a dataset name or the install: say what
        raise ConfigError(str(exc)) from None
    if text:
        print(text, end="")
    print(json.dumps(summary))
    return 0


def _verl_data(args: argparse.Namespace) -> int:
    from trace_rl.infra.config import load_config
    from trace_rl.integrations.verl.data import require_pyarrow, write_parquet
    from trace_rl.run import RunConfig

    try:
        require_pyarrow()
    except ImportError as exc:  # a missing install, said in one line like a bad config
        raise ConfigError(str(exc)) from None
    config = load_config(RunConfig, args.config, args.overrides)
    paths = write_parquet(config, _out_folder(args.out))
    print(json.dumps({name: str(path) for name, path in paths.items()}))
    return 0


def _rollout(args: argparse.Namespace) -> int:
    import numpy as np

    from trace_rl.core.tree import write_jsonl
    from trace_rl.infra.config import load_config
    from trace_rl.run import RunConfig, build_parts

    config = load_config(RunConfig, args.config, args.overrides)
    out = _out_file(args.out)
    parts = build_parts(config)
    rng = np.random.default_rng(config.seed)
    count = min(config.prompts_per_step, len(parts.train.tasks))
    tasks = [parts.train.tasks[int(i)] for i in rng.choice(len(parts.train.tasks), size=count, replace=False)]
    batch = parts.collector.collect(tasks)
    write_jsonl(batch.trees, out)
    metrics = batch.metrics()
    print(json.dumps({"budget": config.rollout.budget, "leaves": int(metrics["rollout/leaves"]), "out": str(args.out), **metrics}))
    return 0


def _warm_start(args: argparse.Namespace) -> int:
    """The warm start as its own step: `train` and `compare` run it first and find it cached."""
    from trace_rl.infra.config import load_config
    from trace_rl.infra.progress import progress_bar, warm_start_progress
    from trace_rl.run import RunConfig, check_trainable, policy_source

    config = load_config(RunConfig, args.config, args.overrides)
    check_trainable(config)
    trained: list[int] = []
    with _signals(), progress_bar() as bar:
        show = warm_start_progress(bar, config.sft.steps)

        def progress(step: int, loss: float) -> None:
            trained.append(step)
            show(step, loss)

        policy = policy_source(config, progress=progress)
    print(json.dumps({"policy": policy, "warm_start": config.model.warm_start, "trained_steps": len(trained)}))
    return 0


def _train(args: argparse.Namespace) -> int:
    from trace_rl.storage.rundir import RunDir

    folder = args.resume or args.out
    if folder and Path(folder).is_dir():  # a second writer refuses now, not after seconds of imports
        with RunDir(folder).lock():
            return _train_locked(args)
    return _train_locked(args)


def _train_locked(args: argparse.Namespace) -> int:
    from trace_rl.infra.config import load_config
    from trace_rl.infra.progress import progress_bar
    from trace_rl.run import RunConfig, headline, load_run_config, train_run
    from trace_rl.storage.rundir import RunDir
    from trace_rl.training.trainer import StopRequest

    if args.resume:
        run_dir = Path(args.resume)
        config = load_run_config(run_dir / "config.yaml", args.overrides)
    elif args.config and args.out:
        config = load_config(RunConfig, args.config, args.overrides)
        run_dir = _out_folder(args.out)
    else:
        raise ConfigError("give --config FILE --out RUN_DIR, or --resume RUN_DIR")
    stop = StopRequest()
    try:
        with _signals(stop), progress_bar() as bar:
            trainer = train_run(config, run_dir, resume=bool(args.resume), bar=bar, stop=stop)
    except Stopped as exc:
        print(f"trace-rl train: stopped by {exc} at once; {_resume_hint(run_dir)}", file=sys.stderr)
        return 128 + exc.signum
    if stop.signal is not None and trainer.step < config.train.steps:  # (one during the last step: the run is done)
        name = signal.Signals(stop.signal).name
        print(f"trace-rl train: stopped by {name} after step {trainer.step}; {_resume_hint(run_dir)}", file=sys.stderr)
        return 128 + stop.signal
    final = RunDir(run_dir).last_metrics()
    print(json.dumps({"run_dir": str(run_dir), "steps": trainer.step, **headline(final)}))
    return 0


def _resume_hint(run_dir: Path) -> str:
    from trace_rl.storage.rundir import RunDir

    folder = RunDir(run_dir)
    if not folder.config_path.is_file():
        return f"nothing was written to {run_dir}"
    steps = folder.checkpoint_files()
    kept = f"the last checkpoint is step {max(steps)}" if steps else "no checkpoint was written yet"
    return f"{kept}; continue with: trace-rl train --resume {run_dir}"


def _compare(args: argparse.Namespace) -> int:
    from trace_rl.infra.config import load_config
    from trace_rl.infra.progress import progress_bar, warm_start_progress
    from trace_rl.research.compare import CompareConfig, evaluate_starting_policy, run_compare, summary_table
    from trace_rl.run import check_trainable, policy_source
    from trace_rl.training.trainer import StopRequest

    config = load_config(CompareConfig, args.config, args.overrides)
    check_trainable(config.run)
    _out_folder(args.out)
    stop = StopRequest()
    again = f"run the same command again to continue: trace-rl compare --config {args.config} --out {args.out}"
    try:
        with _signals(), progress_bar() as bar:  # the warm starts, each made once before any run or evaluation
            for start in config.start_configs():
                policy_source(start, progress=warm_start_progress(bar, start.sft.steps))
        if config.workers > 1:
            starts = f" after {len(config.seeds)} evaluations of the starting policy" if config.evaluate_start else ""
            print(f"training {len(config.methods) * len(config.seeds)} runs{starts}, {config.workers} at a time (finished ones are skipped); "
                  f"each run says where it is in a line a minute and logs its steps to its metrics.jsonl", file=sys.stderr)
            with _signals(stop, what="every run stops after its current step"):
                summary = run_compare(config, args.out, _train_compare_run, stop=stop)
        else:
            def train_one(run, run_dir, stop):
                _train_compare_run(run, run_dir, stop, bar=bar)

            def evaluate_one(run, run_dir, stop):
                task = bar.task(f"{run_dir.parent.name} {run_dir.name}: the starting policy", total=1)

                def progress(done: int, total: int) -> None:
                    bar.set_total(task, total)
                    bar.update(task, done, {})

                evaluate_starting_policy(run, run_dir, stop, progress=progress)

            with _signals(stop), progress_bar() as bar:
                summary = run_compare(config, args.out, train_one, evaluate_one, stop=stop)
    except Stopped as exc:
        print(f"trace-rl compare: stopped by {exc} at once (each run keeps its last checkpoint); {again}", file=sys.stderr)
        return 128 + exc.signum
    if summary is None:
        assert stop.signal is not None
        print(f"trace-rl compare: stopped by {signal.Signals(stop.signal).name} (every run checkpointed where it stopped); {again}", file=sys.stderr)
        return 128 + stop.signal
    print(summary_table(summary), file=sys.stderr)
    print(json.dumps({"out": str(args.out), "methods": summary["methods"]}))
    return 0


def _train_compare_run(run, run_dir, stop=None, bar=None) -> None:
    """One comparison run; a run cut short earlier continues from its checkpoint (or its step 0)."""
    from trace_rl.infra.progress import progress_bar
    from trace_rl.run import train_run
    from trace_rl.storage.rundir import RunDir

    if bar is None:  # a worker process: plain lines (the workers share one terminal), one a minute
        with progress_bar(plain=True, log_every_s=60.0) as lines:
            train_run(run, run_dir, resume=RunDir(run_dir).config_path.is_file(), bar=lines, stop=stop)
    else:
        train_run(run, run_dir, resume=RunDir(run_dir).config_path.is_file(), bar=bar, stop=stop)
    if stop is None or not stop.requested:
        print(f"finished {run_dir}", file=sys.stderr, flush=True)


def _eval(args: argparse.Namespace) -> int:
    from trace_rl.infra.config import load_config
    from trace_rl.run import RunConfig, evaluate_policy

    if args.run_dir and "=" in args.run_dir and not Path(args.run_dir).exists():
        args.overrides.insert(0, args.run_dir)  # `eval --config F key=value`: argparse filled RUN_DIR first
        args.run_dir = None
    if args.run_dir and args.config:
        raise ConfigError("give RUN_DIR (its latest checkpoint) or --config FILE (the starting policy), not both")
    if not args.run_dir and not args.config:
        raise ConfigError("give RUN_DIR (its latest checkpoint) or --config FILE (the starting policy)")
    run_dir = Path(args.run_dir) if args.run_dir else None
    config = load_config(RunConfig, run_dir / "config.yaml" if run_dir else args.config, args.overrides)
    result = evaluate_policy(config, run_dir, samples=args.samples)
    print(json.dumps({"run_dir": None if run_dir is None else str(run_dir), **result}))
    return 0


def _report(args: argparse.Namespace) -> int:
    from trace_rl.report import build_report

    try:
        report = build_report(args.run_dir)
    except (NotADirectoryError, ValueError, ModuleNotFoundError) as exc:
        raise ConfigError(str(exc)) from exc
    for warning in report.warnings:
        print(f"trace-rl report: warning: {warning}", file=sys.stderr)
    print(report.html)
    figures = {"report": str(report.html), "plots": [str(p) for p in report.plots], "bytes": report.html.stat().st_size}
    print(json.dumps({**figures, "warnings": len(report.warnings)}))
    return 0


def _methods(args: argparse.Namespace) -> int:
    from trace_rl.planning.methods import METHODS

    for spec in METHODS.values():
        print(f"{spec.name:<13} {spec.description}  [{spec.source}]", file=sys.stderr)
    print(json.dumps({"methods": [spec.describe() for spec in METHODS.values()]}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trace-rl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="run a built-in benchmark")
    bench.add_argument("what", choices=["allocation"], help="allocation: the latent-tree simulator benchmark")
    bench.add_argument("--json", action="store_true", help="print only the JSON result")
    bench.add_argument("--seeds", type=_positive_int, default=None, help="number of seeds (default: the benchmark's)")
    bench.add_argument("--batches", type=_positive_int, default=None, help="batches per seed (default: the benchmark's)")
    bench.set_defaults(func=_bench)

    methods = commands.add_parser("methods", help="list the methods `rollout.method` accepts, with their sources")
    methods.set_defaults(func=_methods)

    rollout = commands.add_parser("rollout", help="sample one batch of rollout trees and write them as JSONL")
    rollout.add_argument("--config", required=True, help="YAML run config (see configs/)")
    rollout.add_argument("--out", required=True, help="where to write the trees (JSONL, one tree a line)")
    rollout.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. rollout.budget=64")
    rollout.set_defaults(func=_rollout)

    verl_data = commands.add_parser("verl-data", help="write a run config's task splits as the parquet files verl's dataset reads")
    verl_data.add_argument("--config", required=True, help="trace-rl run config (the one verl's +trace_rl.config names)")
    verl_data.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    verl_data.add_argument("overrides", nargs="*", help="dotted key=value overrides, as verl's +trace_rl.overrides")
    verl_data.set_defaults(func=_verl_data)

    warm = commands.add_parser("warm-start", help="make (or find cached) the warm-started policy a run config starts from")
    warm.add_argument("--config", help="YAML run config (see configs/)")
    warm.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. sft.steps=300")
    warm.set_defaults(func=_warm_start)

    train = commands.add_parser("train", help="train a policy (warm start, then RL with the configured method)")
    train.add_argument("--config", help="YAML run config (see configs/)")
    train.add_argument("--out", help="run folder to create")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a killed run from its last checkpoint")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=10")
    train.set_defaults(func=_train)

    compare = commands.add_parser("compare", help="train several methods at the same seeds, budget and steps")
    compare.add_argument("--config", required=True, help="YAML compare config (see configs/compare.yaml)")
    compare.add_argument("--out", required=True, help="folder for the runs and summary.json")
    compare.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. run.train.steps=5")
    compare.set_defaults(func=_compare)

    evaluate = commands.add_parser("eval", help="held-out accuracy (greedy and sampled) of a run's latest checkpoint")
    evaluate.add_argument("run_dir", nargs="?", help="a run folder (its config.yaml and latest checkpoint)")
    evaluate.add_argument("--config", help="evaluate the starting (warm-started) policy of this config instead")
    evaluate.add_argument("--samples", type=_positive_int, default=None, help="sampled rollouts per task (default: train.eval_samples)")
    evaluate.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. task.test_tasks=128")
    evaluate.set_defaults(func=_eval)

    report = commands.add_parser("report", help="write RUN_DIR/report.html: tables, plots, rollout tree viewer")
    report.add_argument("run_dir", help="a run folder (train) or a comparison folder (compare)")
    report.set_defaults(func=_report)

    from trace_rl.agent.show import add_arguments

    tasks = commands.add_parser("tasks", help="list bundled tasks with rendered prompts and oracle rollouts")
    add_arguments(tasks)
    tasks.set_defaults(func=_tasks)
    return parser


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM, stopping a command at once; its text is the signal's name."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def _signals(stop: StopRequest | None = None, what: str = "stopping after this step (it will be checkpointed)") -> Iterator[None]:
    """SIGINT and SIGTERM for the block: while `stop` is listening (a training loop runs) the first one
    asks it to stop at the next step boundary (`what` says so); otherwise, or the second time,
    `Stopped` is raised at once."""

    def handle(signum: int, frame: object) -> None:
        if stop is not None and stop.listening and stop.signal is None:
            stop.signal = signum
            name = signal.Signals(signum).name
            # os.write, not print: a handler may run while the main thread is inside a print to stderr
            os.write(2, f"\ntrace-rl: {name}: {what}; send it again to stop now\n".encode())
            return
        raise Stopped(signum)

    previous = {number: signal.signal(number, handle) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


@contextmanager
def _warnings_as_lines(command: str) -> Iterator[None]:
    """Run-folder and task-file warnings (a checkpoint skipped, a config kept, task ids made unique) as one
    `trace-rl CMD: warning:` line each."""
    from trace_rl.agent.tasks.loaders import TaskFileWarning
    from trace_rl.storage.rundir import RunDirWarning

    show = warnings.showwarning

    def one_line(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if issubclass(category, (RunDirWarning, TaskFileWarning)):
            print(f"trace-rl {command}: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = one_line
    try:
        yield
    finally:
        warnings.showwarning = show


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _signals(), _warnings_as_lines(args.command):
            return int(args.func(args) or 0)
    except Stopped as exc:
        print(f"trace-rl {args.command}: stopped by {exc}", file=sys.stderr)
        return 128 + exc.signum
    except (ConfigError, FileExistsError, FileNotFoundError) as exc:  # bad input: say what, no traceback
        print(f"trace-rl {args.command}: {' '.join(str(exc).split())}", file=sys.stderr)  # one line, whatever the message
        return 2
    except SandboxUnavailable as exc:  # this machine cannot run model code: say which setting helps
        where = "--sandbox-python PATH or --sandbox-isolation" if args.command == "tasks" else "task.sandbox.python=PATH or task.sandbox.isolation"
        print(f"trace-rl {args.command}: {exc}. Choose the sandbox with {where} (docs/reliability.md, 'The sandbox')", file=sys.stderr)
        return 2


def run() -> None:
    """The `trace-rl` process: `main`, then exit with its code. Outside `main`'s own handling (before it,
    and after it returned, while the interpreter shuts torch down) a SIGINT or SIGTERM ends the process at
    once with 128 + its number, as a stop during a command does: left to the default action, a second
    SIGTERM arriving as a stopped run exits would kill the process, which a caller sees as a signal
    death (-15), not exit 143. `main` restores this handler when its block ends, so no window is left."""

    def exit_now(signum: int, frame: object) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()  # what the command printed last (its JSON line) is still wanted
            except (OSError, ValueError, RuntimeError):
                pass
        os._exit(128 + signum)

    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, exit_now)
    sys.exit(main())


if __name__ == "__main__":
    run()
