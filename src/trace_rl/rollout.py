"""TreeRolloutCollector: one batch of rollout trees under an exact leaf budget.

The two stages, as in DESIGN.md §2:

1. predict root success for every task, allocate Stage 1's budget over prompts, and sample the
   *bare rollouts* (all `m_i` first turns of a prompt come from one engine call with `n = m_i`,
   so the prompt is prefilled once);
2. predict success at every intermediate prefix of the bare rollouts, allocate Stage 2's budget
   over them, and sample continuations from each chosen prefix (its env is restored from the
   snapshot taken when the prefix was made; its `k` first turns share one prefill).

Every rollout ends in a leaf with a reward, so the batch holds exactly `budget` leaves. The
allocator is the only thing that differs between methods: `grpo` and `dapo` (uniform; DAPO's
resampling of zero-variance groups is the trainer's), `prompt_only` and `trace_stage1` (Stage 1
exact, no Stage 2; they differ in the predictor the trainer gives them), `random_tree` (uniform
Stage 1, random prefixes), `trace_stage2` (uniform Stage 1, exact Stage 2) and `trace` (both exact).

Generation is batched across all in-flight rollouts, one turn at a time; the tool calls of a
round run concurrently in a thread pool (tools are I/O or subprocess bound).
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

from trace_rl.agent.env import EnvSnapshot, StepResult, ToolEnv
from trace_rl.agent.types import Task
from trace_rl.allocate import allocate_roots, expand_prefixes, random_prefixes, uniform_roots
from trace_rl.engine.base import Completion, Engine, SamplingParams
from trace_rl.predictor.base import SuccessPredictor
from trace_rl.tree import History, RolloutTree, tree_metrics

Method = Literal["grpo", "prompt_only", "random_tree", "dapo", "trace_stage1", "trace_stage2", "trace"]
METHODS: tuple[str, ...] = get_args(Method)

_STAGE1: dict[str, Literal["uniform", "exact"]] = {
    "grpo": "uniform",
    "prompt_only": "exact",
    "random_tree": "uniform",
    "dapo": "uniform",
    "trace_stage1": "exact",
    "trace_stage2": "uniform",
    "trace": "exact",
}
_STAGE2: dict[str, Literal["random", "exact"] | None] = {
    "grpo": None,
    "prompt_only": None,
    "random_tree": "random",
    "dapo": None,
    "trace_stage1": None,
    "trace_stage2": "exact",
    "trace": "exact",
}


@dataclass
class RolloutConfig:
    """How one batch of trees is sampled and how its budget is spent."""

    method: Method = "trace"
    """Allocator: grpo | prompt_only | random_tree | dapo | trace_stage1 | trace_stage2 | trace."""
    budget: int = 64
    """Leaves per batch (one rollout = one leaf; a continuation from a prefix counts as one)."""
    stage1_share: float = 0.5
    """Share of the budget spent on bare rollouts when the method has a Stage 2."""
    min_per_prompt: int = 2
    """A prompt gets zero rollouts or at least this many (one rollout has nothing to contrast with)."""
    max_per_prompt: int | None = None
    max_per_prefix: int | None = None
    max_turns: int = 5
    """Turns per rollout; the rollout is truncated (reward 0) after this many without an answer."""
    max_new_tokens: int = 64
    """Tokens per turn."""
    max_context_tokens: int = 2048
    """A rollout whose context would grow past this ends (reward 0) instead of overflowing the model."""
    temperature: float = 1.0
    top_p: float = 1.0
    success_threshold: float = 0.5
    """A leaf counts as a success for Stage 2's observed outcome r when its reward exceeds this."""
    env_workers: int = 4
    """Threads that run tool calls concurrently."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if not 0.0 < self.stage1_share <= 1.0:
            raise ValueError(f"stage1_share must be in (0, 1], got {self.stage1_share}")
        if self.min_per_prompt < 2:
            raise ValueError(f"min_per_prompt must be >= 2 (one rollout has nothing to contrast), got {self.min_per_prompt}")
        if self.max_turns < 1 or self.max_new_tokens < 1 or self.env_workers < 1:
            raise ValueError("max_turns, max_new_tokens and env_workers must be >= 1")

    @property
    def stage1_budget(self) -> int:
        if _STAGE2[self.method] is None:
            return self.budget
        return max(self.min_per_prompt, round(self.budget * self.stage1_share))

    @property
    def stage2_budget(self) -> int:
        return self.budget - self.stage1_budget


def encode_prompt(tokenizer: Any, env: ToolEnv, task: Task) -> list[int]:
    """Token ids of the task's prompt: the env's chat messages through the tokenizer's chat template."""
    rendered = tokenizer.apply_chat_template(env.messages(task), add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def encode_observation(tokenizer: Any, observation: str) -> list[int]:
    """Token ids of an observation as the env rendered it; it follows the turn inline (Search-R1 style)."""
    return list(tokenizer.encode(observation, add_special_tokens=False)) if observation else []


@dataclass
class RolloutBatch:
    trees: list[RolloutTree]
    stats: dict[str, float] = field(default_factory=dict)
    """`rollout/*` and `timing_s/*` figures: budget, leaves, token counts, time per phase."""

    def metrics(self) -> dict[str, float]:
        return {**tree_metrics(self.trees), **self.stats}


@dataclass
class _Start:
    """Where a group of `count` rollouts begins: a node of a tree, its tokens and its env state."""

    tree: RolloutTree
    node: int
    context: list[int]
    state: EnvSnapshot
    count: int


@dataclass
class _Rollout:
    """One rollout in flight: its tree, the node it ends at so far, its tokens and its env."""

    tree: RolloutTree
    node: int
    context: list[int]
    env: ToolEnv


class TreeRolloutCollector:
    """Samples trees for a batch of tasks with a policy engine, an env, a predictor and an allocator.

    `tokenizer` is the policy's Hugging Face tokenizer: prompts are rendered with its chat template
    and observations are tokenized with it, so the engine works on token ids end to end.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        env: ToolEnv,
        predictor: SuccessPredictor,
        config: RolloutConfig,
        *,
        seed: int = 0,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.env = env
        self.predictor = predictor
        self.config = config
        self.rng = np.random.default_rng(seed)
        self._stop = env.format.stop_strings([env.tools[name].spec for name in sorted(env.tools)])
        self._snapshots: dict[tuple[int, int], EnvSnapshot] = {}
        self._tasks: dict[int, Task] = {}
        self._tokens = {"generated": 0, "observation": 0, "prefill": 0}

    # ------------------------------------------------------------------ the two stages

    def collect(self, tasks: Sequence[Task]) -> RolloutBatch:
        if not tasks:
            raise ValueError("collect() needs at least one task")
        cfg = self.config
        self._snapshots.clear()
        self._tokens = dict.fromkeys(self._tokens, 0)
        timings: dict[str, float] = defaultdict(float)

        start = time.perf_counter()
        trees, starts = [], []
        for task in tasks:
            state = self._fresh_state(task)
            prompt_ids = encode_prompt(self.tokenizer, self.env, task)
            tree = RolloutTree.new(task.task_id, task.question, prompt_ids, meta={"source": task.source})
            trees.append(tree)
            starts.append(_Start(tree, 0, list(prompt_ids), state, 0))
        self._tasks = {id(tree): task for tree, task in zip(trees, tasks)}
        v_root = self.predictor.predict([History(task.question, (), task.task_id) for task in tasks])
        per_prompt = self._allocate_roots(v_root, cfg.stage1_budget)
        for st, v, m in zip(starts, v_root, per_prompt):
            st.tree.root.predicted, st.tree.root.budget, st.count = float(v), int(m), int(m)
        timings["timing_s/alloc"] += time.perf_counter() - start

        self._run([st for st in starts if st.count > 0], timings)

        leftover = 0
        if cfg.stage2_budget > 0:
            start = time.perf_counter()
            candidates = [(tree, node.id) for tree in trees for node in tree.nodes[1:] if self._expandable(tree, node.id)]
            histories = [tree.history(node) for tree, node in candidates]
            v_pref = self.predictor.predict(histories) if candidates else np.zeros(0)
            # r: the outcome of the one bare rollout through the prefix (its backup value)
            backups = {id(tree): tree.backup().values for tree in trees}
            outcomes = np.array(
                [backups[id(tree)][node] > cfg.success_threshold for tree, node in candidates], dtype=np.float64
            )
            per_prefix = self._expand(v_pref, outcomes, cfg.stage2_budget)
            prefix_starts = []
            for (tree, node), v, k in zip(candidates, v_pref, per_prefix):
                tree.nodes[node].predicted = float(v)
                if k > 0:
                    tree.nodes[node].budget = int(k)
                    prefix_starts.append(_Start(tree, node, self._context(tree, node), self._snapshots[(id(tree), node)], int(k)))
            leftover = cfg.stage2_budget - int(per_prefix.sum())
            prefix_starts += self._leftover_starts(trees, leftover)
            timings["timing_s/alloc"] += time.perf_counter() - start
            self._run(prefix_starts, timings)

        leaves = sum(int(tree.leaves().size) for tree in trees)
        if leaves != cfg.budget:  # a broken invariant is our bug, never a silent miscount
            raise AssertionError(f"collected {leaves} leaves for a budget of {cfg.budget}")
        stats = {
            "rollout/budget": float(cfg.budget),
            "rollout/leaves": float(leaves),
            "rollout/stage1_budget": float(cfg.stage1_budget),
            "rollout/stage2_budget": float(cfg.stage2_budget),
            "rollout/stage2_to_roots": float(leftover),
            "rollout/tokens_generated": float(self._tokens["generated"]),
            "rollout/tokens_observation": float(self._tokens["observation"]),
            "rollout/tokens_prefill": float(self._tokens["prefill"]),
            **timings,
        }
        return RolloutBatch(trees=trees, stats=stats)

    def sample(self, tasks: Sequence[Task], n: int, *, temperature: float | None = None) -> list[RolloutTree]:
        """`n` independent rollouts per task, no allocation and no Stage 2: evaluation and baselines.

        `temperature` overrides the config's (0 = greedy, which makes the n rollouts identical).
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self._snapshots.clear()
        starts = []
        for task in tasks:
            tree = RolloutTree.new(task.task_id, task.question, encode_prompt(self.tokenizer, self.env, task), meta={"source": task.source})
            tree.root.budget = n
            starts.append(_Start(tree, 0, list(tree.root.token_ids), self._fresh_state(task), n))
        self._run(starts, defaultdict(float), temperature=temperature)
        return [st.tree for st in starts]

    def _allocate_roots(self, v: np.ndarray, budget: int) -> np.ndarray:
        cfg = self.config
        if _STAGE1[cfg.method] == "uniform":
            return uniform_roots(len(v), budget, min_per_prompt=cfg.min_per_prompt)
        return allocate_roots(v, budget, min_per_prompt=cfg.min_per_prompt, max_per_prompt=cfg.max_per_prompt)

    def _expand(self, v: np.ndarray, r: np.ndarray, budget: int) -> np.ndarray:
        cfg = self.config
        if v.size == 0:
            return np.zeros(0, dtype=np.int64)
        if _STAGE2[cfg.method] == "random":
            return random_prefixes(v.size, budget, rng=self.rng, max_per_prefix=cfg.max_per_prefix)
        return expand_prefixes(v, r, budget, max_per_prefix=cfg.max_per_prefix)

    def _leftover_starts(self, trees: list[RolloutTree], leftover: int) -> list[_Start]:
        """Stage 2 budget no prefix could take (no intermediate prefix, or all full) goes to sampled roots.

        Round-robin over the prompts that already have rollouts, so the budget is still spent exactly.
        """
        sampled = [tree for tree in trees if tree.root.budget > 0]
        if leftover <= 0:
            return []
        if not sampled:
            raise AssertionError("Stage 1 sampled no prompt, so Stage 2 has nowhere to spend its budget")
        extra = np.bincount(np.arange(leftover) % len(sampled), minlength=len(sampled))
        starts = []
        for tree, k in zip(sampled, extra):
            if k:
                tree.root.budget += int(k)
                starts.append(_Start(tree, 0, list(tree.root.token_ids), self._fresh_state(self._tasks[id(tree)]), int(k)))
        return starts

    def _expandable(self, tree: RolloutTree, node: int) -> bool:
        """An intermediate prefix of a bare rollout with room for one more turn in the context."""
        n = tree.nodes[node]
        room = self.config.max_context_tokens - len(self._context(tree, node))
        return not n.is_terminal and bool(n.children) and room >= self.config.max_new_tokens and (id(tree), node) in self._snapshots

    # ------------------------------------------------------------------ generation

    def _run(self, starts: list[_Start], timings: dict[str, float], *, temperature: float | None = None) -> None:
        """Sample every rollout of every start to its end, one turn per round for all of them."""
        cfg = self.config
        pending: list[tuple[_Rollout, Completion]] = []
        by_count: dict[int, list[_Start]] = defaultdict(list)
        for st in starts:
            by_count[st.count].append(st)
        for count, group in sorted(by_count.items()):
            completions = self._generate([st.context for st in group], count, timings, temperature)
            for st, outs in zip(group, completions):
                for out in outs:
                    env = self._fresh_env()
                    env.load_snapshot(st.state)
                    pending.append((_Rollout(st.tree, st.node, list(st.context), env), out))
        with ThreadPoolExecutor(max_workers=cfg.env_workers) as pool:
            while pending:
                begin = time.perf_counter()
                results = list(pool.map(lambda item: item[0].env.step(item[1].text), pending))
                timings["timing_s/env"] += time.perf_counter() - begin
                active = [r for (r, out), res in zip(pending, results) if not self._record(r, out, res)]
                if not active:
                    break
                outs = self._generate([r.context for r in active], 1, timings, temperature)
                pending = [(r, o[0]) for r, o in zip(active, outs)]

    def _generate(
        self, contexts: list[list[int]], n: int, timings: dict[str, float], temperature: float | None = None
    ) -> list[list[Completion]]:
        cfg = self.config
        params = SamplingParams(
            n=n,
            temperature=cfg.temperature if temperature is None else temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            stop=self._stop,
            seed=int(self.rng.integers(2**31 - 1)),
        )
        begin = time.perf_counter()
        outs = self.engine.generate(contexts, params)
        timings["timing_s/gen"] += time.perf_counter() - begin
        self._tokens["prefill"] += sum(len(c) for c in contexts)
        self._tokens["generated"] += sum(len(o.token_ids) for group in outs for o in group)
        return outs

    def _record(self, rollout: _Rollout, out: Completion, result: StepResult) -> bool:
        """Append the turn to the tree; returns True when the rollout has ended."""
        cfg = self.config
        obs_ids = encode_observation(self.tokenizer, result.observation)
        context = rollout.context + list(out.token_ids) + obs_ids
        overflow = not result.done and len(context) + cfg.max_new_tokens > cfg.max_context_tokens
        done = result.done or overflow
        info = {**result.info.to_dict(), "finish_reason": out.finish_reason, "truncated": result.truncated or overflow}
        if overflow:
            info["truncated_by"] = "context"
        node = rollout.tree.add_turn(
            rollout.node,
            thought=result.info.thought,
            action=result.info.action,
            observation=result.info.observation,
            token_ids=list(out.token_ids) + obs_ids,
            mask=[1] * len(out.token_ids) + [0] * len(obs_ids),
            logprobs=list(out.logprobs) + [0.0] * len(obs_ids),
            reward=(result.reward if result.done else 0.0) if done else None,
            info=info,
        )
        self._tokens["observation"] += len(obs_ids)
        rollout.node, rollout.context = node, context
        if not done:
            self._snapshots[(id(rollout.tree), node)] = rollout.env.snapshot()
        return done

    # ------------------------------------------------------------------ helpers

    def _fresh_env(self) -> ToolEnv:
        return copy.copy(self.env)  # shares the (stateless) tools; episode state is per copy

    def _fresh_state(self, task: Task) -> EnvSnapshot:
        env = self._fresh_env()
        env.reset(task)
        return env.snapshot()

    @staticmethod
    def _context(tree: RolloutTree, node: int) -> list[int]:
        return [t for i in tree.path(node) for t in tree.nodes[i].token_ids]
