"""Ray rollout workers: the collector plans here, N actors execute.

`RayExecutor` is the collector's `Executor` for `rollout.backend: ray`. Stage 1 and Stage 2 stay in
the main process, exact over the whole batch; each `run` (one stage's requests) goes to the actors:

- **Whole trees per worker.** `split.partition` gives each worker whole trees (all requests of a tree, so
  its branches hit one engine's prefix cache), balanced by requested rollouts; trees with the same
  prompt go together, since the engine keys samples on a prompt's occurrences within one call.
- **One execution loop.** Each actor (`RolloutWorker`) holds its own engine, tokenizer and env, built
  inside it by a picklable `WorkerBuild` (`trace_rl.run.build_worker`: from the run's config, as
  `build_parts` builds them), and runs the local `RolloutRunner` on the trees it is sent, with their
  env states, the requests and the execution's seed. It sends back the grown trees, the env states
  of the nodes it made (Stage 2 restores them), and its token counts and timings; they are merged
  into the batch in tree order. Token counts add up; `timing_s/gen` and `timing_s/env` are the
  slowest worker's (the workers run at once), not the sum.
- **The same trees.** Engine seeds derive from the execution's seed and the call's place in the loop
  (`trace_rl.rollout.collector.call_seed`), and the `hf` engine keys each sample on (seed, prompt, occurrence,
  position), so the actors draw what the local collector draws, up to float rounding: a prefix
  served from a different cache can move logits by ~1e-6. `rollout/tokens_prefill` differs, since each
  worker's cache holds only its own trees' prefixes.
- **Current weights, only what trains.** Before a run, when the main engine's `weight_version` has
  moved since the last push (and at the first run, so weights loaded without a version bump also reach
  the actors), the main model's trainable parameters go into the object store once (`ray.put`) and
  every actor loads them over its own copy and calls its engine's `update_weights` (which empties its
  prefix cache). The actors build their model from the same folder as the main process, and what does
  not train (the frozen base under LoRA, buffers) never changes, so it is never sent: under LoRA a push
  is the adapters. Each push's size and time are logged (`rollout/weight_push_bytes`,
  `timing_s/weight_push`).

Ray starts on first use unless it is already running (`ray.init` honours `RAY_ADDRESS`, so a
cluster is joined the same way); it is never started twice. The Ray it starts ships this trace_rl
package to the actors (`runtime_env` `py_modules`), so a node without the code, or with another
version of it, runs the main process's; the policy folder and task files are read by path, so other
nodes need them at the same paths (shared storage). A Ray the caller started keeps its own runtime_env. A Ray this starts does not forward the
actors' output (`log_to_driver=False`: a command's stdout ends with its JSON line); an actor's error
reaches the caller through `ray.get`. Actors are spread over the nodes (`SPREAD`) and end when the
executor is garbage-collected.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from trace_rl.engine.base import Engine
from trace_rl.planning.planner import Request
from trace_rl.rollout.collector import Batch, RolloutRunner
from trace_rl.rollout.split import merge, part_of, partition

WorkerBuild = Callable[[], tuple[RolloutRunner, Any]]
"""Called inside each actor: its `RolloutRunner` (own engine, tokenizer, env, rollout config) and the
model its engine samples from, which loads the pushed weights (None: the engine holds no weights, e.g.
a server). Must pickle (a `functools.partial` of a module-level function)."""


class RolloutWorker:
    """One Ray actor: its own engine, tokenizer and env, executing the trees it is sent."""

    def __init__(self, build: WorkerBuild) -> None:
        self.runner, self.model = build()

    def load_weights(self, state: dict[str, Any], version: int) -> None:
        """Sample from `state` (the trainable parameters) from now on (`Engine.update_weights` semantics:
        version, empty cache). A name this model does not have, or a trainable parameter left out, is an
        error: the two sides would sample from different policies."""
        result = self.model.load_state_dict(state, strict=False)
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        if result.unexpected_keys or trainable - set(state):
            raise RuntimeError(f"pushed weights do not fit the actor's model: unexpected {result.unexpected_keys[:3]}, "
                               f"trainable but not sent {sorted(trainable - set(state))[:3]}")
        self.runner.engine.update_weights(self.model, version=version)

    def release_memory(self) -> int:
        """The actor's engine's `release_memory` (its prefix cache and weight copy), if it has one; bytes freed."""
        release = getattr(self.runner.engine, "release_memory", None)
        return int(release()) if release is not None else 0

    def run(self, part: Batch, requests: list[Request], seed: int, temperature: float | None) -> Batch:
        """`part` grown by `requests`; its `states` hold only the states of the nodes made here."""
        given = set(part.states)
        self.runner.run(part, requests, seed=seed, temperature=temperature)
        part.states = {key: state for key, state in part.states.items() if key not in given}
        return part


class RayExecutor:
    """Executes a collector's requests on `workers` Ray actors (see the module docstring).

    `engine` is the main process's engine, the one the trainer updates: its `weight_version` says when
    to push `model`'s weights (None: never, for engines without weights here). `num_gpus` is each
    actor's share of a GPU (0 on CPU).
    """

    def __init__(self, build: WorkerBuild, workers: int, *, engine: Engine, model: Any | None, num_gpus: float = 0.0) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False, runtime_env=runtime_env())
        actor = ray.remote(RolloutWorker).options(num_gpus=num_gpus, scheduling_strategy="SPREAD")
        self.workers = [actor.remote(build) for _ in range(workers)]
        self.engine = engine
        self.model = model
        self._pushed: int | None = None
        self.pushed_bytes = 0
        """Bytes the last push put in the object store (0 before the first)."""

    def run(self, batch: Batch, requests: list[Request], *, seed: int, temperature: float | None = None) -> None:
        begin = time.perf_counter()
        if self._push_weights():
            batch.timings["timing_s/weight_push"] += time.perf_counter() - begin
            batch.timings["rollout/weight_push_bytes"] += float(self.pushed_bytes)  # the batch's figures, beside its timings
        calls = []
        for worker, trees in zip(self.workers, partition(batch, requests, len(self.workers))):
            if trees:
                part, mine = part_of(batch, requests, trees)
                calls.append((trees, worker.run.remote(part, mine, seed, temperature)))
        slowest: dict[str, float] = defaultdict(float)
        for (trees, _), part in zip(calls, ray.get([ref for _, ref in calls])):
            merge(batch, trees, part, slowest)
        for key, seconds in slowest.items():
            batch.timings[key] += seconds

    def release_memory(self) -> int:
        """Every actor's engine forgets its prefix cache (as the trainer's own does after an evaluation,
        so a resumed run's fresh actors and an unbroken run's start the next step alike); bytes freed."""
        return sum(ray.get([worker.release_memory.remote() for worker in self.workers]))

    def _push_weights(self) -> bool:
        """Every actor loads the main model's trainable weights when their version has moved (or before
        the first run); whether it pushed."""
        if self.model is None or self.engine.weight_version == self._pushed:
            return False
        weights = trainable_state(self.model)
        self.pushed_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        state = ray.put(weights)
        ray.get([worker.load_weights.remote(state, self.engine.weight_version) for worker in self.workers])
        self._pushed = self.engine.weight_version
        return True


def runtime_env() -> dict[str, Any]:
    """The Ray runtime_env of the actors this module starts: this trace_rl package as a `py_module`."""
    return {"py_modules": [str(Path(__file__).resolve().parents[1])]}


def trainable_state(model: Any) -> dict[str, Any]:
    """The model's parameters that train (`requires_grad`), by their state-dict names, detached on the CPU."""
    return {name: p.detach().cpu() for name, p in model.named_parameters() if p.requires_grad}
