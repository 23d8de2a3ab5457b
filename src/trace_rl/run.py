"""A run's full config, the parts built from it (tasks, env, policy, engine, predictor, collector),
and `train_run`, which trains one run folder.

Commands (`rollout`, `train`, `compare`, `eval`) call `build_parts(config)` so that every run is
assembled the same way from one typed config, and every config value is checked when the config is
loaded, before any of it is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from trace_rl.agent.env import ToolEnv
from trace_rl.agent.scoring import score
from trace_rl.agent.tasks import load_taskset
from trace_rl.agent.types import TaskSet
from trace_rl.config import ConfigError, ModelConfig, TaskConfig
from trace_rl.engine.base import Engine
from trace_rl.predictor import PredictorConfig, SuccessPredictor
from trace_rl.predictor import build_predictor as make_predictor
from trace_rl.rollout import RolloutConfig, TreeRolloutCollector
from trace_rl.rundir import RunDir
from trace_rl.train.sft import SFTConfig, warm_start
from trace_rl.train.trainer import TrainConfig, Trainer, TrainingSetup, held_out_accuracy


@dataclass
class RunConfig:
    """Everything a run depends on; saved as `config.yaml` in the run folder."""

    seed: int = 0
    """Seeds the policy init, sampling, allocation baselines and the predictor."""
    prompts_per_step: int = 16
    """Candidate prompts drawn per batch (Stage 1 may give some of them no rollouts)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """`rollout.method` is the run's method (`trace_rl.methods.METHODS`)."""
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        try:
            self.train.estimator(self.rollout.spec)  # the estimator's options, checked before any work
        except ValueError as exc:
            raise ValueError(f"train.{exc}") from exc


@dataclass
class Parts:
    train: TaskSet
    test: TaskSet
    env: ToolEnv
    policy: Any  # trace_rl.models.Policy (imports torch, so not at module level)
    engine: Engine
    predictor: SuccessPredictor
    collector: TreeRolloutCollector


def build_env(config: RunConfig, taskset: TaskSet) -> ToolEnv:
    task = config.task
    return ToolEnv.for_taskset(
        taskset,
        turn_format=task.format,
        scorer=score,
        max_turns=task.max_turns,
        max_observation_chars=task.max_observation_chars,
        search_url=task.search_url,
        topk=task.topk,
    )


def build_predictor(config: RunConfig) -> SuccessPredictor:
    """The predictor the run's method allocates from (`MethodSpec.predictor`)."""
    return make_predictor(config.rollout.spec.predictor, config.predictor, seed=config.seed)


def build_trainer(config: RunConfig, parts: Parts, run_dir: str | Path | RunDir) -> Trainer:
    """A `Trainer` for `config` over `parts`, writing into `run_dir`."""
    setup = TrainingSetup(
        method=config.rollout.spec,
        model=parts.policy.model,
        engine=parts.engine,
        collector=parts.collector,
        predictor=parts.predictor,
        train_tasks=parts.train.tasks,
        test_tasks=parts.test.tasks,
        prompts_per_step=config.prompts_per_step,
        seed=config.seed,
    )
    return Trainer(config.train, setup, run_dir)


def check_trainable(config: RunConfig) -> None:
    """ConfigError unless the configured engine can receive the trainer's weights (before any work)."""
    if config.model.engine == "openai":
        from trace_rl.engine.openai_server import OpenAIEngine

        if not OpenAIEngine.accepts_weights:
            raise ConfigError(
                "model.engine=openai cannot train yet: trace-rl has no weight push to a vLLM / SGLang server, so the "
                "server would keep sampling from the starting weights while the local model trains. Use "
                "model.engine=hf to train; `rollout` and `eval` work with a server."
            )


def build_parts(config: RunConfig, *, progress: Callable[[int, float], None] | None = None) -> Parts:
    """Load the task splits, build the env, load (and warm-start) the policy, and wire the collector."""
    import torch

    from trace_rl.engine.hf import HFEngine
    from trace_rl.engine.openai_server import OpenAIEngine
    from trace_rl.models import load_policy

    torch.set_num_threads(config.model.cpu_threads)
    demos, train = task_splits(config)
    test = load_taskset(config.task.name, split="test", num_tasks=config.task.test_tasks, seed=config.task.seed)
    env = build_env(config, train)
    model = config.model
    name = policy_source(config, demos, env, progress=progress)
    policy = load_policy(name, seed=config.seed, dtype=model.dtype, device=model.device)
    if model.engine == "openai":
        if not model.server_urls:
            raise ValueError("model.engine=openai needs model.server_urls (e.g. ['http://127.0.0.1:8000'])")
        engine = OpenAIEngine(model.server_urls)
    else:
        engine = HFEngine.from_policy(policy, max_batch_size=model.max_batch_size, prefix_cache_mb=model.prefix_cache_mb)
    predictor = build_predictor(config)
    collector = TreeRolloutCollector(engine, policy.tokenizer, env, predictor, config.rollout, seed=config.seed)
    return Parts(train=train, test=test, env=env, policy=policy, engine=engine, predictor=predictor, collector=collector)


