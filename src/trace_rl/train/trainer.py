"""The training loop: collect trees, compute advantages, update the policy, update the predictor.

One step, in the order of the paper:

    trees      = collector.collect(tasks)                 # Stage 1 + Stage 2 under the budget
    advantages = estimator(trees)                          # per node; observation tokens masked
    policy     ← clipped policy gradient over policy tokens (token mean, mini-batches, epochs)
    predictor  ← tree backup targets                       # serves allocation only

Every step appends one line to `metrics.jsonl` and writes its trees; checkpoints hold everything
needed to continue bit-for-bit (policy, optimiser, predictor, every RNG, counters), written
atomically, so a killed run resumes from its last checkpoint and reaches the same numbers.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from trace_rl.advantage import DEFAULT_ESTIMATOR, advantage_metrics, get_estimator
from trace_rl.agent.types import Task
from trace_rl.models import token_logprobs
from trace_rl.predictor.base import backup_targets, brier_score, expected_calibration_error
from trace_rl.report.plots import read_metrics
from trace_rl.train.loss import policy_loss
from trace_rl.train.sequences import TrainSequence, pad_batch, tree_sequences
from trace_rl.tree import RolloutTree, tree_metrics, write_jsonl

METHOD_ESTIMATOR = {
    "grpo": "grpo",
    "dapo": "grpo",
    "prompt_only": "grpo",
    "random_tree": "tree_grpo",
    "trace_stage1": DEFAULT_ESTIMATOR,
    "trace_stage2": DEFAULT_ESTIMATOR,
    "trace": DEFAULT_ESTIMATOR,
}
"""Each method's advantage estimator unless `train.advantage` names another."""


