"""Soak run: many training steps in one process, its memory (RSS) per step, and the run folder's record.

    python benchmarks/soak.py                              # configs/smoke.yaml, 100 steps
    python benchmarks/soak.py --steps 200 --warmup 20 key=value ...
    python benchmarks/soak.py --quick                      # `make bench`: 6 steps, the shape only

A long run must not grow: the engine's prefix cache is bounded and emptied on new weights, trees are
written and dropped, the predictor's replay buffer is capped. This trains `--steps` steps of the
config (the smoke config: the tiny model, small budget) into a temporary run folder, reads the
process's resident memory after every step (`/proc/self/statm`), and prints one JSON object
(`common.emit`; memory is compared with the first step after the warm-up, so `speedup` is null): the
RSS curve (MiB per step), its range after `--warmup` steps relative to the first step after the
warm-up (`rss_growth_after_warmup`, pass when within `--tolerance`, 10%), and whether
`metrics.jsonl` holds exactly one line per step. Not part of the test suite (about 5 minutes on 2
cores once the smoke warm start is cached; `--quick`'s 6 steps say nothing about growth).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from common import arguments, emit, parse_args

from trace_rl.infra.config import load_config
from trace_rl.run import RunConfig, build_parts, build_trainer
from trace_rl.storage.rundir import read_metrics

REPO = Path(__file__).resolve().parents[1]


def rss_mib() -> float:
    """Resident memory of this process now (Linux), in MiB."""
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "smoke.yaml"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("overrides", nargs="*")
    args = parse_args(parser, argv, steps=6, warmup=2)
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be in [0, --steps)")
    overrides = [f"train.steps={args.steps}", "train.eval_every=0", f"train.checkpoint_every={max(1, args.steps // 4)}", *args.overrides]
    config = load_config(RunConfig, args.config, overrides)
    parts = build_parts(config)
    curve: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        trainer = build_trainer(config, parts, Path(folder))
        step_times: list[float] = []

        def record(step: int, metrics: dict[str, float]) -> None:
            curve.append(round(rss_mib(), 1))
            step_times.append(metrics["timing_s/step"])

        trainer.run(on_step=record)
        steps = [int(record["step"]) for record in read_metrics(Path(folder) / "metrics.jsonl")]
    after = curve[args.warmup :]
    growth = (max(after) - min(after)) / after[0]
    result = {
        "rss_mib": curve,
        "rss_first_after_warmup": after[0],
        "rss_max_after_warmup": max(after),
        "rss_growth_after_warmup": round(growth, 4),
        "rss_flat": growth <= args.tolerance,
        "one_metrics_line_per_step": steps == list(range(1, args.steps + 1)),
        "step_s_mean_after_warmup": round(sum(step_times[args.warmup :]) / len(after), 3),
    }
    emit("soak", config={**arguments(args), "overrides": overrides}, results=result,
         baseline="memory: the first step after --warmup", speedup=None)
    return result


if __name__ == "__main__":
    main()
