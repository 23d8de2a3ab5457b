"""The training loop: collect trees, compute advantages, update the policy, update the predictor.

One step, in the order of the paper:

    trees      = collector.collect(tasks)                 # Stage 1 + Stage 2 under the budget
    advantages = estimator(trees)                          # per node; observation tokens masked
    policy     ← clipped policy gradient over policy tokens (token mean, mini-batches, epochs)
    predictor  ← tree backup targets                       # serves allocation only

Every step appends one line to the run folder's `metrics.jsonl` and writes its trees
(`trace_rl.storage.rundir`); checkpoints hold everything needed to continue bit-for-bit (policy, optimiser,
predictor, every RNG, counters), written atomically, so a killed run resumes from its last
checkpoint and reaches the same numbers. After every update the engine receives the new weights
(`Engine.update_weights`), and each step logs the version it sampled from (`rollout/weight_version`).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from trace_rl.agent.types import Task
from trace_rl.core.advantage import ESTIMATORS, advantage_metrics, get_estimator
from trace_rl.core.tree import RolloutTree
from trace_rl.engine.base import Engine
from trace_rl.infra.config import FieldError, check_choice, check_range
from trace_rl.models import token_logprobs
from trace_rl.planning.methods import MethodSpec
from trace_rl.planning.metrics import predictor_metrics, rollout_metrics, tree_metrics
from trace_rl.predictor.base import SuccessPredictor, backup_targets
from trace_rl.predictor.baselines import ReferencePredictors
from trace_rl.rollout.collector import TreeRolloutCollector
from trace_rl.training.loss import policy_loss
from trace_rl.storage.rundir import RunDir
from trace_rl.training.sequences import (
    TrainSequence,
    in_loss,
    loss_denominator,
    micro_batches,
    pack_batch,
    pack_tree,
    pad_batch,
    tree_groups,
    tree_sequences,
)
from trace_rl.training.tree_attention import packed_token_logprobs, supports_packed


@dataclass
class TrainConfig:
    """The policy update, evaluation and bookkeeping."""

    steps: int = 20
    """RL steps: each samples one batch of rollout trees and updates the policy on it."""
    lr: float = 5e-5
    """AdamW learning rate of the RL update (constant, no schedule)."""
    weight_decay: float = 0.0
    """AdamW weight decay of the RL update."""
    epochs: int = 1
    """Passes over each step's data (PPO epochs)."""
    mini_batches: int = 2
    """Optimiser steps per epoch; the step's data (trees with `update: packed`, sequences with
    `per_leaf`) is split into this many mini-batches."""
    micro_batch_size: int = 8
    """Sequences per forward/backward with `per_leaf`; with `packed`, a micro-batch holds at most this
    many times the longest sequence's tokens (gradients accumulate over a mini-batch)."""
    update: Literal["packed", "per_leaf"] = "packed"
    """How the update runs the step's sequences through the model. `packed`: each tree's unique tokens
    once per forward, with tree attention and path positions (exact: the same per-token log-probs);
    mini-batches are made of trees and a micro-batch holds at most `micro_batch_size` x the longest
    sequence tokens. `per_leaf`: one padded row per leaf sequence (a tree's prompt and shared turns
    recomputed per leaf); mini-batches of sequences, `micro_batch_size` rows per micro-batch."""
    clip_low: float = 0.2
    """PPO clip below: the importance ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.28
    """PPO clip above: the ratio is clipped at 1 + clip_high (above clip_low: DAPO's clip-higher)."""
    kl_coef: float = 0.0
    """KL to the starting policy (k3 estimator); 0 turns the reference model off."""
    grad_clip: float = 1.0
    """Largest global gradient norm of an optimiser step (> 0; there is no off value: a norm no
    gradient reaches clips nothing)."""
    advantage: str | None = None
    """Advantage estimator (grpo | trace | treerl | tree_grpo); None: the method's default."""
    advantage_options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of the estimator (e.g. `{scale_rewards: false}`, `{prefix_coef: 0.5}`)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """`auto`: bf16 autocast on a GPU, fp32 on CPU (where bf16 moved log-probs beyond tolerance for
    little speed; see `_autocast_dtype`); `bf16` / `fp32` force one."""
    eval_every: int = 5
    """Evaluate on the held-out split every this many steps (and after the last); 0: never."""
    eval_samples: int = 4
    """Sampled rollouts per held-out task for `val/accuracy_sampled` (greedy is one rollout)."""
    eval_on_start: bool = False
    """Also evaluate the starting policy before the first step, logged as step 0, so a single run shows
    where it began (as transformers' `eval_on_start`). It draws from the sampling RNG, so a run with it
    does not repeat one without it step by step. `compare` evaluates each seed's start once itself."""
    checkpoint_every: int = 5
    """Save a checkpoint (weights, optimiser, predictor, RNG states) every this many steps and after the
    last, so `trace-rl train --resume` continues from it."""
    dapo_max_rounds: int = 4
    """DAPO dynamic sampling: at most this many collection rounds per step to fill the batch."""
    save_trees: bool = True
    """Write each step's rollout trees to the run folder (`trees/`), which the report's tree viewer and
    `rollout.brace.warm_bank` read."""
    tensorboard: bool = False
    """Also write TensorBoard events (needs the `tensorboard` package)."""
    wandb_project: str | None = None
    """Also log to Weights & Biases under this project (needs `wandb` and its login)."""

    def __post_init__(self) -> None:
        check_range(self, "steps", ge=0)
        check_range(self, "lr", gt=0)
        check_range(self, "weight_decay", ge=0)
        for name in ("epochs", "mini_batches", "micro_batch_size", "eval_samples", "checkpoint_every", "dapo_max_rounds"):
            check_range(self, name, ge=1)
        check_range(self, "clip_low", ge=0, lt=1, why="the ratio's lower clip is 1 - clip_low")
        check_range(self, "clip_high", ge=0)
        check_range(self, "kl_coef", ge=0, why="0: no KL term")
        check_range(self, "grad_clip", gt=0, why="the norm gradients are clipped to; one <= 0 would reverse or zero every update")
        check_choice(self, "advantage", sorted(ESTIMATORS), nullable=True)
        check_range(self, "eval_every", ge=0, why="0: never")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise FieldError("tensorboard", True, "false unless the tensorboard package is installed (pip install tensorboard)")
        if self.wandb_project is not None:
            if not self.wandb_project.strip():
                raise FieldError("wandb_project", self.wandb_project, "a project name or null")
            if importlib.util.find_spec("wandb") is None:
                raise FieldError("wandb_project", self.wandb_project, "null unless the wandb package is installed (pip install wandb)")

    def estimator(self, method: MethodSpec) -> Callable[[Sequence[RolloutTree]], list]:
        """The advantage estimator this run trains with, its options bound (checked now, on no trees)."""
        name = self.advantage or method.estimator
        estimate = get_estimator(name)
        try:
            estimate([], **self.advantage_options)
        except (TypeError, ValueError) as exc:  # an unknown option, or a known one out of its range
            raise FieldError("advantage_options", self.advantage_options, f"options estimator {name!r} takes", f" ({exc})") from exc
        return lambda trees: estimate(trees, **self.advantage_options)


def held_out_accuracy(
    collector: TreeRolloutCollector, tasks: Sequence[Task], samples: int, progress: Callable[[int, int], None] | None = None
) -> dict[str, float]:
    """Greedy accuracy (one rollout per task) and sampled accuracy (`samples` per task, at the
    collector's temperature), with the sampled figure's standard errors:

    - `val/accuracy_sampled_se`: the evaluation's own sampling noise on these tasks,
      sqrt(Σ_q s_q² / k) / Q with s_q² each task's unbiased variance over its k samples (0 for k = 1);
    - `val/accuracy_sampled_se_tasks`: the spread over tasks, std(per-task accuracy) / sqrt(Q), what
      another draw of Q tasks would add.

    `progress(done, total)` hears the rollouts finished, greedy and sampled together.
    """
    begin = time.perf_counter()
    total = len(tasks) * (1 + samples)
    greedy = collector.sample(tasks, 1, temperature=0.0, progress=None if progress is None else lambda done, _: progress(done, total))
    sampled = collector.sample(tasks, samples, progress=None if progress is None else lambda done, _: progress(len(tasks) + done, total))
    per_task = np.array([t.leaf_rewards().mean() for t in sampled])
    within = np.array([t.leaf_rewards().var(ddof=1) if samples > 1 else 0.0 for t in sampled])
    return {
        "val/accuracy_greedy": float(np.mean([t.leaf_rewards().mean() for t in greedy])),
        "val/accuracy_sampled": float(per_task.mean()),
        "val/accuracy_sampled_se": float(np.sqrt(within.sum() / samples) / len(tasks)),
        "val/accuracy_sampled_se_tasks": float(per_task.std(ddof=1) / np.sqrt(len(tasks))) if len(tasks) > 1 else 0.0,
        "timing_s/eval": time.perf_counter() - begin,
    }


def _record_gap(gap: list[float], new: torch.Tensor, engine: torch.Tensor, weights: torch.Tensor) -> None:
    """Add |engine - new| over the trained tokens, and their count, to `gap` ([sum, count])."""
    trained = weights > 0
    gap[0] += float(((new - engine).abs() * trained).sum())
    gap[1] += float(trained.sum())


@dataclass
class TrainingSetup:
    """What a `Trainer` trains and with what (`trace_rl.run.build_trainer` assembles it from a run config)."""

    method: MethodSpec
    model: torch.nn.Module
    engine: Engine
    """Samples the rollouts; receives the new weights after every update (`Engine.update_weights`)."""
    collector: TreeRolloutCollector
    predictor: SuccessPredictor
    train_tasks: Sequence[Task]
    test_tasks: Sequence[Task]
    prompts_per_step: int
    """Candidate prompts drawn per batch."""
    seed: int


@dataclass
class StopRequest:
    """A request to stop training, set by a signal handler (`trace_rl.cli`). `Trainer.run` checks it at
    every step boundary and, once set, saves a checkpoint there and returns. `listening` is True while
    it does, so a signal outside the loop (the warm start, loading) knows to stop at once instead."""

    signal: int | None = None
    """The signal that asked to stop; None: none did."""
    listening: bool = False

    @property
    def requested(self) -> bool:
        return self.signal is not None


class Trainer:
    """Trains `setup` for `config.steps` steps into a run folder; `run()` does it, resuming where it stopped."""

    def __init__(self, config: TrainConfig, setup: TrainingSetup, run_dir: str | Path | RunDir) -> None:
        self.cfg = config
        self.setup = setup
        self.run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.on_phase: Callable[[str], None] | None = None
        """Hears what a step is doing (`run(on_phase=)`)."""
        self.method = setup.method
        self.estimator = config.estimator(setup.method)
        self.model = setup.model
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        self.optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
        self.reference = copy.deepcopy(self.model).eval() if config.kl_coef > 0 else None
        self.rng = np.random.default_rng(setup.seed + 1)
        self.step = 0
        self.checkpoint_step = 0  # the step the newest checkpoint holds; 0 needs none (a resume without one starts there)
        self.totals = {"rollouts": 0.0, "tokens": 0.0}
        self.autocast = _autocast_dtype(config.precision, self.model)
        self._writers: list[Callable[[dict[str, float], int], None]] = []
        self.references = ReferencePredictors()  # scored beside the predictor, so a broken one shows
        setup.engine.update_weights(self.model, version=0)

    # ------------------------------------------------------------------ loop

    def run(
        self,
        *,
        on_step: Callable[[int, dict[str, float]], None] | None = None,
        stop: StopRequest | None = None,
        on_phase: Callable[[str], None] | None = None,
    ) -> list[dict[str, float]]:
        """Train up to `config.steps`; with `stop` set (a signal), stop at the next step boundary, after
        a checkpoint of the last step done (so no finished step is lost), and return. `on_phase(text)`
        hears what a step is doing (its rollouts, its update, an evaluation's progress): a step of a
        real model can take minutes."""
        self.on_phase = on_phase
        self._open_writers()
        history = []
        if stop is not None:
            stop.listening = True
        try:
            if self.step == 0 and self.cfg.eval_on_start and not (stop and stop.requested):
                self._log(self.evaluate())
            while self.step < self.cfg.steps and not (stop and stop.requested):
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
            if stop and stop.requested and self.checkpoint_step != self.step:
                self.save_checkpoint()
        finally:
            if stop is not None:
                stop.listening = False
        return history

    def train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        setup = self.setup
        version = setup.engine.weight_version
        self._phase(f"step {self.step + 1}: rollouts")
        trees, collected, stats = self._collect()
        metrics: dict[str, float] = {"step": float(self.step + 1), **stats, **tree_metrics(collected)}
        metrics["rollout/weight_version"] = float(version)
        metrics.update(rollout_metrics(collected))
        metrics.update(predictor_metrics(collected))
        metrics.update(self.references.score(collected))

        begin = time.perf_counter()
        self._phase(f"step {self.step + 1}: update")
        if (release := getattr(setup.engine, "release_memory", None)) is not None:
            # its prefix cache and weight copy are stale once the update runs: not in the update's peak
            metrics["rollout/engine_freed_mb"] = release() / 2**20
        advantages = self.estimator(trees)
        metrics.update(advantage_metrics(trees, advantages))
        sequences = tree_sequences(trees, advantages)
        metrics.update(self._update_policy(sequences))
        setup.engine.update_weights(self.model, version=self.step + 1)
        metrics["timing_s/update"] = time.perf_counter() - begin

        begin = time.perf_counter()
        self.references.update(collected)
        histories, targets, weights = backup_targets(collected)
        if histories:
            metrics.update(setup.predictor.update(histories, targets, weights))
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
            self.run_dir.write_trees(collected, self.step)
        return metrics

    def _collect(self) -> tuple[list[RolloutTree], list[RolloutTree], dict[str, float]]:
        """(trees to train on, every tree sampled, rollout stats). They differ only for DAPO's
        resampling, which drops zero-variance groups and samples more prompts until the batch is
        full; every rollout it spends is counted in the stats."""
        dapo = self.method.resample == "dapo"
        rounds = self.cfg.dapo_max_rounds if dapo else 1
        want = self.setup.prompts_per_step
        kept: list[RolloutTree] = []
        collected: list[RolloutTree] = []
        stats: dict[str, float] = {}
        for _ in range(rounds):
            batch = self.setup.collector.collect(self._draw_tasks())
            collected += batch.trees
            for key, value in batch.stats.items():
                stats[key] = stats.get(key, 0.0) + value if key.startswith(("rollout/", "timing_s/")) else value
            kept += [t for t in batch.trees if t.is_mixed()] if dapo else batch.trees
            if len(kept) >= want:
                break
        if dapo:
            kept = kept[:want]
            stats["rollout/dapo_kept_prompts"] = float(len(kept))
        return kept, collected, stats

    def _draw_tasks(self) -> list[Task]:
        tasks = self.setup.train_tasks
        count = min(self.setup.prompts_per_step, len(tasks))
        return [tasks[int(i)] for i in self.rng.choice(len(tasks), size=count, replace=False)]

    # ------------------------------------------------------------------ policy update

    def _update_policy(self, sequences: list[TrainSequence]) -> dict[str, float]:
        """PPO-style epochs over mini-batches; each mini-batch is one token-mean loss and one optimiser step.

        `update: per_leaf`: mini-batches of sequences, micro-batches of `micro_batch_size` padded rows.
        `update: packed`: mini-batches of trees (a tree's sequences stay together), micro-batches of
        packed trees holding at most `micro_batch_size` x the longest sequence tokens (a larger tree is
        split between its sequences). Both give every trained token the same log-prob, so the same
        mini-batch gets the same loss and gradient. The loss is the token mean over the mini-batch's
        total trained weight either way; `actor/ratio_mean` is the mean ratio over the tokens in the loss.
        """
        cfg = self.cfg
        if not sequences:  # no trained token (e.g. every group agreed): nothing to learn from
            return {"actor/pg_loss": 0.0, "actor/clipfrac": 0.0, "actor/kl": 0.0, "actor/grad_norm": 0.0, "actor/sequences": 0.0, "actor/tokens_forward": 0.0}
        temperature = self.setup.collector.config.sampling_temperature
        max_len = self.setup.collector.config.max_context_tokens
        device = next(self.model.parameters()).device
        torch_rng = torch.Generator().manual_seed(int(self.rng.integers(2**31 - 1)))
        zero_advantage = cfg.kl_coef > 0.0  # without a KL term, zero-advantage tokens count in the token mean but add no gradient
        packed = cfg.update == "packed"
        if packed and not supports_packed(self.model):
            warnings.warn(f"{type(self.model).__name__} does not run the tree attention; train.update falls back to per_leaf", stacklevel=2)
            packed = False
        if packed:
            units = tree_groups(sequences)
            max_tokens = cfg.micro_batch_size * min(max_len, max(len(s.token_ids) for s in sequences))
            packs = [pack_tree(u, max_len=max_len, zero_advantage=zero_advantage, max_tokens=max_tokens) for u in units]
        else:
            units = [[s] for s in sequences]
        denominators = [loss_denominator(u) for u in units]  # the per-leaf layout drops token 0

        # Under bf16 autocast on a CPU the tree attention runs in fp32, as the warm start's does: the bf16
        # backward of its many small per-node attention calls is the slower one there.
        attention_dtype = torch.float32 if self.autocast is not None and device.type == "cpu" else None

        def logprobs(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            if packed:
                return packed_token_logprobs(model, batch.input_ids, batch.position_ids, batch.nodes, batch.sources, batch.targets,
                                             temperature=temperature, attention_dtype=attention_dtype)
            return token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=temperature)

        orders = [torch.randperm(len(units), generator=torch_rng).numpy() for _ in range(cfg.epochs)]
        chunks = [np.array_split(order, min(cfg.mini_batches, len(order))) for order in orders]
        gap = [0.0, 0.0]  # |engine - recomputed| summed over the trained tokens, and their count
        # The first optimiser step's mini-batch needs no recomputation: until that step the policy is the
        # one its own forward runs, so that forward's log-probs (detached) are the behaviour log-probs the
        # recomputation would give, and the ratio is 1. Only the other mini-batches are recomputed, which
        # spares the update one no-grad forward over 1 / mini_batches of the data (all of it at one).
        own_forward = set(chunks[0][0].tolist()) if self.recompute_logprobs and packed else set()
        if self.recompute_logprobs:
            rest = [i for i in range(len(units)) if i not in own_forward]
            self._recompute_old_logprobs([units[i] for i in rest], [packs[i] for i in rest] if packed else None,
                                         logprobs, device, max_tokens if packed else 0, gap)

        per_update: list[dict[str, float]] = []
        forward_tokens = 0
        self.model.train()
        for epoch in range(cfg.epochs):
            for index, chunk in enumerate(chunks[epoch]):
                first = epoch == 0 and index == 0 and bool(own_forward)
                denominator = float(sum(denominators[i] for i in chunk))
                if packed:
                    groups = micro_batches([p for i in chunk for p in packs[i]], max_tokens)
                    batches: list[Any] = [pack_batch(g) for g in groups]
                else:
                    mini = [units[i][0] for i in chunk]
                    if not zero_advantage:
                        mini = [s for s in mini if any(s.advantages)]
                    batches = [pad_batch(mini[f : f + cfg.micro_batch_size], max_len=max_len) for f in range(0, len(mini), cfg.micro_batch_size)]
                sums = {"actor/pg_loss": 0.0, "actor/clipfrac": 0.0, "actor/kl": 0.0}
                ratio_sum, in_loss_weight = 0.0, 0.0
                self.optimizer.zero_grad(set_to_none=True)
                for number, batch in enumerate(batches):
                    _to(batch, device)
                    forward_tokens += int(batch.input_ids.shape[1]) if packed else int(batch.attention_mask.sum())
                    with torch.autocast(device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
                        logp = logprobs(self.model, batch)
                    if first:  # the behaviour log-probs of this mini-batch, as the recomputation would give them
                        behaviour = logp.detach().float().cpu()
                        _record_gap(gap, behaviour, batch.old_logprobs.cpu(), batch.weights.cpu())
                        for pack, values in zip(groups[number], behaviour.split([len(p.targets) for p in groups[number]])):
                            pack.old_logprobs = values.tolist()  # a later epoch's batches are made from the packs
                        batch.old_logprobs = behaviour.to(batch.old_logprobs.device)
                    ref = None
                    if self.reference is not None:
                        with torch.no_grad():
                            ref = logprobs(self.reference, batch)
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
                    with torch.no_grad():  # the ratio over the tokens in the loss, not over the whole denominator
                        counted = batch.weights * in_loss(batch.weights, batch.advantages, zero_advantage=zero_advantage)
                        ratio_sum += float((torch.exp(logp.detach().float() - batch.old_logprobs) * counted).sum())
                        in_loss_weight += float(counted.sum())
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                if not torch.isfinite(norm):
                    raise FloatingPointError(f"step {self.step + 1}: gradient norm is {float(norm)}; the update was not applied")
                self.optimizer.step()
                ratio = {"actor/ratio_mean": ratio_sum / in_loss_weight} if in_loss_weight > 0 else {}
                per_update.append({**sums, **ratio, "actor/grad_norm": float(norm)})
        self.model.eval()
        ratios = [u["actor/ratio_mean"] for u in per_update if "actor/ratio_mean" in u]
        metrics = {key: float(np.mean([u[key] for u in per_update])) for key in ("actor/pg_loss", "actor/clipfrac", "actor/kl")}
        metrics["actor/ratio_mean"] = float(np.mean(ratios)) if ratios else 1.0  # 1.0: no token was in the loss
        metrics["actor/grad_norm"] = float(np.mean([u["actor/grad_norm"] for u in per_update]))
        metrics["actor/sequences"] = float(len(sequences))
        metrics["actor/tokens_forward"] = float(forward_tokens)
        if gap[1]:  # how far the engine's log-probs were from the update's
            metrics["actor/rollout_logprob_gap"] = gap[0] / gap[1]
        return metrics

    @property
    def recompute_logprobs(self) -> bool:
        """Whether the update recomputes the behaviour log-probs before its first optimiser step: whenever
        generation or the update runs in bf16, their numbers differ (the engine's bf16 decoder and the
        update's autocast round at different places), so the log-probs the engine recorded would make
        an on-policy ratio drift from 1 by their rounding alone. In fp32 both agree to float rounding."""
        return getattr(self.setup.engine, "precision", "fp32") != "fp32" or self.autocast is not None

    @torch.no_grad()
    def _recompute_old_logprobs(
        self, units: list, packs: list | None, logprobs: Callable, device: torch.device, max_tokens: int, gap: list[float]
    ) -> None:
        """Replace every trained token's behaviour log-prob with the current policy's, computed as the
        update computes it (same layout, same precision, no gradient), before any optimiser step: the
        importance ratio then measures only how far the update has moved the policy (verl's
        `recompute_log_prob`). Adds to `gap` the sum and count of |engine - recomputed| over the tokens
        in the loss (`actor/rollout_logprob_gap`: how far the engine's numbers were from the update's)."""
        autocast = dict(dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None)
        if packs is not None:
            for group in micro_batches([p for unit in packs for p in unit], max_tokens):
                batch = pack_batch(group)
                with torch.autocast(device.type, **autocast):
                    new = logprobs(self.model, _to(batch, device)).float().cpu()
                _record_gap(gap, new, batch.old_logprobs, batch.weights)
                for pack, values in zip(group, new.split([len(p.targets) for p in group])):
                    pack.old_logprobs = values.tolist()
        else:
            max_len = self.setup.collector.config.max_context_tokens
            seqs = [u[0] for u in units]
            for start in range(0, len(seqs), self.cfg.micro_batch_size):
                chunk = seqs[start : start + self.cfg.micro_batch_size]
                batch = pad_batch(chunk, max_len=max_len)
                with torch.autocast(device.type, **autocast):
                    new = logprobs(self.model, _to(batch, device)).float().cpu()
                _record_gap(gap, new, batch.old_logprobs, batch.weights)
                for row, seq in enumerate(chunk):
                    width = min(len(seq.token_ids), new.shape[1] + 1) - 1
                    seq.old_logprobs = [seq.old_logprobs[0], *new[row, :width].tolist(), *seq.old_logprobs[width + 1 :]]

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict[str, float]:
        def progress(done: int, total: int) -> None:
            self._phase(f"evaluation: {done}/{total} rollouts")

        figures = held_out_accuracy(self.setup.collector, self.setup.test_tasks, self.cfg.eval_samples, progress)
        # The engine's prefix cache now holds the evaluation's contexts; a run resumed after this step
        # starts with an empty one. Emptied here (and on Ray's actors), every step starts from the same
        # engine state, resumed or not (cached and recomputed keys differ at float noise, enough for two
        # runs to drift apart).
        for holder in (self.setup.engine, self.setup.collector.executor):
            if (release := getattr(holder, "release_memory", None)) is not None:
                release()
        return figures

    def _phase(self, text: str) -> None:
        if self.on_phase is not None:
            self.on_phase(text)

    # ------------------------------------------------------------------ checkpoints and logs

    def save_checkpoint(self) -> Path:
        """Everything needed to continue bit-for-bit, written atomically (`RunDir.save_checkpoint`).

        Only data, so it loads with `weights_only=True`: tensors (weights, optimiser moments, the torch
        RNG), numpy RNG states as their JSON-compatible dicts, counters as numbers; the predictor's
        numpy arrays are stored as tensors (`trace_rl.storage.rundir.checkpoint_data`).
        """
        state = {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **self.setup.collector.checkpoint_state(),
            "references": self.references.state_dict(),
            "trainer_rng": self.rng.bit_generator.state,
            "torch_rng": torch.get_rng_state(),
            "totals": dict(self.totals),
        }
        path = self.run_dir.save_checkpoint(state, self.step)
        self.checkpoint_step = self.step
        return path

    def load_checkpoint(self) -> int:
        """Restore the newest readable checkpoint (`RunDir.load_checkpoint`); returns its step."""
        return self.restore(self.run_dir.load_checkpoint())

    def restore(self, state: dict[str, Any]) -> int:
        """Continue from a loaded checkpoint: every part's state, and the run folder rewound to its step
        (`RunDir.rewind`: later metrics and trees are made again, the step's own line restored from the
        checkpoint if it was lost); returns its step."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.setup.collector.restore_checkpoint_state(state)
        self.references.load_state_dict(state["references"])
        self.rng.bit_generator.state = state["trainer_rng"]
        torch.set_rng_state(state["torch_rng"])
        self.totals = dict(state["totals"])
        self.step = int(state["step"])
        self.setup.engine.update_weights(self.model, version=self.step)
        record = state.get("record")  # the step's metrics line, in case the kill cut it from metrics.jsonl
        self.run_dir.rewind(self.step, json.loads(record) if isinstance(record, str) else None)
        self.checkpoint_step = self.step
        return self.step

    def _open_writers(self) -> None:
        """TensorBoard and wandb, when asked; metrics.jsonl is always written."""
        if self._writers:
            return
        folder = self.run_dir.path
        if self.cfg.tensorboard:
            from torch.utils.tensorboard import (
                SummaryWriter,  # needs the `tensorboard` package
            )

            writer = SummaryWriter(str(folder / "tensorboard"))

            def to_tensorboard(metrics: dict[str, float], step: int) -> None:
                for key, value in metrics.items():
                    writer.add_scalar(key, value, step)
                writer.flush()

            self._writers.append(to_tensorboard)
        if self.cfg.wandb_project:
            import wandb

            from trace_rl.infra.config import load_yaml_file

            config = load_yaml_file(self.run_dir.config_path) if self.run_dir.config_path.is_file() else {}
            wandb.init(project=self.cfg.wandb_project, dir=str(folder), config=config)
            self._writers.append(lambda metrics, step: wandb.log(metrics, step=step))

    def _log(self, metrics: dict[str, float]) -> None:
        self.run_dir.append_metrics({"step": self.step, "method": self.method.name, **{k: v for k, v in metrics.items() if k != "step"}})
        numeric = {k: float(v) for k, v in metrics.items() if k != "step"}
        for write in self._writers:
            write(numeric, self.step)


def _to(batch: Any, device: torch.device) -> Any:
    """The batch with its tensors moved to `device`."""
    for name, value in list(vars(batch).items()):
        if isinstance(value, torch.Tensor):
            setattr(batch, name, value.to(device))
    return batch


def _autocast_dtype(precision: str, model: Any) -> torch.dtype | None:
    """bf16 for `bf16`, and for `auto` on a GPU; fp32 otherwise. On CPU bf16 is not worth its error:
    on this repo's Sapphire Rapids machines (native AVX512-BF16 / AMX) it made the packed update only
    1.18x faster while moving log-probs by up to 6.5e-3 (tiny) and 0.18 (SmolLM2-135M), PPO ratios by
    up to 0.6% and 16% (`benchmarks/update_speed.py`)."""
    if precision == "bf16" or (precision == "auto" and next(model.parameters()).device.type == "cuda"):
        return torch.bfloat16
    return None