def task_splits(config: RunConfig) -> tuple[TaskSet, TaskSet]:
    """(tasks the warm start demonstrates on, tasks RL trains on): with `task.demo_tasks`, a seeded
    draw of that many train-split tasks and the rest (cut to `task.train_tasks`), disjoint; without
    it, both are the RL train split. The test split is disjoint from both."""
    task = config.task
    if task.demo_tasks is None:
        train = load_taskset(task.name, split="train", num_tasks=task.train_tasks, seed=task.seed)
        return train, train
    full = load_taskset(task.name, split="train", seed=task.seed)
    if task.demo_tasks >= len(full.tasks):
        raise ConfigError(f"task.demo_tasks={task.demo_tasks} leaves no RL task: the train split has {len(full.tasks)}")
    order = np.random.default_rng([task.seed, 7]).permutation(len(full.tasks))
    demo_ids = set(order[: task.demo_tasks].tolist())
    rest = [t for i, t in enumerate(full.tasks) if i not in demo_ids][: task.train_tasks]
    demos = [t for i, t in enumerate(full.tasks) if i in demo_ids]
    return replace(full, tasks=demos), replace(full, tasks=rest)


def policy_source(
    config: RunConfig,
    demos: TaskSet | None = None,
    env: ToolEnv | None = None,
    *,
    progress: Callable[[int, float], None] | None = None,
) -> str:
    """What `load_policy` loads for this run: the warm-started folder (made now, from demonstrations on
    `demos`, if not cached) or `model.name`."""
    if not config.model.warm_start:
        if config.model.name == "tiny":
            raise ValueError("model.name=tiny needs model.warm_start=true: an untrained tiny model cannot use the tools")
        return config.model.name
    if demos is None:
        demos = task_splits(config)[0]
    return str(warm_start(config.model.name, demos, env or build_env(config, demos), config.sft, progress=progress))


def evaluate_policy(config: RunConfig, run_dir: str | Path | None = None, *, samples: int | None = None) -> dict[str, Any]:
    """Held-out accuracy of a run's latest checkpoint (or, without `run_dir`, of its starting policy)."""
    parts = build_parts(config)
    step = 0
    if run_dir is not None:
        state = RunDir(run_dir).load_checkpoint()
        parts.policy.model.load_state_dict(state["model"])
        step = int(state["step"])
    samples = config.train.eval_samples if samples is None else samples
    figures = held_out_accuracy(parts.collector, parts.test.tasks, samples)
    return {"step": step, "tasks": len(parts.test.tasks), "samples": samples, **figures}


def train_run(config: RunConfig, run_dir: str | Path, *, resume: bool = False, bar: Any = None) -> Trainer:
    """Train `config` in `run_dir` (continuing from its last checkpoint when `resume`).

    `bar` is a `trace_rl.progress.Bars` for live progress, or None.
    """
    check_trainable(config)
    folder = RunDir(run_dir)
    if not resume and (folder.checkpoints_dir / "latest").exists():
        raise FileExistsError(f"{folder.path} already holds a run; resume it or choose another folder")
    folder.write_config(config)
    sft_bar: list = []  # the warm-start bar appears only when a warm start is actually trained

    def on_sft_step(step: int, loss: float) -> None:
        if bar is None:
            return
        if not sft_bar:
            sft_bar.append(bar.task("warm start", total=config.sft.steps))
        bar.update(sft_bar[0], step + 1, {"loss": loss})

    parts = build_parts(config, progress=on_sft_step)
    trainer = build_trainer(config, parts, folder)
    if resume:
        trainer.load_checkpoint()
    steps_bar = bar.task(f"{folder.path.name} {config.rollout.method}", total=config.train.steps, completed=trainer.step) if bar else None

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if bar is not None:
            bar.update(steps_bar, step, headline(metrics))

    trainer.run(on_step=on_step)
    return trainer


def headline(metrics: dict[str, Any]) -> dict[str, float]:
    """The few figures worth showing live and on a command's last line."""
    keys = ("critic/score/mean", "tree/effective_ratio", "tree/mixed_budget_share", "val/accuracy_greedy", "val/accuracy_sampled")
    return {k: round(float(metrics[k]), 4) for k in keys if k in metrics}
