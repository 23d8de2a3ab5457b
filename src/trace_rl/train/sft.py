"""SFT warm start: teach a policy the tool format from scripted demonstrations before RL.

Agentic RL papers start from a model that already writes well-formed tool calls. Our
demonstrations come from the bundled tasks' scripted oracles, run through the real env (parser,
tools, scorer), with a share of turns replaced by a random agent's moves (wrong searches, early
guesses), so the demonstrations, and the model, are not perfect. Sequences use exactly the
collector's token layout (chat-templated prompt, then each turn's tokens and its observation's
tokens); the loss covers the turns only, never the prompt or observations.

The result is cached in a folder named by a hash of everything that shapes it, so it is made once.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trace_rl.agent.agents import Episode, OracleAgent, RandomAgent, run_episode
from trace_rl.agent.env import StepResult, ToolEnv
from trace_rl.agent.types import Task, TaskSet
from trace_rl.models import _atomic_folder, cache_root, load_policy, token_logprobs
from trace_rl.rollout import encode_observation, encode_prompt

_RECIPE_VERSION = 2  # bump when the recipe changes, so stale cached models are not reused

Sequences = Sequence[tuple[list[int], list[int]]]
"""Training sequences: (token ids, loss mask) pairs, mask 1 on the policy's own tokens."""


