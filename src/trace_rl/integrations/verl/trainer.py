"""`TracePPOTrainer`: verl's synchronous V1 trainer training the tree advantages the rows carry.

Registered as trainer mode `trace` (`trainer.v1.trainer_mode=trace`). It is verl's `sync` trainer
(colocated rollout, weights synced to the replicas after every step) with two steps replaced:

- `_compute_advantage` reads each row's `trace_advantages` (written by `TraceAgentLoopManager`, one
  value per response token, 0 where the row trains nothing; 0 on verl's padding rows, which it adds
  to make a batch divisible across ranks) and stores them as verl's `advantages` and `returns`, in place of the estimator `algorithm.adv_estimator` names, which sees only rewards,
  the mask and `uid`, never the tree;
- `_compute_reward_colocate` keeps the rows' `rm_scores`: each leaf's reward was scored by
  trace-rl's env during the rollout.

verl's rollout correction (`algorithm.rollout_correction`, on by default: its off-policy metrics, and
with `rollout_is` / `rollout_rs` set, importance weights and rejection) runs as verl's own advantage
step runs it, on the rows' `rollout_log_probs` and the actor's recomputed `old_log_probs`, and its
`rollout_corr/*` figures reach verl's logger (as do the manager's TRACE figures, under `trace/`); rejection zeroes `response_mask`, which the actor's loss
reads, so a rejected token's tree advantage trains nothing.

What verl's actor then does with them is its own PPO update: per-token clipped ratio on its
recomputed old log-probs, `actor.loss_agg_mode=token-mean` over `response_mask` (the tokens each
row trains, so a shared prefix counts once), KL as a loss term (`actor.use_kl_loss`). A KL penalty
folded into the rewards (`algorithm.use_kl_in_reward`) would need the estimator that this trainer
skips, so it is refused.
"""

from __future__ import annotations

import torch
import transfer_queue as tq
from tensordict import TensorDict
from verl.protocol import DataProto
from verl.trainer.ppo.rollout_corr_helper import (
    compute_rollout_correction_and_add_to_batch,
)
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.utils.padding import response_to_nested

from trace_rl.infra.config import ConfigError
from trace_rl.integrations.rows import ADVANTAGES

TRAINER_MODE = "trace"


@register_trainer(TRAINER_MODE)
class TracePPOTrainer(PPOTrainerSync):
    """verl's `sync` trainer on TRACE's tree advantages (module docstring)."""

    def __init__(self, config, *args, **kwargs):
        if config.algorithm.get("use_kl_in_reward", False):
            raise ConfigError("algorithm.use_kl_in_reward=True: trainer mode 'trace' trains the rows' tree advantages as they are; use actor_rollout_ref.actor.use_kl_loss for a KL term")
        super().__init__(config, *args, **kwargs)

    def _compute_advantage(self, batch, metrics):
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=[ADVANTAGES, "response_mask"])
        rows = []
        for key, tag, advantage, mask in zip(batch.keys, batch.tags, data[ADVANTAGES].unbind(), data["response_mask"].unbind()):
            if tag.get("is_padding", False):  # verl's no-op rows copy a real row's fields but hold one response token
                rows.append(torch.zeros(mask.shape[0], dtype=torch.float32))
            elif advantage.shape != mask.shape:
                raise ValueError(f"row {key}: {advantage.shape[0]} tree advantages for {mask.shape[0]} response tokens")
            else:
                rows.append(advantage.float())
        advantages = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        fields = TensorDict({"advantages": advantages, "returns": advantages.clone()}, batch_size=len(batch))
        batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
        metrics.update(trace_figures(getattr(self, "agent_loop_manager", None), getattr(self, "global_steps", None)))
        return rollout_correction(batch, self.config.algorithm.get("rollout_correction", None), metrics)

    def _compute_reward_colocate(self, batch, metrics=None):
        return batch


def trace_figures(manager, step) -> dict[str, float]:
    """The manager's figures of training step `step` (`tree/*`, `predictor/*`, `rollout/*`, ...) under
    `trace/`, for the step's metrics, which verl's own logger (console, wandb, TensorBoard) writes: the
    manager runs in the trainer's process (verl's task runner hands it to `fit`). Empty for another
    step or another manager."""
    if manager is None or getattr(manager, "last_step", None) != step:
        return {}
    return {f"trace/{key}": float(value) for key, value in manager.last_metrics.items()}


def rollout_correction(batch, settings, metrics: dict):
    """verl's rollout correction on `batch`, as `PPOTrainerSync._compute_advantage` runs it: skipped when
    `settings` is None, in bypass mode, or without rollout log-probs; else its `rollout_corr/*` metrics
    go into `metrics` and the (rejection-)masked `response_mask`, with `rollout_is_weights` when
    `rollout_is` is set, go back to TransferQueue."""
    if settings is None or settings.get("bypass_mode", False):
        return batch
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask", "rollout_log_probs", "old_log_probs"])
    if "rollout_log_probs" not in data.keys() or "old_log_probs" not in data.keys():
        return batch
    response_mask = data["response_mask"]
    proto = DataProto(batch=data.to_padded_tensor())
    proto, figures = compute_rollout_correction_and_add_to_batch(proto, settings)
    metrics.update(figures)
    names = ["response_mask", *(["rollout_is_weights"] if "rollout_is_weights" in proto.batch else [])]
    fields = TensorDict({name: response_to_nested(proto.batch[name], response_mask) for name in names}, batch_size=len(batch))
    return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
