"""TRL adapter: TRL's `GRPOTrainer` trains on TRACE trees (extra `trl`, TRL >= 1.16).

TRL calls `rollout_func(prompts, trainer) -> dict` with each prompt of its generation batch repeated
`num_generations` (G) times in a row, and wants one row per copy: `prompt_ids`, `completion_ids`,
`logprobs`, optionally `env_mask` (0 on tokens the policy did not write), and any extra per-row
fields, which it hands to the reward functions. `TraceRollout` is that function:

- **One tree per distinct prompt, exactly G leaves.** `TreeRolloutCollector.collect(per_tree=True)`
  with `rollout.budget` = G: Stage 1 gives each root m = max(min_per_prompt, round(stage1_share * G))
  bare rollouts, then TRACE's exact Stage 2 on the shared predictor spends the other G - m on that
  tree's own prefixes (what no prefix can take goes back to its root, as in `trace_rl.planning.planner`).
  Stage 1 *across* prompts (more rollouts where the predictor sees contrast, none for solved or
  hopeless prompts) is not expressible in TRL's fixed-`num_generations` shape: every prompt gets G.
- **One row per leaf** (`trace_rl.integrations.rows.tree_rows`, shared with the verl adapter):
  `prompt_ids` = the root's tokens, `completion_ids` = the rest of the leaf's path, `logprobs` = the
  behaviour log-probs, `trace_reward` = the leaf's reward, which `leaf_reward` hands back to TRL.
- **Tree advantages per token.** `trace_advantages` holds the tree advantages (the `trace`
  estimator's, or the run's `TrainConfig.estimator` with its options) on the tokens a row trains, and
  `env_mask` is 1 exactly there (the rows module's `train_mask`): the policy tokens of the nodes the
  row owns, so each node's tokens enter TRL's loss once, as in trace-rl's own update.
  `TraceGRPOTrainer` puts these (B, T) advantages in place of TRL's flat group advantages.

The gradient against trace-rl's `Trainer` (with the GRPOConfig `grpo_config` makes):

- The same: per-token PPO-clip (`epsilon` = clip_low, `epsilon_high` = clip_high), summed over the
  trained tokens and divided by their number (`loss_type="dapo"`, whose denominator counts the
  env_mask-1 tokens, so each node's tokens once, as `loss_denominator`), log-probs at the sampling
  temperature, AdamW at a constant learning rate, gradient-norm clipping, the k3 KL at `beta` =
  kl_coef, `num_iterations` = epochs.
- Different: one optimiser step per generation, i.e. trace-rl's `train.mini_batches: 1` (with
  `steps_per_generation` > 1, TRL's mini-batches are shuffled rows rather than whole trees, each
  divided by the batch's token count over the steps rather than its own). TRL's ratio starts from its
  own forward pass (the detached log-probs) rather than the engine's, which agree to float rounding on
  the same weights. TRL's `completions/*_length` count trained tokens only (its length is the
  env_mask sum), and its completions table (`log_completions`) shows its own flat advantages.

Checkpoints: TRL's hold the model, optimiser and RNGs; `TraceState` (a callback `TraceGRPOTrainer` adds)
writes the predictor and the collector's state (sampling RNG, Stage-2 evidence, token costs) beside them
as `checkpoint-N/trace_rl_state.pt`, and `train(resume_from_checkpoint=...)` from `output_dir` restores
them, so a resumed run's allocation continues where it stopped.

Generation runs on trace-rl's engine, an `HFEngine` over the trainer's live model: before a batch,
whenever the trainer's step has moved, the engine receives the trainer's weights (`update_weights`,
which also empties its prefix cache), and the model samples in eval mode. After each batch the
predictor learns from the trees' backup targets, as trace-rl's trainer does; the batch's `tree/*`,
`rollout/*`, `critic/*` and `predictor/*` figures join TRL's logged metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trace_rl.agent.types import Task
from trace_rl.core.advantage import NodeAdvantages, advantage_metrics, get_estimator
from trace_rl.core.tree import RolloutTree
from trace_rl.infra.config import FieldError
from trace_rl.integrations.rows import ADVANTAGES, REWARD, tree_rows
from trace_rl.planning.metrics import predictor_metrics, rollout_metrics
from trace_rl.predictor.base import backup_targets
from trace_rl.rollout.collector import RolloutBatch, TreeRolloutCollector
from trace_rl.run import Parts, RunConfig
from trace_rl.storage.rundir import atomic_write, checkpoint_data

CHECKPOINTING = "activation_checkpointing" if "activation_checkpointing" in GRPOConfig.__dataclass_fields__ else "gradient_checkpointing"
"""Recent transformers 5 releases (5.24 here) call it `activation_checkpointing` and warn whenever the old
name is set, which TRL's default always does."""