@dataclass
class TrainConfig:
    """The policy update, evaluation and bookkeeping."""

    steps: int = 20
    lr: float = 5e-5
    weight_decay: float = 0.0
    epochs: int = 1
    """Passes over each step's data (PPO epochs)."""
    mini_batches: int = 2
    """Optimiser steps per epoch; the step's sequences are split into this many mini-batches."""
    micro_batch_size: int = 8
    """Sequences per forward/backward (gradients accumulate over a mini-batch)."""
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    """KL to the starting policy (k3 estimator); 0 turns the reference model off."""
    grad_clip: float = 1.0
    advantage: str | None = None
    """Advantage estimator (grpo | trace | treerl | tree_grpo); None: the method's default."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """bf16 autocast where the CPU has native bf16 (or on GPU); fp32 otherwise."""
    eval_every: int = 5
    """Evaluate on the held-out split every this many steps (and after the last); 0: never."""
    eval_samples: int = 4
    """Sampled rollouts per held-out task for `val/accuracy_sampled` (greedy is one rollout)."""
    checkpoint_every: int = 5
    dapo_max_rounds: int = 4
    """DAPO dynamic sampling: at most this many collection rounds per step to fill the batch."""
    save_trees: bool = True
    tensorboard: bool = False
    """Also write TensorBoard events (needs the `tensorboard` package)."""
    wandb_project: str | None = None
    """Also log to Weights & Biases under this project (needs `wandb` and its login)."""

    def __post_init__(self) -> None:
        if self.steps < 0 or self.epochs < 1 or self.mini_batches < 1 or self.micro_batch_size < 1:
            raise ValueError("steps must be >= 0 and epochs, mini_batches, micro_batch_size >= 1")
        if self.lr <= 0 or self.clip_low < 0 or self.clip_high < 0 or self.kl_coef < 0:
            raise ValueError("lr must be > 0 and clip_low, clip_high, kl_coef >= 0")
        if self.advantage is not None:
            get_estimator(self.advantage)  # raises with the nearest name


def held_out_accuracy(collector: Any, tasks: Sequence[Task], samples: int) -> dict[str, float]:
    """Greedy accuracy (one rollout per task) and sampled accuracy (`samples` per task, at the
    collector's temperature)."""
    begin = time.perf_counter()
    greedy = collector.sample(tasks, 1, temperature=0.0)
    sampled = collector.sample(tasks, samples)
    return {
        "val/accuracy_greedy": float(np.mean([t.leaf_rewards().mean() for t in greedy])),
        "val/accuracy_sampled": float(np.mean([t.leaf_rewards().mean() for t in sampled])),
        "timing_s/eval": time.perf_counter() - begin,
    }


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint file `checkpoints/latest` points at; FileNotFoundError, naming it, if there is none."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.exists():
        raise FileNotFoundError(f"{run_dir} has no checkpoint ({pointer} is missing)")
    return pointer.parent / pointer.read_text().strip()


class Trainer:
    """Owns a run folder and the parts of a run; `run()` trains to `config.train.steps`."""

    def __init__(self, config: Any, parts: Any, run_dir: str | Path) -> None:
        self.config = config
        self.parts = parts
        self.run_dir = Path(run_dir)
        self.cfg: TrainConfig = config.train
        self.method: str = config.rollout.method
        self.estimator = get_estimator(self.cfg.advantage or METHOD_ESTIMATOR[self.method])
        self.model = parts.policy.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.reference = copy.deepcopy(self.model).eval() if self.cfg.kl_coef > 0 else None
        self.rng = np.random.default_rng(config.seed + 1)
        self.step = 0
        self.totals = {"rollouts": 0.0, "tokens": 0.0}
        self.autocast = _autocast_dtype(self.cfg.precision, self.model)
        self._writers: list[Callable[[dict[str, float], int], None]] = []
        (self.run_dir / "trees").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ loop

    def run(self, *, on_step: Callable[[int, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
        self._open_writers()
        history = []
        while self.step < self.cfg.steps:
            metrics = self.train_step()
            final = self.step == self.cfg.steps
            if self.cfg.eval_every and (self.step % self.cfg.eval_every == 0 or final):
                metrics.update(self.evaluate())
            self._log(metrics)
            if self.step % self.cfg.checkpoint_every == 0 or final:
                self.save_checkpoint()
            history.append(metrics)
            if on_step is not None:
                on_step(self.step, metrics)
        return history

    def train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        trees, collected, stats = self._collect()
        metrics: dict[str, float] = {"step": float(self.step + 1), **stats, **tree_metrics(collected)}
        metrics.update(_rollout_figures(collected))
        metrics.update(self._predictor_calibration(collected))

        begin = time.perf_counter()
        advantages = self.estimator(trees)
        metrics.update(advantage_metrics(trees, advantages))
        sequences = tree_sequences(trees, advantages)
        metrics.update(self._update_policy(sequences))
        metrics["timing_s/update"] = time.perf_counter() - begin

        begin = time.perf_counter()
        histories, targets, weights = backup_targets(collected)
        if histories:
            metrics.update(self.parts.predictor.update(histories, targets, weights))
        metrics["timing_s/predictor"] = time.perf_counter() - begin

        self.step += 1
        self.totals["rollouts"] += stats["rollout/leaves"]
        self.totals["tokens"] += stats["rollout/tokens_generated"]
        metrics["rollout/rollouts_total"] = self.totals["rollouts"]
        metrics["rollout/tokens_total"] = self.totals["tokens"]
        metrics["timing_s/step"] = time.perf_counter() - start
        overhead = metrics.get("timing_s/alloc", 0.0) + metrics["timing_s/predictor"]
        metrics["timing_s/allocation_overhead_share"] = overhead / metrics["timing_s/step"]
        if self.cfg.save_trees:
            write_jsonl(collected, self.run_dir / "trees" / f"step_{self.step:04d}.jsonl")
        return metrics

    def _collect(self) -> tuple[list[RolloutTree], list[RolloutTree], dict[str, float]]:
        """(trees to train on, every tree sampled, rollout stats). They differ only for DAPO,
        which drops zero-variance groups and samples more prompts until the batch is full; every
        rollout it spends is counted in the stats."""
        collector = self.parts.collector
        rounds = self.cfg.dapo_max_rounds if self.method == "dapo" else 1
        kept: list[RolloutTree] = []
        collected: list[RolloutTree] = []
        stats: dict[str, float] = {}
        for _ in range(rounds):
            batch = collector.collect(self._draw_tasks())
            collected += batch.trees
            for key, value in batch.stats.items():
                stats[key] = stats.get(key, 0.0) + value if key.startswith(("rollout/", "timing_s/")) else value
            kept += [t for t in batch.trees if t.is_mixed()] if self.method == "dapo" else batch.trees
            if len(kept) >= self.config.prompts_per_step:
                break
        if self.method == "dapo":
            kept = kept[: self.config.prompts_per_step]
            stats["rollout/dapo_kept_prompts"] = float(len(kept))
        return kept, collected, stats

    def _draw_tasks(self) -> list[Task]:
        tasks = self.parts.train.tasks
        count = min(self.config.prompts_per_step, len(tasks))
        return [tasks[int(i)] for i in self.rng.choice(len(tasks), size=count, replace=False)]

    def _predictor_calibration(self, trees: list[RolloutTree]) -> dict[str, float]:
        """How well the predictions the allocator used match what the rollouts then showed."""
        histories, targets, weights = backup_targets(trees)
        if not histories:
            return {}
        predicted = self.parts.predictor.predict(histories)
        return {
            "predictor/brier": brier_score(predicted, targets, weights),
            "predictor/ece": expected_calibration_error(predicted, targets, 10, weights),
        }

    # ------------------------------------------------------------------ policy update

    def _update_policy(self, sequences: list[TrainSequence]) -> dict[str, float]:
        """PPO-style epochs over mini-batches; each mini-batch is one token-mean loss and one optimiser step."""
        cfg = self.cfg
        if not sequences:  # no trained token (e.g. every group agreed): nothing to learn from
            return {"actor/pg_loss": 0.0, "actor/clipfrac": 0.0, "actor/kl": 0.0, "actor/grad_norm": 0.0, "actor/sequences": 0.0}
        temperature = self.config.rollout.temperature
        max_len = self.config.rollout.max_context_tokens
        device_type = next(self.model.parameters()).device.type
        torch_rng = torch.Generator().manual_seed(int(self.rng.integers(2**31 - 1)))
        per_update: list[dict[str, float]] = []
        self.model.train()
        for _ in range(cfg.epochs):
            order = torch.randperm(len(sequences), generator=torch_rng).numpy()
            for chunk in np.array_split(order, min(cfg.mini_batches, len(order))):
                mini = [sequences[i] for i in chunk]
                denominator = float(sum(sum(s.weights[1:]) for s in mini))  # pad_batch drops token 0
                if cfg.kl_coef == 0.0:  # zero-advantage tokens count in the token mean but add no gradient
                    mini = [s for s in mini if any(s.advantages)]
                sums = {"actor/pg_loss": 0.0, "actor/clipfrac": 0.0, "actor/kl": 0.0, "actor/ratio_mean": 0.0}
                self.optimizer.zero_grad(set_to_none=True)
                for first in range(0, len(mini), cfg.micro_batch_size):
                    batch = pad_batch(mini[first : first + cfg.micro_batch_size], max_len=max_len)
                    with torch.autocast(device_type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
                        logp = token_logprobs(self.model, batch.input_ids, batch.attention_mask, temperature=temperature)
                    ref = None
                    if self.reference is not None:
                        with torch.no_grad():
                            ref = token_logprobs(self.reference, batch.input_ids, batch.attention_mask, temperature=temperature)
                    out = policy_loss(
                        logp.float(),
                        batch.old_logprobs,
                        batch.advantages,
                        batch.weights,
                        denominator=denominator,
                        clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high,
                        ref_logprobs=ref,
                        kl_coef=cfg.kl_coef,
                    )
                    out.loss.backward()
                    # each micro-batch term is already divided by the mini-batch's total weight
                    sums["actor/pg_loss"] += out.pg_loss
                    sums["actor/clipfrac"] += out.clipfrac
                    sums["actor/kl"] += out.kl
                    sums["actor/ratio_mean"] += out.ratio_mean
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                if not torch.isfinite(norm):
                    raise FloatingPointError(f"step {self.step + 1}: gradient norm is {float(norm)}; the update was not applied")
                self.optimizer.step()
                per_update.append({**sums, "actor/grad_norm": float(norm)})
        self.model.eval()
        metrics = {key: float(np.mean([u[key] for u in per_update])) for key in per_update[0]}
        metrics["actor/sequences"] = float(len(sequences))
        return metrics

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict[str, float]:
        return held_out_accuracy(self.parts.collector, self.parts.test.tasks, self.cfg.eval_samples)

    # ------------------------------------------------------------------ checkpoints and logs

    def save_checkpoint(self) -> Path:
        """Write `checkpoints/step_XXXX.pt` atomically and point `checkpoints/latest` at it."""
        folder = self.run_dir / "checkpoints"
        state = {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "predictor": self.parts.predictor.state_dict(),
            "trainer_rng": self.rng.bit_generator.state,
            "collector_rng": self.parts.collector.rng.bit_generator.state,
            "torch_rng": torch.get_rng_state(),
            "totals": dict(self.totals),
        }
        path = folder / f"step_{self.step:04d}.pt"
        _atomic_write(path, lambda tmp: torch.save(state, tmp))
        _atomic_write(folder / "latest", lambda tmp: Path(tmp).write_text(path.name))
        for old in sorted(folder.glob("step_*.pt"))[:-2]:  # keep the last two
            old.unlink()
        return path

    def load_checkpoint(self) -> int:
        """Restore the latest checkpoint and cut `metrics.jsonl` back to it; returns its step."""
        state = torch.load(latest_checkpoint(self.run_dir), weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.parts.predictor.load_state_dict(state["predictor"])
        self.rng.bit_generator.state = state["trainer_rng"]
        self.parts.collector.rng.bit_generator.state = state["collector_rng"]
        torch.set_rng_state(state["torch_rng"])
        self.totals = dict(state["totals"])
        self.step = int(state["step"])
        metrics_path = self.run_dir / "metrics.jsonl"
        if metrics_path.exists():  # drops the steps after the checkpoint, and a line the kill cut short
            kept = [m for m in read_metrics(metrics_path) if m["step"] <= self.step]
            _atomic_write(metrics_path, lambda tmp: Path(tmp).write_text("".join(json.dumps(m) + "\n" for m in kept)))
        return self.step

    def _open_writers(self) -> None:
        """TensorBoard and wandb, when asked; metrics.jsonl is always written."""
        if self._writers:
            return
        if self.cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

            writer = SummaryWriter(str(self.run_dir / "tensorboard"))

            def to_tensorboard(metrics: dict[str, float], step: int) -> None:
                for key, value in metrics.items():
                    writer.add_scalar(key, value, step)
                writer.flush()

            self._writers.append(to_tensorboard)
        if self.cfg.wandb_project:
            import wandb

            wandb.init(project=self.cfg.wandb_project, dir=str(self.run_dir), config=asdict(self.config))
            self._writers.append(lambda metrics, step: wandb.log(metrics, step=step))

    def _log(self, metrics: dict[str, float]) -> None:
        line = {"step": self.step, "method": self.method, **{k: v for k, v in metrics.items() if k != "step"}}
        with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")
        numeric = {k: float(v) for k, v in metrics.items() if k != "step"}
        for write in self._writers:
            write(numeric, self.step)


def _rollout_figures(trees: list[RolloutTree]) -> dict[str, float]:
    """verl-style figures over every rollout (root-to-leaf path) of the batch."""
    rewards, lengths, turns = [], [], []
    for tree in trees:
        for leaf in tree.leaves():
            path = tree.path(int(leaf))
            rewards.append(tree.nodes[int(leaf)].reward)
            lengths.append(sum(sum(tree.nodes[i].mask) for i in path))
            turns.append(tree.nodes[int(leaf)].depth)
    if not rewards:
        return {}
    return {
        "critic/score/mean": float(np.mean(rewards)),
        "response_length/mean": float(np.mean(lengths)),
        "num_turns/mean": float(np.mean(turns)),
    }


def _autocast_dtype(precision: str, model: Any) -> torch.dtype | None:
    if precision == "fp32":
        return None
    device = next(model.parameters()).device
    native = device.type == "cuda" or getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or getattr(
        torch.cpu, "_is_amx_tile_supported", lambda: False
    )()
    if precision == "bf16" or native:
        return torch.bfloat16
    return None


def _atomic_write(path: Path, write: Callable[[str], Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(str(tmp))
    os.replace(tmp, path)

