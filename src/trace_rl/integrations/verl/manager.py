"""`TraceAgentLoopManager`: TRACE's collector as verl's V1 agent-loop manager.

verl's V1 trainer hands the manager a whole training batch (`generate_sequences(batch)`, a
TensorDict of `data.train_batch_size` prompts, each with a `uid` already registered in
TransferQueue as a pending group) and then waits in its replay buffer until every group's tag reads
`finished`, reading the group's trajectories from the keys `{uid}_*`. verl's own manager fans the
prompts out to agent-loop workers, `rollout.n` independent sessions each. This one plans the batch
as trace-rl's trainer does, so both stages stay exact over all of it:

1. Stage 1 across the batch's prompts and Stage 2 across every prefix of its trees
   (`TreeRolloutCollector.collect`, `rollout.budget` leaves in all, which must equal
   `data.train_batch_size * actor_rollout_ref.rollout.n`, the rows verl expects), generating through
   verl's own replicas (`LLMServerEngine` over the trainer's `LLMServerClient`);
2. the tree advantages (the run's `train.estimator`, `trace` by default), and one row per leaf
   (`trace_rl.integrations.rows.tree_rows`) written to TransferQueue under `{uid}_{leaf}_0`, with
   verl's fields (`prompts`, `responses`, `response_mask` = the tokens the row trains, so a shared
   prefix enters the token-mean loss once, `rollout_log_probs`, `rm_scores` = the leaf's own reward
   on its last token) and trace-rl's (`trace_advantages` per response token, `trace_leaf`,
   `trace_nodes`: the node id of every response token), then the group's tag set to `finished`.
   A prompt Stage 1 gives no rollout is a finished group with no rows;
3. the predictor learns from the trees' backups, and with `trace_rl.out` set the batch's figures
   and trees go to that run folder (`metrics.jsonl`, `trees/`), so `trace-rl report` reads them.

**Resuming.** verl's checkpoints hold its models, not the manager's state (the predictor, the
collector's RNG, Stage-2 evidence and token costs). With `trace_rl.out` set, the manager saves that
state after every training step as `checkpoints/step_XXXX.pt` in the folder, keeping the steps verl
checkpoints (`trainer.save_freq`) and the newest. When verl resumes from its step k, the first batch
it sends is step k + 1, and the manager restores its state of step k (and rewinds the folder's
metrics to it) before planning; a resume it has no state for is refused, naming the steps it has.
Without `trace_rl.out`, a resumed run's predictor starts cold, with a warning.

Every row carries its own reward and advantage: verl's agent-loop path copies the last output's
reward onto a session's other outputs and its GRPO estimator sees only rewards and `uid`, which is
why the advantages travel as a field and `TracePPOTrainer` (trainer mode `trace`) trains them.
Validation batches (`validate` set) get `val_kwargs.n` (or the row's `__rollout_n__`) independent
rollouts per prompt at `val_kwargs.temperature`, no allocation.

The trace-rl side is a run config, named in verl's config as `+trace_rl.config=<yaml>` with optional
`+trace_rl.overrides=[key=value, ...]` and `+trace_rl.out=<folder>`: its rollout, method,
predictor, estimator and env (tools, retrieval server) are the ones used. Each dataset row carries
its task (`extra_info.trace_task`, the task as JSON, written by `trace-rl verl-data`), so train and
validation files may come from different task sets.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trace_rl.agent.types import Task
from trace_rl.core.advantage import advantage_metrics
from trace_rl.core.tree import RolloutTree
from trace_rl.infra.config import ConfigError, load_config
from trace_rl.integrations.rows import ADVANTAGES, LEAF, REWARD, tree_rows
from trace_rl.integrations.verl.engine import BACKENDS, LLMServerEngine
from trace_rl.planning.metrics import predictor_metrics, rollout_metrics
from trace_rl.predictor.base import backup_targets
from trace_rl.rollout.collector import TreeRolloutCollector
from trace_rl.run import RunConfig, build_env, build_predictor, task_splits
from trace_rl.storage.rundir import RunDir

logger = logging.getLogger(__name__)

TASK_KEY = "trace_task"
"""The key of a dataset row's `extra_info` holding its trace-rl task, as JSON (`Task.to_dict`)."""
REWARD_EXTRA_INFO = ("score", "acc")
"""Names a row's `extra_fields.reward_extra_info` gives its leaf's reward (verl's reward loop reports
`score` and, for rule rewards, `acc`), so `algorithm.filter_groups.metric` can name either."""
NODES = "trace_nodes"
"""Row field: the tree node id of every response token."""