def leaf_reward(prompts: list[Any], completions: list[Any], trace_reward: list[float], **kwargs: Any) -> list[float]:
    """TRL reward function: each row's leaf reward, as the env scored it during the rollout. (TRL
    passes every row field and its own helpers as keywords, hence `**kwargs`.)"""
    return [float(reward) for reward in trace_reward]


@dataclass
class TraceRollout:
    """TRL's `rollout_func`: one TRACE tree per distinct prompt, one row per leaf (module docstring)."""

    collector: TreeRolloutCollector
    """Grows the trees; its engine samples the trainer's model and `rollout.budget` is TRL's `num_generations`."""
    tasks: Sequence[Task]
    """The tasks the prompts come from; a prompt is its task's question (`dataset()`)."""
    estimator: Callable[[Sequence[RolloutTree]], list[NodeAdvantages]] = field(default_factory=lambda: get_estimator("trace"))
    """The tree advantages, options bound (`TrainConfig.estimator`); `trace` by default."""
    last: RolloutBatch | None = field(default=None, init=False)
    """The newest batch of trees, rows in the order of their leaves."""

    def __post_init__(self) -> None:
        self._by_prompt: dict[str, Task] = {}
        for task in self.tasks:
            other = self._by_prompt.setdefault(task.question, task)
            if other is not task:
                raise ValueError(f"tasks {other.task_id!r} and {task.task_id!r} ask the same question; TRL passes only the prompt, which must name one task")
        self._synced = False

    @classmethod
    def from_parts(cls, parts: Parts, config: RunConfig) -> TraceRollout:
        """Over `trace_rl.run.build_parts(config)`' collector and train tasks, with the run's estimator."""
        return cls(parts.collector, parts.train.tasks, config.train.estimator(config.rollout.spec))

    @property
    def num_generations(self) -> int:
        return self.collector.config.budget

    def dataset(self) -> Dataset:
        """TRL's train dataset: one row per task, its question as the `prompt`."""
        return Dataset.from_dict({"prompt": [task.question for task in self.tasks]})

    def __call__(self, prompts: list[Any], trainer: GRPOTrainer) -> dict[str, list[Any]]:
        tasks = self._tasks_of(prompts)
        model = trainer.accelerator.unwrap_model(trainer.model)
        step = int(trainer.state.global_step)
        if not self._synced or self.collector.engine.weight_version != step:
            self.collector.engine.update_weights(model, version=step)
            self._synced = True
        training = model.training
        model.eval()  # sample as trace-rl's trainer does (dropout off)
        try:
            batch = self.collector.collect(tasks, per_tree=True)
        finally:
            model.train(training)
        advantages = self.estimator(batch.trees)
        rows = tree_rows(batch.trees, advantages)
        rows["env_mask"] = rows.pop("train_mask")  # TRL's name for the mask of the tokens a row trains
        metrics = {**batch.metrics(), **rollout_metrics(batch.trees), **predictor_metrics(batch.trees), **advantage_metrics(batch.trees, advantages)}
        histories, targets, weights = backup_targets(batch.trees)
        if histories:
            metrics.update(self.collector.predictor.update(histories, targets, weights))
        for name, value in metrics.items():
            trainer._log_metric(name, float(value))  # the hook TRL gives reward functions (`log_metric`)
        self.last = batch
        return rows

    def _tasks_of(self, prompts: list[Any]) -> list[Task]:
        """The task of each group of G consecutive prompts; ValueError unless they are G copies of one."""
        g = self.num_generations
        if len(prompts) % g:
            raise ValueError(f"rollout_func got {len(prompts)} prompts, not whole groups of num_generations={g}")
        tasks = []
        for start in range(0, len(prompts), g):
            group = prompts[start : start + g]
            if any(prompt != group[0] for prompt in group):
                raise ValueError(
                    f"prompts {start}-{start + g - 1} are not {g} copies of one prompt: a prompt's copies must reach one "
                    "rollout_func call together (each process needs whole groups: per_device_train_batch_size a multiple of num_generations)"
                )
            task = self._by_prompt.get(group[0]) if isinstance(group[0], str) else None
            if task is None:
                raise ValueError(f"prompt {str(group[0])[:80]!r} is no task's question; train on TraceRollout.dataset()")
            tasks.append(task)
        return tasks


