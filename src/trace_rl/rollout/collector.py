"""TreeRolloutCollector: executes a batch's plan, so a batch of rollout trees holds exactly its budget.

The planner (`trace_rl.planning.planner`) decides where rollouts start; the collector does the rest, in the
order of DESIGN.md §2:

1. predict root success for every task, Stage 1 of the `Planner`, and sample the *bare rollouts*
   (all `m_i` first turns of a prompt come from one engine call with `n = m_i`, so the prompt is
   prefilled once);
2. predict success at every intermediate prefix of the bare rollouts, Stage 2 of the `Planner`, and
   sample continuations from each chosen prefix (its env is restored from the snapshot taken when the
   prefix was made; its `k` first turns share one prefill).

What a method does is its `MethodSpec` (`trace_rl.planning.methods`); the collector plans, in this process,
and an `Executor` executes the requests: `RolloutRunner` here (the default), or `trace_rl.rollout`'s
Ray workers (`rollout.backend: ray`), each running a `RolloutRunner` on some of the trees. Generation
is batched across all in-flight rollouts, one turn at a time; the tool calls of a round run
concurrently in a thread pool (tools are I/O or subprocess bound). Everything one `collect` keeps
(snapshots of prefixes, tasks) lives in that call's `Batch`, keyed by tree index and node id.

Seeds: each execution draws one seed from the collector's RNG, and every engine call of it takes a
seed derived from that one and from which call it is (`call_seed`: the start of the rollouts of one
count, or one turn round), never from which trees share the call. With an engine whose samples
depend only on (seed, prompt, occurrence of the prompt in the call), as the `hf` engine's do, a
worker running some of the trees draws exactly the tokens a local run draws for them.
"""

from __future__ import annotations

import importlib.util
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from trace_rl.agent.env import Env, EnvSnapshot, StepResult
from trace_rl.agent.types import Task
from trace_rl.core.token_budget import TokenCosts
from trace_rl.core.tree import History, RolloutTree
from trace_rl.engine.base import Completion, Engine, SamplingParams
from trace_rl.infra.config import FieldError, check_choice, check_range
from trace_rl.planning.evidence import Stage2Evidence
from trace_rl.planning.methods import (
    METHODS,
    AllocationSettings,
    MethodName,
    MethodSpec,
    expand_stage2,
    get_method,
)
from trace_rl.planning.metrics import tree_metrics
from trace_rl.planning.planner import Planner, Request
from trace_rl.predictor.base import KnowsPrompts, SuccessPredictor

SAMPLE_WAVE = 128
"""Most rollouts `TreeRolloutCollector.sample` keeps in flight at once. A rollout's next turn reuses
its KV cache only while the engine's prefix cache still holds it: an evaluation of 2,695 rollouts in
one wave overflowed the `hf` engine's 1 GiB (about 128 tiny-model histories of 1k tokens), so every
turn re-prefilled its whole history, 4x slower per rollout than a training step."""