@dataclass
class TraceSettings:
    """The `trace_rl` section of verl's config."""

    config: str
    overrides: tuple[str, ...] = ()
    out: str | None = None

    @classmethod
    def from_verl(cls, config: Any) -> TraceSettings:
        section = config.get("trace_rl") if hasattr(config, "get") else None
        if not section or not section.get("config"):
            raise ConfigError("verl config: trace_rl.config is not set; add +trace_rl.config=<trace-rl run config yaml>")
        return cls(str(section["config"]), tuple(str(o) for o in section.get("overrides") or ()), section.get("out"))


def check_verl_config(config: Any, run: RunConfig) -> None:
    """ConfigError unless verl's settings let the manager's rows through as they are (module docstring)."""
    rollout = config.actor_rollout_ref.rollout
    rows = int(config.data.train_batch_size) * int(rollout.n)
    if run.rollout.budget_unit != "leaves" or run.rollout.budget != rows:
        raise ConfigError(
            f"trace_rl rollout.budget={run.rollout.budget} ({run.rollout.budget_unit}): verl expects data.train_batch_size * "
            f"actor_rollout_ref.rollout.n = {rows} rows a step; set rollout.budget to it (budget_unit leaves)"
        )
    if int(config.data.train_batch_size) != run.prompts_per_step:
        raise ConfigError(f"trace_rl prompts_per_step={run.prompts_per_step} but data.train_batch_size={config.data.train_batch_size}; they must agree")
    if str(rollout.get("name", "vllm")) not in BACKENDS:
        raise ConfigError(f"actor_rollout_ref.rollout.name={rollout.get('name')!r}: trace-rl's manager writes requests for {' or '.join(BACKENDS)} replicas only")
    if rollout.get("full_determinism", False):
        raise ConfigError("actor_rollout_ref.rollout.full_determinism=True sends verl's sticky key as the vLLM request id, which a tree's concurrent branches share")
    prompt, response = config.data.get("max_prompt_length"), config.data.get("max_response_length")
    if prompt is not None and response is not None and run.rollout.max_context_tokens > int(prompt) + int(response):
        raise ConfigError(f"trace_rl rollout.max_context_tokens={run.rollout.max_context_tokens} exceeds verl's data.max_prompt_length + "
                          f"data.max_response_length = {int(prompt) + int(response)}, the longest sequence its replicas and actor take")
    if abs(float(rollout.temperature) - run.rollout.temperature) > 1e-9:
        raise ConfigError(f"actor_rollout_ref.rollout.temperature={rollout.temperature} but trace_rl rollout.temperature={run.rollout.temperature}; they must agree")