def check_grpo_config(args: GRPOConfig, rollout: TraceRollout) -> None:
    """FieldError unless `args` trains the tree advantages as the module docstring says."""
    config = rollout.collector.config
    if config.budget_unit != "leaves":
        raise FieldError("rollout.budget_unit", config.budget_unit, "leaves (TRL's groups hold num_generations rows each)")
    if args.num_generations != config.budget:
        raise FieldError("GRPOConfig.num_generations", args.num_generations, f"rollout.budget={config.budget} (each prompt's tree holds exactly that many leaves)")
    if args.temperature != config.sampling_temperature:
        raise FieldError("GRPOConfig.temperature", args.temperature, f"rollout.temperature={config.sampling_temperature} (TRL scores the tokens at its temperature, the engine sampled at the rollout's)")
    if args.loss_type != "dapo":
        raise FieldError("GRPOConfig.loss_type", args.loss_type, "'dapo' (a token sum over the trained tokens: each node's tokens count once; the other losses normalise per row)")
    if args.importance_sampling_level != "token":
        raise FieldError("GRPOConfig.importance_sampling_level", args.importance_sampling_level, "'token' (tree advantages differ along a row)")
    if args.mask_truncated_completions:
        raise FieldError("GRPOConfig.mask_truncated_completions", True, "False (a ReAct row ends on a stop string, not EOS, so TRL would take it for truncated and train nothing)")
    if args.use_vllm:
        raise FieldError("GRPOConfig.use_vllm", True, "False (the rollouts come from trace-rl's engine; TRL's vLLM would sample nothing)")


def grpo_config(config: RunConfig, *, output_dir: str, **extra: Any) -> GRPOConfig:
    """TRL's GRPOConfig for the update trace-rl's trainer makes with `config` (module docstring):
    `prompts_per_step` prompts of `rollout.budget` rows per generation, one optimiser step per
    generation and epoch, `train.steps` generations. `extra` sets any other GRPOConfig field."""
    train, rollout = config.train, config.rollout
    on_gpu = config.model.device.startswith("cuda")
    settings: dict[str, Any] = {
        "output_dir": output_dir,
        "num_generations": rollout.budget,
        "per_device_train_batch_size": config.prompts_per_step * rollout.budget,
        "gradient_accumulation_steps": 1,
        "num_iterations": train.epochs,
        "max_steps": train.steps * train.epochs,
        "learning_rate": train.lr,
        "lr_scheduler_type": "constant",
        "weight_decay": train.weight_decay,
        "max_grad_norm": train.grad_clip,
        "epsilon": train.clip_low,
        "epsilon_high": train.clip_high,
        "beta": train.kl_coef,
        "loss_type": "dapo",
        "temperature": rollout.sampling_temperature,
        "top_p": rollout.top_p,
        "bf16": train.precision == "bf16" or (train.precision == "auto" and on_gpu),
        CHECKPOINTING: False,  # trace-rl recomputes nothing; TRL turns it on by default
        "use_cpu": config.model.device == "cpu",
        "seed": config.seed,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
    }
    return GRPOConfig(**{**settings, **extra})


STATE_FILE = "trace_rl_state.pt"
"""The file in each TRL checkpoint folder holding the rollout's predictor and collector state."""


class TraceState(TrainerCallback):
    """Saves the rollout's predictor and collector state with every TRL checkpoint, and restores it when
    training resumes from one in `output_dir` (`checkpoint-<global_step>`); data only (`checkpoint_data`)."""

    def __init__(self, rollout: TraceRollout) -> None:
        self.rollout = rollout

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        data = checkpoint_data({"step": state.global_step, **self.rollout.collector.checkpoint_state()})
        atomic_write(folder / STATE_FILE, lambda tmp: torch.save(data, tmp))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 0:
            return
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"resuming at step {state.global_step}, but {path} is missing: the predictor and the "
                                    "sampling RNG of those steps are not there (resume from a checkpoint TraceGRPOTrainer wrote in output_dir)")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        self.rollout.collector.restore_checkpoint_state(saved)


class TraceGRPOTrainer(GRPOTrainer):
    """GRPOTrainer on TRACE trees: `rollout` grows them, `leaf_reward` scores the rows, and the tree
    advantages replace TRL's group advantages in `_generate_and_score_completions` (the override TRL's
    maintainers name for custom advantages; its loss takes (B, T) advantages as they are)."""

    def __init__(
        self,
        model: Any,
        rollout: TraceRollout,
        args: GRPOConfig,
        *,
        train_dataset: Dataset | None = None,
        callbacks: list[Any] | None = None,
    ) -> None:
        check_grpo_config(args, rollout)
        super().__init__(
            model,
            reward_funcs=[leaf_reward],
            args=args,
            train_dataset=rollout.dataset() if train_dataset is None else train_dataset,
            processing_class=rollout.collector.tokenizer,
            callbacks=[*(callbacks or []), TraceState(rollout)],
            rollout_func=rollout,
        )

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)  # it wrote each row's fields into `inputs`
        completion_ids = output["completion_ids"]
        advantages = torch.zeros(completion_ids.shape, dtype=torch.float32)
        for row, example in enumerate(inputs):
            values = example[ADVANTAGES]
            advantages[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        output["advantages"] = advantages.to(completion_ids.device)
        return output