@dataclass
class RolloutConfig(AllocationSettings):
    """How one batch of trees is sampled and how its budget is spent (the budget's settings:
    `AllocationSettings`, the fields before these)."""

    method: MethodName = "trace"
    """The method (`trace_rl.planning.methods.METHODS`): grpo | prompt_only | knapsack | pcl | random_tree | dapo |
    brace | trace_stage1 | trace_stage2 | trace."""
    max_new_tokens: int = 64
    """Tokens per turn."""
    max_context_tokens: int = 2048
    """A rollout whose context would grow past this ends (reward 0) instead of overflowing the model."""
    temperature: float | None = None
    """Sampling temperature of the rollouts and of the sampled held-out evaluation (0: greedy). None: the
    model's profile (`trace_rl.models.profiles`: 0.7 for `smollm2-135m`, else 1)."""
    top_p: float = 1.0
    """Nucleus sampling: each token is drawn from the smallest set of tokens holding this much probability (1: all)."""
    env_workers: int = 4
    """Threads that run tool calls concurrently (in each worker)."""
    stage2_evidence: bool = False
    """TRACE's Stage 2 allocates with each prefix's success estimate updated on the batch's bare
    rollouts (the outcome of the one through the prefix, its prompt's successes), a Beta posterior
    with the predictor's estimate as prior whose strength is fitted on the run's past continuations
    (`trace_rl.planning.evidence`); false: the paper's value, the predictor's estimate alone. Either way a
    run logs how both score on its continuations (`stage2/brier_predictor`, `stage2/brier_evidence`)."""
    stage2_expected: bool = False
    """With `stage2_evidence`: Stage 2 values a prefix by the posterior expectation of the chance that its
    anchor turns mixed, under that Beta posterior and a correlation between one prefix's continuations
    fitted on the run's own groups of them (`trace_rl.core.mixing.expand_expected`), instead of plugging the
    posterior mean into the paper's value. Exact solver either way."""
    backend: Literal["local", "ray"] = "local"
    """Where rollouts are executed: `local` in this process, or `ray` on `workers` Ray actors (extra
    `ray`, `trace_rl.rollout`), each with its own engine and env. Planning stays here either way, and
    the same seed gives the same trees."""
    workers: int = 1
    """Ray actors that execute rollouts (`backend: ray`); each takes whole trees, so the branches of a
    tree hit one engine's prefix cache."""

    def __post_init__(self) -> None:
        get_method(self.method)  # raises with the known names
        super().__post_init__()
        if self.budget_unit == "tokens" and not get_method(self.method).allocates_tokens:
            able = ", ".join(name for name, spec in METHODS.items() if spec.allocates_tokens)
            raise FieldError("budget_unit", self.budget_unit, f"leaves for method {self.method!r}, whose allocator spends leaves (tokens: {able})")
        check_range(self, "max_new_tokens", ge=1)
        check_range(self, "max_context_tokens", gt=self.max_new_tokens,
                    why="room for a prompt and a full turn of max_new_tokens; the prompts are measured once the tokenizer is loaded")
        check_range(self, "temperature", ge=0, nullable=True, why="0: greedy; null: the model's profile")
        check_range(self, "top_p", gt=0, le=1)
        check_range(self, "env_workers", ge=1)
        if self.stage2_expected and not self.stage2_evidence:
            raise FieldError("stage2_expected", self.stage2_expected, "false unless rollout.stage2_evidence is true (it takes the expectation under that posterior)")
        if self.stage2_expected and (self.budget_unit != "leaves" or self.stage2_objective != "anchor"):
            raise FieldError("stage2_expected", self.stage2_expected, "false with budget_unit tokens or stage2_objective prompt (it values anchors, in leaves)")
        if self.stage2_evidence and self.spec.stage2 is not expand_stage2:
            reads = ", ".join(name for name, spec in METHODS.items() if spec.stage2 is expand_stage2)
            raise FieldError("stage2_evidence", self.stage2_evidence, f"false for method {self.method!r}, whose Stage 2 reads no values ({reads} do)")
        if self.method == "brace" and self.budget_unit == "leaves" and self.stage1_budget < self.brace.group_size:
            raise FieldError("budget", self.budget, f">= rollout.brace.group_size={self.brace.group_size} (brace buys whole groups)")
        check_choice(self, "backend", ("local", "ray"))
        check_range(self, "workers", ge=1)
        if self.backend == "local" and self.workers != 1:
            raise FieldError("workers", self.workers, "1 when rollout.backend is local (workers are Ray actors: set rollout.backend=ray)")
        if self.backend == "ray" and importlib.util.find_spec("ray") is None:
            raise FieldError("backend", self.backend, "local unless the ray package is installed (pip install 'trace-rl[ray]')")

    @property
    def sampling_temperature(self) -> float:
        """`temperature`, or 1 where it is still None (a config built in code, not through `RunConfig`,
        which fills it from the model's profile)."""
        return 1.0 if self.temperature is None else self.temperature

    @property
    def spec(self) -> MethodSpec:
        return get_method(self.method)

    @property
    def stage1_budget(self) -> int:
        return self.spec.stage1_budget(self.allocation())

    @property
    def stage2_budget(self) -> int:
        return self.budget - self.stage1_budget


def encode_prompt(tokenizer: Any, env: Env, task: Task) -> list[int]:
    """Token ids of the task's prompt: the env's chat messages through the tokenizer's chat template,
    then what the env opens the model's turn with (`ToolEnv.prompt_suffix`; optional in the protocol)."""
    rendered = tokenizer.apply_chat_template(env.messages(task), add_generation_prompt=True, tokenize=False)
    rendered += getattr(env, "prompt_suffix", "")
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
class Batch:
    """What one `collect` / `sample` call keeps while it runs: trees, their tasks, the env state at
    every unfinished node (keyed by tree index and node id), token counts and timings. An `Executor`
    grows its trees and adds the states of the nodes it makes."""

    trees: list[RolloutTree]
    tasks: list[Task]
    states: dict[tuple[int, int], EnvSnapshot] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=lambda: {"generated": 0, "observation": 0, "prefill": 0})
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def context(self, tree: int, node: int) -> list[int]:
        """Every token on the path to `node`: the prompt the policy continues from there."""
        t = self.trees[tree]
        return [token for i in t.path(node) for token in t.nodes[i].token_ids]


