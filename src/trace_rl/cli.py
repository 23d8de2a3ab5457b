"""`trace-rl` command line. Each command prints its headline figures as one JSON object on its last line.

This is the only module that writes to the terminal: every other module returns data (or rendered
text) and raises; commands here print it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from trace_rl.config import ConfigError


def _bench(args: argparse.Namespace) -> int:
    if args.what == "allocation":
        from trace_rl.bench import run_benchmark, summary_table

        result = run_benchmark(seeds=args.seeds, batches=args.batches)
        if not args.json:
            print(summary_table(result), file=sys.stderr)
        print(json.dumps(result))
        return 0
    raise AssertionError(args.what)  # argparse restricts the choices


def _tasks(args: argparse.Namespace) -> int:
    from trace_rl.agent.show import tasks_report

    text, summary = tasks_report(args)
    if text:
        print(text, end="")
    print(json.dumps(summary))
    return 0


def _rollout(args: argparse.Namespace) -> int:
    import numpy as np

    from trace_rl.config import load_config
    from trace_rl.run import RunConfig, build_parts
    from trace_rl.tree import write_jsonl

    config = load_config(RunConfig, args.config, args.overrides)
    parts = build_parts(config)
    rng = np.random.default_rng(config.seed)
    count = min(config.prompts_per_step, len(parts.train.tasks))
    tasks = [parts.train.tasks[int(i)] for i in rng.choice(len(parts.train.tasks), size=count, replace=False)]
    batch = parts.collector.collect(tasks)
    write_jsonl(batch.trees, args.out)
    metrics = batch.metrics()
    print(json.dumps({"budget": config.rollout.budget, "leaves": int(metrics["rollout/leaves"]), "out": str(args.out), **metrics}))
    return 0


def _train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from trace_rl.config import load_config
    from trace_rl.progress import progress_bar
    from trace_rl.run import RunConfig, headline, train_run
    from trace_rl.rundir import RunDir

    if args.resume:
        run_dir = Path(args.resume)
        config = load_config(RunConfig, run_dir / "config.yaml", args.overrides)
    elif args.config and args.out:
        run_dir = Path(args.out)
        config = load_config(RunConfig, args.config, args.overrides)
    else:
        raise ConfigError("give --config FILE --out RUN_DIR, or --resume RUN_DIR")
    with progress_bar() as bar:
        trainer = train_run(config, run_dir, resume=bool(args.resume), bar=bar)
    final = RunDir(run_dir).last_metrics()
    print(json.dumps({"run_dir": str(run_dir), "steps": trainer.step, **headline(final)}))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from trace_rl.compare import CompareConfig, run_compare, summary_table
    from trace_rl.config import load_config
    from trace_rl.progress import progress_bar
    from trace_rl.run import check_trainable, policy_source

    config = load_config(CompareConfig, args.config, args.overrides)
    check_trainable(config.run)
    if config.workers > 1:
        with progress_bar() as bar:  # the shared warm start, made once before the runs fan out
            task = bar.task("warm start", total=config.run.sft.steps)
            policy_source(config.run, progress=lambda step, loss: bar.update(task, step + 1, {"loss": loss}))
        print(f"training {len(config.methods) * len(config.seeds)} runs, {config.workers} at a time; "
              f"each run's progress is in its metrics.jsonl", file=sys.stderr)
        summary = run_compare(config, args.out, _train_compare_run)
    else:
        def train_one(run, run_dir):
            _train_compare_run(run, run_dir, bar=bar)

        with progress_bar() as bar:
            summary = run_compare(config, args.out, train_one)
    print(summary_table(summary), file=sys.stderr)
    print(json.dumps({"out": str(args.out), "methods": summary["methods"]}))
    return 0


def _train_compare_run(run, run_dir, bar=None) -> None:
    """One comparison run; a run cut short earlier continues from its checkpoint."""
    from trace_rl.run import train_run

    train_run(run, run_dir, resume=(run_dir / "checkpoints" / "latest").exists(), bar=bar)
    print(f"finished {run_dir}", file=sys.stderr, flush=True)


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from trace_rl.config import load_config
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
    from trace_rl.methods import METHODS

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
    bench.add_argument("--seeds", type=int, default=None, help="number of seeds (default: the benchmark's)")
    bench.add_argument("--batches", type=int, default=None, help="batches per seed (default: the benchmark's)")
    bench.set_defaults(func=_bench)

    methods = commands.add_parser("methods", help="list the methods `rollout.method` accepts, with their sources")
    methods.set_defaults(func=_methods)

    rollout = commands.add_parser("rollout", help="sample one batch of rollout trees and write them as JSONL")
    rollout.add_argument("--config", required=True, help="YAML run config (see configs/)")
    rollout.add_argument("--out", required=True, help="where to write the trees (JSONL, one tree a line)")
    rollout.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. rollout.budget=64")
    rollout.set_defaults(func=_rollout)

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
    evaluate.add_argument("--samples", type=int, default=None, help="sampled rollouts per task (default: train.eval_samples)")
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, FileExistsError, FileNotFoundError) as exc:  # bad input: say what, no traceback
        print(f"trace-rl {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
