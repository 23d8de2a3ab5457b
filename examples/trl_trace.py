"""Train the tiny policy with TRL's GRPOTrainer on TRACE trees, on CPU (needs the `trl` extra).

    python examples/trl_trace.py --steps 2 [key=value ...]
    python examples/trl_trace.py --config configs/gpu/trl_qwen3_1p7b_vllm.yaml --steps 200   # on a GPU

The run is `configs/smoke.yaml` (the multihop task, the tiny policy) made small enough for two cores:
eight training questions, a warm start of 200 steps on demonstrations of those same eight (cached,
made once, about a minute), two prompts of four rollouts a step. A policy warm-started that briefly
earns reward only on questions it was shown, so this is a check that TRL makes real updates on
TRACE's trees (rewards, a gradient, weights that move), not a held-out result; key=value arguments
override it further. `--config` runs another run config as it is (the GPU recipe
generates with a `vllm serve` server, which receives the weights after every step). Each prompt's four rollouts form one TRACE tree (two bare rollouts,
two continuations from the prefixes Stage 2 picks), and TRL trains on the tree advantages
(`trace_rl.integrations.trl`). Prints one JSON object per step (TRL's figures and the batch's
`tree/*`, `rollout/*`, `predictor/*`), then one with the steps, the training time and the largest change
of any trained weight.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from transformers import PrinterCallback, ProgressCallback, TrainerCallback

from trace_rl.infra.config import load_config
from trace_rl.integrations.trl import TraceGRPOTrainer, TraceRollout, grpo_config
from trace_rl.run import RunConfig, build_parts

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
OVERRIDES = (
    "prompts_per_step=2", "rollout.budget=4", "rollout.max_new_tokens=64", "task.max_turns=5",
    "task.train_tasks=8", "sft.demos=96", "sft.steps=200", "sft.batch_size=8",
)
"""A step takes seconds on two cores, and the policy earns reward: the smoke config's 10-step warm start
with 32-token turns over 3 turns never did (every reward, loss and gradient 0)."""


class JsonLines(TrainerCallback):
    """Prints each of TRL's logged steps as one JSON object."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        print(json.dumps({"step": state.global_step, **(logs or {})}), flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="generations (each one optimiser step)")
    parser.add_argument("--config", type=Path, default=None, help="a run config to use as it is (default: configs/smoke.yaml, made small)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    options = parser.parse_args(argv)
    base = [] if options.config else list(OVERRIDES)
    config = load_config(RunConfig, options.config or SMOKE, [*base, f"train.steps={options.steps}", *options.overrides])
    parts = build_parts(config)  # the warm start, cached after the first run
    rollout = TraceRollout.from_parts(parts, config)
    with tempfile.TemporaryDirectory() as output_dir:
        args = grpo_config(config, output_dir=output_dir, disable_tqdm=True)
        trainer = TraceGRPOTrainer(parts.policy.model, rollout, args, callbacks=[JsonLines()])
        trainer.remove_callback(PrinterCallback)  # it prints the same logs as Python dicts
        trainer.remove_callback(ProgressCallback)
        before = {name: p.detach().clone() for name, p in parts.policy.model.named_parameters() if p.requires_grad}
        begin = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - begin
    moved = max(float((p.detach() - before[name]).abs().max()) for name, p in parts.policy.model.named_parameters() if name in before)
    summary = {"steps": trainer.state.global_step, "train_s": round(seconds, 2), "num_generations": rollout.num_generations,
               "max_weight_change": moved}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