@dataclass
class _Rollout:
    """One rollout in flight: its tree, the node it ends at so far, its tokens and its env."""

    tree: int
    node: int
    context: list[int]
    env: Env
    fresh: bool = True
    """No turn appended yet: the next turn starts a new rollout at `node`."""


class Executor(Protocol):
    """Executes requests: `run` samples every requested rollout to its end, growing `batch.trees`,
    adding the env state of every unfinished node it makes to `batch.states`, and its token counts and
    timings to `batch.tokens` / `batch.timings`. The seeds of its engine calls derive from `seed` alone
    (`call_seed`), so one seed gives the same trees however the batch is split among workers."""

    def run(self, batch: Batch, requests: list[Request], *, seed: int, temperature: float | None = None) -> None: ...


START, ROUND = 0, 1
"""`call_seed` phases: the first turns of the rollouts of one count (index: the count), or one later
turn round of every rollout still in flight (index: the round, from 1)."""


def call_seed(seed: int, phase: int, index: int) -> int:
    """The seed of one engine call of an execution: a function of (execution seed, phase, index) only.
    Every rollout takes its first turn in its count's START call and turn t + 1 in ROUND t, whichever
    trees share the call, so a worker holding some of the trees makes the same calls for them."""
    return int(np.random.SeedSequence([seed, phase, index]).generate_state(1)[0] % (2**31 - 1))


