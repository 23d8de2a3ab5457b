"""Speed of the warm start's optimiser steps: right-padded rows against packed rows, fp32 and bf16.

    python benchmarks/warm_start_speed.py                 # 150 steps per variant, the demo's recipe
    python benchmarks/warm_start_speed.py --steps 40      # quicker, noisier
    python benchmarks/warm_start_speed.py sft.demos=1000  # run-config overrides, key=value
    python benchmarks/warm_start_speed.py --variants packed --steps 30   # one variant: a CPU's step rate
    python benchmarks/warm_start_speed.py --quick         # `make bench`: padded and packed fp32, 4 steps each, 1 thread

Each variant trains the `tiny` policy from the same copy-ready init on the same batches of the run's
real demonstrations (`trace_rl.training.sft`: `sft_inputs`, `length_batches`), the steps `train_sft`
takes (`batch_loss`, AdamW, gradient clipping), in its own process, so that its
resident memory is its own. Variants: `padded` (`sft.packing=false`, the recipe before), `packed`
(the default), and each under bf16 autocast. Timed: mean seconds per step after `--warmup`
steps, tokens through the model per second, and the growth of peak resident memory over the timed
steps; ratios are against `padded` fp32 in the same run. Checked: the first batch's loss of each
fp32 variant (packed equals padded up to float rounding). Prints one JSON object (`common.emit`; the
CPU's flags and matrix rate are its `machine`).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from common import arguments, emit, parse_args

VARIANTS = {"padded": (False, "fp32"), "packed": (True, "fp32"), "padded_bf16": (False, "bf16"), "packed_bf16": (True, "bf16")}
"""name -> (`sft.packing`, `sft.precision`)."""


def run_variant(name: str, overrides: list[str], steps: int, warmup: int, threads: int = 0) -> dict:
    import torch

    from trace_rl.infra.config import load_config
    from trace_rl.run import RunConfig, build_env, task_splits
    from trace_rl.training import sft

    packing, precision = VARIANTS[name]
    config = load_config(RunConfig, None, overrides)
    demos, _ = task_splits(config)
    env = build_env(config, demos)
    policy, _, sequences = sft.sft_inputs("tiny", demos, env, config.sft)
    model = policy.model.train()
    torch.manual_seed(0)
    torch.set_num_threads(threads or os.cpu_count() or 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.sft.lr)
    batches = sft.length_batches([len(ids) for ids, _ in sequences], config.sft.batch_size, np.random.default_rng(0))
    times, tokens, losses, rss = [], 0, [], 0
    for step in range(warmup + steps):
        if step == warmup:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        batch = [sequences[i] for i in next(batches)]
        begin = time.perf_counter()
        loss, size = sft.batch_loss(model, batch, packed=packing, precision=precision)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step >= warmup:
            times.append(time.perf_counter() - begin)
            tokens += size
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    return {
        "seconds_per_step": round(float(np.mean(times)), 4),
        "tokens_per_second": round(tokens / sum(times)),
        "tokens_per_step": round(tokens / steps),
        "peak_rss_growth_mb": round(grown / 1024, 1),
        "first_loss": losses[0],
        "last_loss_mean_10": round(float(np.mean(losses[-10:])), 4),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="which variants to time (ratios need `padded`)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core, as the warm start runs)")
    parser.add_argument("overrides", nargs="*", help="run config overrides, key=value")
    args = parse_args(parser, argv, steps=4, warmup=1, variants=["padded", "packed"], threads=1, overrides=["sft.demos=200"])
    results = {}
    for name in args.variants:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results[name] = pool.submit(run_variant, name, args.overrides, args.steps, args.warmup, args.threads).result()
    if "padded" in results:
        base = results["padded"]["seconds_per_step"]
        for result in results.values():
            result["speedup_over_padded_fp32"] = round(base / result["seconds_per_step"], 3)
    emit(
        "warm_start_speed",
        config=arguments(args),
        results={
            **({"packed_loss_minus_padded": results["packed"]["first_loss"] - results["padded"]["first_loss"]}
               if {"packed", "padded"} <= results.keys() else {}),
            "variants": results,
        },
        baseline="padded fp32 (sft.packing=false)" if "padded" in results else None,
        speedup={name: result["speedup_over_padded_fp32"] for name, result in results.items()} if "padded" in results else None,
    )


if __name__ == "__main__":
    main()