@dataclass
class SFTConfig:
    """Demonstrations and optimisation of the warm start."""

    demos: int = 2000
    """Demonstration episodes (train tasks are cycled through in seeded random order)."""
    mistake_prob: float = 0.15
    """Chance that a demonstration turn is a random agent's move instead of the oracle's."""
    steps: int = 150
    """Optimiser steps; batches are drawn epoch by epoch from the demonstrations."""
    batch_size: int = 16
    """Sequences per step (of similar length, see `length_batches`)."""
    lr: float = 2e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_seq_len: int = 2048
    """Longer demonstrations are cut (their tail is not trained)."""

    def __post_init__(self) -> None:
        for name in ("demos", "steps", "batch_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"sft.{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0.0 <= self.mistake_prob < 1.0:
            raise ValueError(f"sft.mistake_prob must be in [0, 1), got {self.mistake_prob!r}")
        if self.lr <= 0.0 or self.warmup_steps < 0:
            raise ValueError(f"sft.lr must be > 0 and sft.warmup_steps >= 0, got {self.lr!r} and {self.warmup_steps!r}")


# ---------------------------------------------------------------- demonstrations


class NoisyOracleAgent:
    """The oracle, except that each turn is a random agent's move with probability `mistake_prob`."""

    def __init__(self, oracle: OracleAgent, random_agent: RandomAgent, mistake_prob: float) -> None:
        self.oracle, self.random_agent, self.mistake_prob = oracle, random_agent, mistake_prob

    def act(self, task: Task, turns: Sequence[StepResult], rng: np.random.Generator) -> str:
        if rng.random() < self.mistake_prob:
            return self.random_agent.act(task, turns, rng)
        return self.oracle.act(task, turns, rng)


def demonstrations(taskset: TaskSet, env: ToolEnv, config: SFTConfig, *, seed: int) -> list[Episode]:
    """`config.demos` episodes of the noisy oracle on the taskset's tasks."""
    if taskset.oracle is None:
        raise ValueError(f"task set {taskset.name!r} has no scripted oracle to make demonstrations with")
    oracle = OracleAgent(taskset.oracle, env.format)
    random_agent = RandomAgent.for_corpus(env.format, taskset.corpus, malformed_prob=0.0)
    agent = NoisyOracleAgent(oracle, random_agent, config.mistake_prob)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(taskset.tasks))
    return [
        run_episode(env, taskset.tasks[order[i % len(order)]], agent, seed=seed * 1_000_003 + i)
        for i in range(config.demos)
    ]


def episode_tokens(tokenizer: Any, env: ToolEnv, episode: Episode) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of an episode in the collector's layout: 1 on the policy's turns only."""
    ids = encode_prompt(tokenizer, env, episode.task)
    mask = [0] * len(ids)
    for action, step in zip(episode.actions, episode.steps):
        turn = list(tokenizer.encode(action, add_special_tokens=False))
        observation = encode_observation(tokenizer, step.observation)
        ids += turn + observation
        mask += [1] * len(turn) + [0] * len(observation)
    return ids, mask


# ---------------------------------------------------------------- the warm start, cached


def sft_cache_key(parts: dict[str, Any]) -> str:
    blob = json.dumps({"recipe": _RECIPE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_start(
    model: str,
    taskset: TaskSet,
    env: ToolEnv,
    config: SFTConfig,
    *,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> Path:
    """Folder of the warm-started policy (model + tokenizer), trained on first use and cached.

    `model` is a preset or a model folder (see `trace_rl.models.load_policy`). The cache key covers
    the model, the task set's name, size and first tasks, the env's turn limit and a transcript of
    one oracle episode (so any change to the prompt, tools, `topk` or observation cuts shows), the
    config and the seed. The folder appears
    atomically, complete with `trace_rl_sft.json` (the recipe and its statistics), so a second call,
    in this process or another, returns at once. `progress(step, loss)` is called after every step.
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    key = sft_cache_key(
        {
            "model": model,
            "taskset": taskset.name,
            "tasks": len(taskset.tasks),
            "first": [t.task_id for t in taskset.tasks[:5]],
            "max_turns": env.max_turns,
            "transcript": hashlib.sha256(env_transcript(taskset, env).encode()).hexdigest(),
            "config": asdict(config),
            "seed": seed,
        }
    )
    target = root / f"sft-{key}"
    if (target / "trace_rl_sft.json").exists():
        return target

    start = time.perf_counter()
    episodes = demonstrations(taskset, env, config, seed=seed)
    texts = [p.text for p in taskset.corpus] + [t.question for t in taskset.tasks] + [e.context for e in episodes[:200]]
    policy = load_policy(model, seed=seed, tokenizer_texts=texts if model == "tiny" else None, cache_dir=root)
    sequences = [episode_tokens(policy.tokenizer, env, e) for e in episodes]
    sequences = [(ids[: config.max_seq_len], mask[: config.max_seq_len]) for ids, mask in sequences]
    stats = train_sft(policy.model, sequences, config, seed=seed, progress=progress)
    stats.update(
        {
            "sft/total_seconds": time.perf_counter() - start,
            "sft/demo_success": float(np.mean([e.reward for e in episodes])),
            "sft/demo_turns": float(np.mean([e.num_turns for e in episodes])),
            "sft/demo_tokens": float(np.mean([len(ids) for ids, _ in sequences])),
            "sft/demo_policy_tokens": float(np.mean([sum(mask) for _, mask in sequences])),
        }
    )
    with _atomic_folder(target) as tmp:
        policy.model.save_pretrained(tmp)
        policy.tokenizer.save_pretrained(tmp)
        record = {"model": model, "seed": seed, "config": asdict(config), "stats": stats}
        (tmp / "trace_rl_sft.json").write_text(json.dumps(record, indent=1))
    return target


def env_transcript(taskset: TaskSet, env: ToolEnv) -> str:
    """The oracle's episode on the first task: what the env shows a policy, for the cache key.

    The env's search `topk`, observation cuts, prompt and format all change this text, and none of
    them is otherwise visible from outside the env (a tool is a closure).
    """
    if taskset.oracle is None:
        raise ValueError(f"task set {taskset.name!r} has no scripted oracle to make demonstrations with")
    return run_episode(copy.copy(env), taskset.tasks[0], OracleAgent(taskset.oracle, env.format)).context


def sft_stats(folder: str | Path) -> dict[str, float]:
    """The statistics `warm_start` recorded in a warm-started policy's folder (seconds, losses, demos)."""
    return json.loads((Path(folder) / "trace_rl_sft.json").read_text())["stats"]


# ---------------------------------------------------------------- optimisation


def length_batches(lengths: Sequence[int], batch_size: int, rng: np.random.Generator) -> Iterator[list[int]]:
    """Endless batches of indices, epoch after epoch, each batch of similar lengths.

    A padded batch costs its longest row times its size, and demonstrations range from ~200 to
    ~900 tokens (1 to 4 hops), so random batches waste about a third of the compute on padding.
    Each epoch is shuffled, cut into windows of 8 batches, each window sorted by length and cut
    into batches, and the batches shuffled again: every batch is still a fresh random draw of
    tasks, but its rows have about the same length.
    """
    lengths = np.asarray(lengths)
    window = 8 * batch_size
    while True:
        order = rng.permutation(len(lengths))
        batches = []
        for begin in range(0, len(order), window):
            chunk = order[begin : begin + window]
            chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
            batches += [chunk[i : i + batch_size].tolist() for i in range(0, len(chunk), batch_size)]
        for index in rng.permutation(len(batches)):
            yield batches[index]


def pad_batch(batch: Sequences) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, attention mask, loss mask), each of shape (B, longest row)."""
    length = max(len(ids) for ids, _ in batch)
    ids = torch.zeros(len(batch), length, dtype=torch.long)
    attention = torch.zeros(len(batch), length, dtype=torch.long)
    loss_mask = torch.zeros(len(batch), length, dtype=torch.float32)
    for row, (seq, mask) in enumerate(batch):
        ids[row, : len(seq)] = torch.tensor(seq)
        attention[row, : len(seq)] = 1
        loss_mask[row, : len(seq)] = torch.tensor(mask, dtype=torch.float32)
    return ids, attention, loss_mask


def masked_nll(model: Any, ids: torch.Tensor, attention: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the tokens where `loss_mask` is 1 (the policy's own tokens).

    Prompt, observation and padding tokens are context only: their own prediction is never scored.
    """
    logp = token_logprobs(model, ids, attention)  # (B, T-1): predicts ids[:, 1:]
    target = loss_mask[:, 1:]
    return -(logp * target).sum() / target.sum().clamp(min=1.0)


def train_sft(
    model: Any,
    sequences: Sequences,
    config: SFTConfig,
    *,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> dict[str, float]:
    """`config.steps` AdamW steps on the masked loss, linear warmup then cosine decay to 10% of `lr`."""
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    def lr_scale(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        done = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_scale)
    batches = length_batches([len(ids) for ids, _ in sequences], config.batch_size, np.random.default_rng(seed))
    model.train()
    losses, tokens = [], 0
    start = time.perf_counter()
    for step in range(config.steps):
        ids, attention, loss_mask = pad_batch([sequences[i] for i in next(batches)])
        tokens += ids.numel()
        loss = masked_nll(model, ids.to(device), attention.to(device), loss_mask.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step, losses[-1])
    model.eval()
    return {
        "sft/first_loss": losses[0],
        "sft/final_loss": float(np.mean(losses[-10:])),
        "sft/seconds": time.perf_counter() - start,
        "sft/steps": float(config.steps),
        "sft/tokens": float(tokens),
    }