class TreeRolloutCollector:
    """Samples trees for a batch of tasks with a policy engine, an env, a predictor and the method's plan.

    `tokenizer` is the policy's Hugging Face tokenizer: prompts are rendered with its chat template
    and observations are tokenized with it, so the engine works on token ids end to end. `env` is
    any `Env`; each rollout runs in its own `env.spawn()`. `executor` executes the plans (default: a
    `RolloutRunner` on `engine` and `env` here; `rollout.backend: ray` needs one from
    `trace_rl.rollout`, which `trace_rl.run.build_parts` passes).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        env: Env,
        predictor: SuccessPredictor,
        config: RolloutConfig,
        *,
        seed: int = 0,
        executor: Executor | None = None,
    ) -> None:
        if executor is None and config.backend != "local":
            raise ValueError(f"rollout.backend={config.backend!r} needs its executor (trace_rl.rollout.ray_workers.RayExecutor), as trace_rl.run.build_parts passes")
        self.engine = engine
        self.tokenizer = tokenizer
        self.env = env
        self.predictor = predictor
        self.config = config
        self.method = config.spec
        self.rng = np.random.default_rng(seed)
        self.executor = executor if executor is not None else RolloutRunner(engine, tokenizer, env, config)
        self.planner = Planner(
            self.method,
            config.allocation(),
            # under a token budget, before any rollout is seen a rollout costs its most: max_turns full turns
            costs=TokenCosts(initial=float(config.max_new_tokens * env.max_turns)) if config.budget_unit == "tokens" else None,
            # Stage 2's evidence model: fitted and scored every batch, allocated with under `stage2_evidence`
            evidence=Stage2Evidence() if self.method.stage2 is expand_stage2 else None,
            stage2_value="expected" if config.stage2_expected else "evidence" if config.stage2_evidence else "paper",
        )

    @property
    def costs(self) -> TokenCosts | None:
        """The planner's token costs (under a token budget)."""
        return self.planner.costs

    @property
    def evidence(self) -> Stage2Evidence | None:
        """The planner's Stage-2 evidence model (methods whose Stage 2 reads values)."""
        return self.planner.evidence

    @evidence.setter
    def evidence(self, model: Stage2Evidence | None) -> None:
        self.planner.evidence = model

    def state_dict(self) -> dict[str, Any]:
        """The sampling RNG (and the token costs and Stage-2 evidence learnt so far), so a resumed run
        draws what the unbroken one would have."""
        return {"rng": self.rng.bit_generator.state, **self.planner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.planner.load_state_dict(state)

    def checkpoint_state(self) -> dict[str, Any]:
        """What every checkpoint of the rollout side holds, under the keys they all use: the predictor's
        state (`predictor`) and this collector's (`collector`). The trainer, the TRL callback and the
        verl manager each add their own entries beside these."""
        return {"predictor": self.predictor.state_dict(), "collector": self.state_dict()}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        """The predictor and the collector as `checkpoint_state` saved them."""
        self.predictor.load_state_dict(state["predictor"])
        self.load_state_dict(state["collector"])

    # ------------------------------------------------------------------ the two stages

    def collect(self, tasks: Sequence[Task], *, per_tree: bool = False) -> RolloutBatch:
        """One batch of trees holding exactly `budget` leaves; with `per_tree`, every tree holds exactly
        `budget` leaves, planned alone (`trace_rl.planning.planner`: a fixed group size, as TRL's `num_generations`).
        Under a token budget a batch (or tree) spends `budget` expected tokens instead, and holds the
        leaves they buy."""
        if not tasks:
            raise ValueError("collect() needs at least one task")
        cfg = self.config
        batch = self._new_batch(tasks)
        budgets = len(tasks) if per_tree else 1  # one budget per tree, or one for the batch
        roots = [History(task.question, (), task.task_id) for task in tasks]
        evidence = self.predictor.evidence(roots) if isinstance(self.predictor, KnowsPrompts) else None
        can_expand = lambda tree, node: self._has_room(batch, tree, node)
        for requests in self.planner.plan(batch.trees, self._values, self.rng, prompt_evidence=evidence, per_tree=per_tree, can_expand=can_expand):
            self._run(batch, requests)

        leaves = sum(int(tree.leaves().size) for tree in batch.trees)
        evidence_stats = self.planner.observe(batch.trees)
        if self.costs is None and leaves != cfg.budget * budgets:  # a broken invariant is our bug, never a silent miscount
            raise AssertionError(f"collected {leaves} leaves for a budget of {cfg.budget * budgets}")
        stats = {
            "rollout/budget": float(cfg.budget * budgets),
            "rollout/leaves": float(leaves),
            "rollout/stage1_budget": float(cfg.stage1_budget * budgets),
            "rollout/stage2_budget": float(cfg.stage2_budget * budgets),
            "rollout/tokens_generated": float(batch.tokens["generated"]),
            "rollout/tokens_observation": float(batch.tokens["observation"]),
            "rollout/tokens_prefill": float(batch.tokens["prefill"]),
            "rollout/tokens_prompt": float(sum(len(t.root.token_ids) for t in batch.trees if t.root.budget)),
            **evidence_stats,
            **batch.timings,
            **self.planner.stats,
        }
        return RolloutBatch(trees=batch.trees, stats=stats)

    def _values(self, trees: Sequence[RolloutTree], queries: Sequence[tuple[int, int]]) -> np.ndarray:
        """The predictor's estimates of (tree, node) queries: what the planner allocates from."""
        if not queries:
            return np.zeros(0)
        return self.predictor.predict([trees[tree].history(node) for tree, node in queries])

    def sample(
        self, tasks: Sequence[Task], n: int, *, temperature: float | None = None, progress: Callable[[int, int], None] | None = None
    ) -> list[RolloutTree]:
        """`n` independent rollouts per task, no allocation and no Stage 2: evaluation and baselines.

        `temperature` overrides the config's (0 = greedy, which makes the n rollouts identical).
        `progress(done, total)` is called with the rollouts finished after each wave.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        trees = []
        per_wave = max(1, SAMPLE_WAVE // n)
        for start in range(0, len(tasks), per_wave):
            batch = self._new_batch(tasks[start : start + per_wave])
            for tree in batch.trees:
                tree.root.budget = n
            self._run(batch, [Request(index, 0, n) for index in range(len(batch.trees))], temperature=temperature)
            trees += batch.trees
            if progress is not None:
                progress(len(trees) * n, len(tasks) * n)
        return trees

    def _new_batch(self, tasks: Sequence[Task]) -> Batch:
        """One tree per task (its prompt as the root) and the env state at each root."""
        batch = Batch(trees=[], tasks=list(tasks))
        for index, task in enumerate(tasks):
            env = self.env.spawn()
            env.reset(task)
            batch.states[(index, 0)] = env.snapshot()
            prompt_ids = encode_prompt(self.tokenizer, self.env, task)
            batch.trees.append(RolloutTree.new(task.task_id, task.question, prompt_ids, meta={"source": task.source}))
        return batch

    def _has_room(self, batch: Batch, tree: int, node: int) -> bool:
        """Whether a prefix leaves room in the context for one more turn (and its env state is known)."""
        room = self.config.max_context_tokens - len(batch.context(tree, node))
        return room >= self.config.max_new_tokens and (tree, node) in batch.states

    def _run(self, batch: Batch, requests: list[Request], *, temperature: float | None = None) -> None:
        """Execute `requests` with one seed drawn here (so the draws do not depend on the executor)."""
        self.executor.run(batch, requests, seed=int(self.rng.integers(2**31 - 1)), temperature=temperature)


class RolloutRunner:
    """The execution loop: samples requested rollouts to their end with an engine and an env, one turn
    per round for all of them. The local `Executor`, and what each Ray worker runs on its trees."""

    def __init__(self, engine: Engine, tokenizer: Any, env: Env, config: RolloutConfig) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.env = env
        self.config = config
        self._stop = env.stop_strings()

    def run(self, batch: Batch, requests: list[Request], *, seed: int, temperature: float | None = None) -> None:
        """Sample every requested rollout to its end (see `Executor`)."""
        cfg = self.config
        pending: list[tuple[_Rollout, Completion]] = []
        by_count: dict[int, list[Request]] = defaultdict(list)
        for request in requests:
            by_count[request.count].append(request)
        for count, group in sorted(by_count.items()):
            contexts = [batch.context(r.tree, r.node) for r in group]
            completions = self._generate(batch, contexts, [r.tree for r in group], count, call_seed(seed, START, count), temperature)
            for request, context, outs in zip(group, contexts, completions):
                for out in outs:
                    env = self.env.spawn()
                    env.restore(batch.states[(request.tree, request.node)])
                    pending.append((_Rollout(request.tree, request.node, list(context), env), out))
        with ThreadPoolExecutor(max_workers=cfg.env_workers) as pool:
            turn_round = 0
            while pending:
                begin = time.perf_counter()
                results = list(pool.map(lambda item: item[0].env.step(item[1].text), pending))
                batch.timings["timing_s/env"] += time.perf_counter() - begin
                active = [r for (r, out), res in zip(pending, results) if not self._record(batch, r, out, res)]
                if not active:
                    break
                turn_round += 1
                outs = self._generate(batch, [r.context for r in active], [r.tree for r in active], 1, call_seed(seed, ROUND, turn_round), temperature)
                pending = [(r, o[0]) for r, o in zip(active, outs)]

    def _generate(
        self, batch: Batch, contexts: list[list[int]], trees: list[int], n: int, seed: int, temperature: float | None = None
    ) -> list[list[Completion]]:
        cfg = self.config
        params = SamplingParams(
            n=n,
            temperature=cfg.sampling_temperature if temperature is None else temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            stop=self._stop,
            seed=seed,
        )
        begin = time.perf_counter()
        if getattr(self.engine, "routes_by_key", False):  # a tree's calls go to one server (its prefix cache)
            outs = self.engine.generate(contexts, params, route_keys=[batch.trees[t].task_id for t in trees])
        else:
            outs = self.engine.generate(contexts, params)
        batch.timings["timing_s/gen"] += time.perf_counter() - begin
        batch.tokens["prefill"] += sum(len(c) - group[0].cached_tokens for c, group in zip(contexts, outs))
        batch.tokens["generated"] += sum(len(o.token_ids) for group in outs for o in group)
        return outs

    def _record(self, batch: Batch, rollout: _Rollout, out: Completion, result: StepResult) -> bool:
        """Append the turn to the tree; returns True when the rollout has ended."""
        cfg = self.config
        obs_ids = encode_observation(self.tokenizer, result.observation)
        context = rollout.context + list(out.token_ids) + obs_ids
        overflow = not result.done and len(context) + cfg.max_new_tokens > cfg.max_context_tokens
        done = result.done or overflow
        info = {**result.info.to_dict(), "finish_reason": out.finish_reason, "truncated": result.truncated or overflow}
        if overflow:
            info["truncated_by"] = "context"
        node = batch.trees[rollout.tree].add_turn(
            rollout.node,
            thought=result.info.thought,
            action=result.info.action,
            observation=result.info.observation,
            token_ids=list(out.token_ids) + obs_ids,
            mask=[1] * len(out.token_ids) + [0] * len(obs_ids),
            logprobs=list(out.logprobs) + [0.0] * len(obs_ids),
            reward=(result.reward if result.done else 0.0) if done else None,
            info=info,
            starts_rollout=rollout.fresh,
        )
        batch.tokens["observation"] += len(obs_ids)
        rollout.node, rollout.context, rollout.fresh = node, context, False
        if not done:
            batch.states[(rollout.tree, node)] = rollout.env.snapshot()
        return done
