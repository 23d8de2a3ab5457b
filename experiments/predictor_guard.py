"""TRACE with a predictor that is wrong on purpose, with and without the guard (`predictor.guard`).

On the latent-tree simulator (`trace_rl.research.sim`, planned by the code that trains, `trace_rl.research.bench.run_batch`),
in the paper's regime (32 candidate prompts, budget 64), each world runs TRACE with the shared
predictor learning online from its own trees, its estimates spoiled one of three ways before the
allocator reads them:

- `inverted`: 1 - p (its ranking upside down). Stage 1 hardly notices: a prompt's chance to end
  mixed is symmetric in p and 1 - p, so only Stage 2 (whose values read the observed outcomes) is misled;
- `contrarian`: |p - 0.5| (the chance to mix upside down: prompts that always agree look ideal at
  0.5, the ones that mix look hopeless at 0), the spoiling that aims at what TRACE allocates by;
- `shuffled`: the estimates of each call permuted at random (its ranking noise, its spread kept);
- `shifted`: honest estimates, but halfway through the run the topics swap difficulties (a task mix
  that moves under a predictor that has learnt the old one).

Rows: `grpo` (uniform, the floor a broken predictor should not fall below), `trace` and
`trace+guard` on the clean predictor, and both again under each spoiling. Figures are the effective
ratio (mixed prompts per prompt sampled), the effective prompts per candidate (mixed prompts per
candidate prompt: concentrating the budget on fewer prompts raises the first by itself, not this
one) and the budget share in mixed groups, averaged over the batches after `--warmup` and over
`--seeds` worlds; `vs_grpo` is each row's budget share in mixed groups over GRPO's, `guard_shrink`
the guard's mean λ (1: trusted, 0: ignored).

    python experiments/predictor_guard.py [--seeds 3] [--batches 40] [--warmup 10]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from trace_rl.core.tree import History
from trace_rl.planning.metrics import tree_metrics
from trace_rl.predictor import GuardedPredictor, HashedNgramPredictor, backup_targets
from trace_rl.research.bench import BenchConfig, run_batch
from trace_rl.research.sim import LatentTreeSimulator

SPOILINGS = ("clean", "inverted", "contrarian", "shuffled", "shifted")


class Spoiled:
    """The shared predictor, learning as usual, with its answers spoiled (`inverted` / `contrarian` / `shuffled`)."""

    def __init__(self, inner: HashedNgramPredictor, mode: str, seed: int) -> None:
        self.inner, self.mode, self.rng = inner, mode, np.random.default_rng(seed)

    def predict(self, histories: Sequence[History]) -> np.ndarray:
        p = self.inner.predict(histories)
        if self.mode == "inverted":
            return 1.0 - p
        if self.mode == "contrarian":
            return np.abs(p - 0.5)
        if self.mode == "shuffled":
            return self.rng.permutation(p)
        return p

    def update(self, histories, targets, weights) -> dict[str, float]:
        return self.inner.update(histories, targets, weights)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def run_world(spoiling: str, guard: bool | None, cfg: BenchConfig, seed: int, batches: int, warmup: int) -> dict[str, float]:
    """One world's mean figures for `trace` (guard True / False) or `grpo` (guard None)."""
    sim = LatentTreeSimulator(cfg.sim, seed=seed)
    predictor: Any = None
    if guard is not None:
        predictor = Spoiled(HashedNgramPredictor(cfg.predictor, seed=seed), spoiling, seed)
        if guard:
            predictor = GuardedPredictor(predictor, window=cfg.predictor.guard_window)
    figures: dict[str, list[float]] = {"effective_ratio": [], "effective_per_candidate": [], "mixed_budget_share": [], "guard_shrink": []}
    for batch in range(batches):
        if spoiling == "shifted" and batch == batches // 2:
            sim.topic_logit = -sim.topic_logit  # hard topics turn easy and easy ones hard
        prompts = sim.sample_prompts(cfg.prompts_per_batch, np.random.default_rng([seed, batch, 1]))
        trees = run_batch("grpo" if guard is None else "trace", prompts, sim, cfg, np.random.default_rng([seed, batch, 2]), predictor)
        if batch >= warmup:
            metrics = tree_metrics(trees)
            figures["effective_ratio"].append(metrics["tree/effective_ratio"])
            figures["effective_per_candidate"].append(metrics["tree/effective_per_candidate"])
            figures["mixed_budget_share"].append(metrics["tree/mixed_budget_share"])
            if isinstance(predictor, GuardedPredictor):
                figures["guard_shrink"].append(predictor.shrink)
        if predictor is not None:
            predictor.update(*backup_targets(trees))
    return {k: float(np.mean(v)) for k, v in figures.items() if v}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="simulated worlds (default 3)")
    parser.add_argument("--batches", type=int, default=40, help="batches per world (default 40)")
    parser.add_argument("--warmup", type=int, default=10, help="batches left out of the figures (default 10)")
    args = parser.parse_args(argv)
    base = BenchConfig(prompts_per_batch=32, budget=64)
    cfg = replace(base, predictor=replace(base.predictor, guard=True))
    rows: dict[str, tuple[str, bool | None]] = {"grpo": ("clean", None)}
    for spoiling in SPOILINGS:
        suffix = "" if spoiling == "clean" else f" ({spoiling})"
        rows[f"trace{suffix}"] = (spoiling, False)
        rows[f"trace+guard{suffix}"] = (spoiling, True)
    result: dict[str, Any] = {"bench": "predictor_guard", "prompts": cfg.prompts_per_batch, "budget": cfg.budget,
                              "seeds": args.seeds, "batches": args.batches, "warmup": args.warmup, "rows": {}}
    for name, (spoiling, guard) in rows.items():
        worlds = [run_world(spoiling, guard, cfg, seed, args.batches, args.warmup) for seed in range(args.seeds)]
        result["rows"][name] = {k: float(np.mean([w[k] for w in worlds])) for k in worlds[0]}
    grpo = result["rows"]["grpo"]["mixed_budget_share"]
    for figures in result["rows"].values():
        figures["vs_grpo"] = figures["mixed_budget_share"] / grpo
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