class TraceAgentLoopManager:
    """verl V1 agent-loop manager (`actor_rollout_ref.rollout.agent.agent_loop_manager_class=
    trace_rl.integrations.verl.manager.TraceAgentLoopManager`): module docstring."""

    def __init__(
        self,
        config: Any,
        llm_client: Any,
        teacher_client: Any = None,
        reward_loop_worker_handles: Any = None,
        *,
        tokenizer: Any = None,
    ) -> None:
        settings = TraceSettings.from_verl(config)
        self.verl_config = config
        self.run = load_config(RunConfig, settings.config, list(settings.overrides))
        check_verl_config(config, self.run)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
        _, train = task_splits(self.run)
        env = build_env(self.run, train)  # its tools and corpus (or the retrieval server) serve every row's task
        self.engine = LLMServerEngine(llm_client, tokenizer, backend=str(config.actor_rollout_ref.rollout.get("name", "vllm")))
        self.predictor = build_predictor(self.run)
        self.collector = TreeRolloutCollector(self.engine, tokenizer, env, self.predictor, self.run.rollout, seed=self.run.seed)
        self.estimator = self.run.train.estimator(self.run.rollout.spec)
        self.out = RunDir(settings.out) if settings.out else None
        if self.out is not None:
            self.out.write_config(self.run)
        self.last_trees: list[RolloutTree] = []
        self.last_metrics: dict[str, float] = {}
        self.last_step: int | None = None
        """The training step `last_metrics` belong to (`TracePPOTrainer` logs them through verl's logger)."""
        trainer = config.get("trainer") if hasattr(config, "get") else None
        self.save_freq = int((trainer.get("save_freq", -1) if trainer is not None else -1) or -1)
        """verl's checkpoint cadence: the manager's states at these steps are kept for a resume."""
        self._checked_resume = False
        self.failed_batches = 0
        """Batches whose collection raised, their groups marked failed (`mark_failed`)."""

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> TraceAgentLoopManager:
        """How verl's task runner builds a manager (`AgentLoopManager.create`)."""
        return cls(*args, **kwargs)

    def generate_sequences(self, batch: Any) -> None:
        """Grow the batch's trees and put one row per leaf into TransferQueue (module docstring)."""
        validate = bool(_value(batch, "validate", False))
        step = int(_value(batch, "global_steps", 0))
        uids = [str(u) for u in _column(batch, "uid")]
        tasks = [self._task(info, uid) for info, uid in zip(_column(batch, "extra_info"), uids)]
        begin = time.perf_counter()
        partition = "val" if validate else "train"
        if not validate and not self._checked_resume:
            self.restore(step)
            self._checked_resume = True
        try:
            if validate:
                trees = self._validation_trees(batch, tasks)
                advantages = self.estimator(trees)
            else:
                collected = self.collector.collect(tasks)
                trees = collected.trees
                advantages = self.estimator(trees)
        except Exception as exc:  # a replica aborted or died, a tool server failed hard: verl decides what follows
            logger.exception("trace-rl: the batch of step %d failed (%s); its %d groups are marked failed", step, exc, len(uids))
            mark_failed(uids, partition)
            self.failed_batches += 1
            return
        if not validate:
            self._learn(trees, advantages, collected.metrics(), step, time.perf_counter() - begin)
            self._save_state(step)
        put_rows(trees, advantages, uids, _prompt_fields(batch), partition=partition, global_steps=step)

    def restore(self, step: int) -> int | None:
        """Before the first training batch, `step`: restore the manager's state of step - 1 from
        `trace_rl.out` when verl resumed (step > 1); the step restored, or None (module docstring)."""
        if step <= 1:
            return None
        if self.out is None:
            logger.warning("verl resumed at step %d without +trace_rl.out: the predictor and Stage-2 evidence start cold "
                           "(set trace_rl.out to keep them across resumes)", step)
            return None
        saved = self.out.checkpoint_files()
        if step - 1 not in saved:
            raise ConfigError(
                f"verl resumed at step {step}, but {self.out.path} holds the manager's state for steps {sorted(saved) or 'none'}, "
                f"not {step - 1}: the predictor would not be the one those steps trained. Resume verl from one of those steps"
            )
        state = self.out.read_checkpoint(step - 1)
        self.collector.restore_checkpoint_state(state)
        record = state.get("record")
        self.out.rewind(step - 1, json.loads(record) if isinstance(record, str) else None)
        logger.info("trace-rl: restored the manager's state of step %d from %s", step - 1, self.out.path)
        return step - 1

    def _save_state(self, step: int) -> None:
        """The manager's state after `step` into `trace_rl.out`; keeps verl's checkpoint steps and the newest."""
        if self.out is None:
            return
        self.out.save_checkpoint({"step": step, **self.collector.checkpoint_state()}, step, keep=None)
        for old, path in self.out.checkpoint_files().items():
            if old != step and not (self.save_freq > 0 and old % self.save_freq == 0):
                path.unlink()

    def _task(self, info: Any, uid: str) -> Task:
        text = info.get(TASK_KEY) if isinstance(info, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"prompt {uid}: extra_info has no {TASK_KEY}; write the parquet files with `trace-rl verl-data`")
        try:
            return Task.from_dict(json.loads(text))
        except ValueError as exc:  # json.JSONDecodeError included
            raise ValueError(f"prompt {uid}: extra_info.{TASK_KEY} is not a task: {exc}") from None

    def _learn(self, trees: list[RolloutTree], advantages: Sequence[Any], figures: dict[str, float], step: int, seconds: float) -> None:
        """The predictor learns from the batch's backups; its figures are kept (and written to `trace_rl.out`)."""
        metrics = {**figures, **rollout_metrics(trees), **predictor_metrics(trees), **advantage_metrics(trees, advantages)}
        histories, targets, weights = backup_targets(trees)
        if histories:
            metrics.update(self.predictor.update(histories, targets, weights))
        metrics["timing_s/trace_collect"] = seconds
        self.last_trees, self.last_metrics, self.last_step = trees, metrics, step
        if self.out is not None:
            self.out.append_metrics({"step": step, "method": self.run.rollout.method, **metrics})
            self.out.write_trees(trees, step)
        logger.info("trace-rl step %d: %s", step, {k: round(v, 4) for k, v in metrics.items() if k.startswith(("tree/effective", "predictor/brier", "critic/"))})

    def _validation_trees(self, batch: Any, tasks: Sequence[Task]) -> list[RolloutTree]:
        val = self.verl_config.actor_rollout_ref.rollout.val_kwargs
        counts = [int(n) for n in _column(batch, "__rollout_n__")] if "__rollout_n__" in batch.keys() else [int(val.n)] * len(tasks)
        trees: list[RolloutTree] = []
        for n in sorted(set(counts)):
            chosen = [i for i, c in enumerate(counts) if c == n]
            grown = self.collector.sample([tasks[i] for i in chosen], n, temperature=float(val.temperature))
            trees += list(zip(chosen, grown))
        return [tree for _, tree in sorted(trees, key=lambda pair: pair[0])]


def put_rows(
    trees: Sequence[RolloutTree],
    advantages: Sequence[Any],
    uids: Sequence[str],
    prompt_fields: dict[str, list[Any]],
    *,
    partition: str,
    global_steps: int,
) -> list[str]:
    """Write one TransferQueue row per leaf (`{uid}_{leaf}_0`, tree i under `uids[i]`) and mark each
    prompt's group finished; returns the row keys in order (module docstring)."""
    import transfer_queue as tq

    rows = tree_rows(trees, advantages)
    keys, fields, tags = [], [], []
    r = 0
    for index, tree in enumerate(trees):
        for leaf in tree.leaves().tolist():
            keys.append(f"{uids[index]}_{leaf}_0")
            fields.append({**_row(rows, r, tree, leaf), **{k: v[index] for k, v in prompt_fields.items()}})
            tags.append(_tag(rows, r, global_steps))
            r += 1
    if keys:
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        tq.kv_batch_put(keys=keys, partition_id=partition, fields=list_of_dict_to_tensordict(fields), tags=tags)
    for uid in uids:
        tq.kv_put(key=uid, partition_id=partition, tag={"status": "finished"})
    return keys


def mark_failed(uids: Sequence[str], partition: str) -> None:
    """Tag each prompt group `failure`, as verl's own agent-loop worker does when a session raises: verl's
    replay buffer then refills them (`trainer.v1.sampler.sync_refill_failed_groups`) or stops with its
    own message saying to enable that. The groups of one batch fail together: TRACE plans the batch as
    a whole, so one tree's failure is the batch's."""
    import transfer_queue as tq

    for uid in uids:
        tq.kv_put(key=uid, partition_id=partition, tag={"status": "failure"})


def _row(rows: dict[str, list[Any]], r: int, tree: RolloutTree, leaf: int) -> dict[str, Any]:
    """One leaf's row in verl's field names (as `AgentLoopWorkerTQ` writes them) plus trace-rl's."""
    prompt = torch.tensor(rows["prompt_ids"][r], dtype=torch.int64)
    response = torch.tensor(rows["completion_ids"][r], dtype=torch.int64)
    mask = torch.tensor(rows["train_mask"][r], dtype=torch.int64)
    scores = torch.zeros(len(response), dtype=torch.float32)
    if len(response):
        scores[-1] = rows[REWARD][r]
    input_ids = torch.cat([prompt, response])
    nodes = [node for node in tree.path(leaf)[1:] for _ in tree.nodes[node].token_ids]
    return {
        "prompts": prompt,
        "responses": response,
        "response_mask": mask,
        "loss_mask": mask,
        "rollout_log_probs": torch.tensor(rows["logprobs"][r], dtype=torch.float32),
        "rm_scores": scores,
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "position_ids": torch.arange(len(input_ids), dtype=torch.int64),
        ADVANTAGES: torch.tensor(rows[ADVANTAGES][r], dtype=torch.float32),
        NODES: torch.tensor(nodes, dtype=torch.int64),
        LEAF: int(leaf),
        "num_turns": len(tree.path(leaf)) - 1,
        # verl's group filter (DAPO, `algorithm.filter_groups.metric`) reads a trajectory's reward_extra_info
        # unless the metric is `reward` (rm_scores): the leaf's own reward under the names verl's reward loop uses
        "extra_fields": {"reward_extra_info": {name: float(rows[REWARD][r]) for name in REWARD_EXTRA_INFO}},
    }


def _tag(rows: dict[str, list[Any]], r: int, step: int) -> dict[str, Any]:
    prompt, response = len(rows["prompt_ids"][r]), len(rows["completion_ids"][r])
    return {"status": "success", "prompt_len": prompt, "response_len": response, "seq_len": prompt + response,
            "global_steps": step, "min_global_steps": step, "max_global_steps": step}


def _prompt_fields(batch: Any) -> dict[str, list[Any]]:
    """The prompt's own non-tensor fields (`uid`, `index`, `data_source`, `raw_prompt`, ...), copied
    onto each of its rows as verl's workers do; the control keys are left out."""
    skip = {"validate", "__rollout_n__", "__do_sample__", "agent_name", "dummy_tensor"}
    out: dict[str, list[Any]] = {}
    for key in batch.keys():
        if key in skip or isinstance(batch.get(key), torch.Tensor):
            continue
        out[key] = list(_column(batch, key))
    return out


def _column(batch: Any, key: str) -> list[Any]:
    """A per-prompt column of verl's TensorDict batch as a Python list (a NonTensorStack, a
    NonTensorData shared by all rows, a tensor or a numpy array)."""
    value = batch.get(key)
    size = batch.batch_size[0]
    if hasattr(value, "tolist") and not hasattr(value, "data"):
        items = value.tolist()
    elif hasattr(value, "data") and not isinstance(value, torch.Tensor) and type(value).__name__ == "NonTensorData":
        items = [value.data] * size
    else:
        items = [getattr(v, "data", v) for v in value]
    if isinstance(items, np.ndarray):
        items = items.tolist()
    return list(items)


def _value(batch: Any, key: str, default: Any) -> Any:
    if key not in batch.keys():
        return default
    value = batch.get(key)
    value = getattr(value, "data", value)
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value.item() if hasattr(value, "item") else value
