"""Ray rollout workers (`trace_rl.rollout`, extra `ray`, `make test-ray`): the collector plans here,
actors execute, and the trees are the local collector's, token for token; the actors sample the
weights the main process's engine was last given."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import scripted_engine
from scripted_engine import FixedValues, KeyedScriptedEngine, ScriptedEngine, make_world

from trace_rl.core.tree import RolloutTree, read_jsonl
from trace_rl.engine.hf import HFEngine
from trace_rl.models import LoraSpec, TinyConfig, load_policy
from trace_rl.planning.planner import Request
from trace_rl.predictor.hashed import HashedNgramPredictor
from trace_rl.rollout.collector import (
    Batch,
    RolloutConfig,
    RolloutRunner,
    TreeRolloutCollector,
)
from trace_rl.rollout.ray_workers import RayExecutor
from trace_rl.rollout.split import partition

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]
TINY = TinyConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, vocab_size=600)


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    """One Ray for the module. The actors cannot import the tests folder, so this module's helpers
    (and the scripted engine) travel to them by value."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(scripted_engine)
    begin = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False)
    print(f"ray.init: {time.perf_counter() - begin:.1f} s")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def world():
    return make_world()


def scripted_worker(config: RolloutConfig) -> tuple[RolloutRunner, None]:
    _, env, tokenizer, turns = make_world()
    return RolloutRunner(KeyedScriptedEngine(tokenizer, turns), tokenizer, env, config), None


def tiny_worker(folder: str, config: RolloutConfig, lora: LoraSpec | None = None) -> tuple[RolloutRunner, object]:
    _, env, _, _ = make_world()
    policy = load_policy(folder, lora=lora)
    return RolloutRunner(HFEngine.from_policy(policy), policy.tokenizer, env, config), policy.model


def comparable(trees: list[RolloutTree]) -> list[dict]:
    """Tree dicts without log-probs (compared within 1e-5) and tool timings."""
    out = []
    for tree in trees:
        data = tree.to_dict()
        for node in data["nodes"]:
            node.pop("logprobs")
            node["info"].pop("tool_seconds", None)
        out.append(data)
    return out


def assert_same_trees(expected: list[RolloutTree], got: list[RolloutTree]) -> None:
    assert comparable(got) == comparable(expected)
    for a, b in zip(expected, got):
        for x, y in zip(a.nodes, b.nodes):
            assert y.logprobs == pytest.approx(x.logprobs, abs=1e-5)


def test_partition_keeps_trees_whole_same_prompts_together_and_balances_rollouts():
    trees = [RolloutTree.new(f"t{i}", "q", [1, 2, i % 4]) for i in range(6)]  # trees 0 and 4, 1 and 5 share a prompt
    batch = Batch(trees=trees, tasks=[])
    requests = [Request(0, 0, 4), Request(1, 0, 2), Request(2, 0, 3), Request(3, 0, 1), Request(4, 0, 1), Request(1, 2, 3)]
    parts = partition(batch, requests, 3)
    assert parts == [[0, 4], [1], [2, 3]]  # loads 5, 5, 4; tree 5 has no request
    assert partition(batch, requests, 1) == [[0, 1, 2, 3, 4]]
    assert partition(batch, requests[:1], 2) == [[0], []]


def test_ray_workers_grow_the_same_trees_as_the_local_collector(world):
    taskset, env, tokenizer, turns = world
    config = RolloutConfig(method="trace", budget=40, stage1_share=0.4, max_new_tokens=32)
    on_ray = RolloutConfig(method="trace", budget=40, stage1_share=0.4, max_new_tokens=32, backend="ray", workers=2)
    local = TreeRolloutCollector(KeyedScriptedEngine(tokenizer, turns), tokenizer, env, FixedValues(), config, seed=3)
    main_engine = KeyedScriptedEngine(tokenizer, turns)
    executor = RayExecutor(functools.partial(scripted_worker, on_ray), 2, engine=main_engine, model=None)
    remote = TreeRolloutCollector(main_engine, tokenizer, env, FixedValues(), on_ray, seed=3, executor=executor)

    expected, got = local.collect(taskset.tasks[:8]), remote.collect(taskset.tasks[:8])
    assert main_engine.calls == []  # every turn was sampled by the actors
    assert sum(n.budget for t in got.trees for n in t.nodes[1:]) > 0, "Stage 2 expanded no prefix"
    assert_same_trees(expected.trees, got.trees)
    counts = [k for k in expected.stats if not k.startswith("timing_s/")]
    assert {k: got.stats[k] for k in counts} == {k: expected.stats[k] for k in counts}
    assert got.stats["timing_s/gen"] > 0 and got.stats["timing_s/env"] > 0
    # evaluation goes through the same executor
    assert_same_trees(local.sample(taskset.tasks[:5], 3), remote.sample(taskset.tasks[:5], 3))
    # both draw the next batch from the same RNG state: resumption stays exact
    assert remote.state_dict() == local.state_dict()


def test_a_ray_backend_without_its_executor_is_refused(world):
    _, env, tokenizer, turns = world
    config = RolloutConfig(backend="ray", workers=2)
    with pytest.raises(ValueError, match="rollout.backend='ray' needs its executor"):
        TreeRolloutCollector(ScriptedEngine(tokenizer, turns), tokenizer, env, HashedNgramPredictor(), config)


def test_after_a_weight_update_the_actors_sample_the_new_weights(world, tmp_path):
    """A real tiny policy: the actors' trees match the local engine's before and after the main
    process's model changes and its engine gets the new version, and the change shows in the trees."""
    taskset, env, _, _ = world
    policy = load_policy("tiny", seed=0, tokenizer_texts=[p.text for p in taskset.corpus[:50]], tiny=TINY, cache_dir=tmp_path)
    config = RolloutConfig(method="trace", budget=24, max_new_tokens=24)
    on_ray = RolloutConfig(method="trace", budget=24, max_new_tokens=24, backend="ray", workers=2)
    engine = HFEngine.from_policy(policy)
    executor = RayExecutor(functools.partial(tiny_worker, str(policy.path), on_ray), 2, engine=engine, model=policy.model)

    def both():
        local = TreeRolloutCollector(engine, policy.tokenizer, env, FixedValues(), config, seed=2)
        remote = TreeRolloutCollector(engine, policy.tokenizer, env, FixedValues(), on_ray, seed=2, executor=executor)
        return local.collect(taskset.tasks[:6]).trees, remote.collect(taskset.tasks[:6]).trees

    before_local, before_ray = both()
    assert_same_trees(before_local, before_ray)
    assert executor.release_memory() > 0 and executor.release_memory() == 0  # the actors' caches, emptied
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for parameter in policy.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    engine.update_weights(policy.model, version=1)
    after_local, after_ray = both()
    assert_same_trees(after_local, after_ray)
    assert [[n.token_ids for n in t.nodes] for t in after_ray] != [[n.token_ids for n in t.nodes] for t in before_ray]


def test_under_lora_a_push_sends_only_the_adapters_and_the_actors_sample_them(world, tmp_path):
    """The frozen base never changes, so only the adapters travel (issue 44: the whole state dict went to
    every actor at every version); the actors' trees still match the local engine's after they move."""
    taskset, env, _, _ = world
    base = load_policy("tiny", seed=0, tokenizer_texts=[p.text for p in taskset.corpus[:50]], tiny=TINY, cache_dir=tmp_path)
    lora = LoraSpec(r=4)
    policy = load_policy(str(base.path), lora=lora)
    config = RolloutConfig(method="trace", budget=24, max_new_tokens=24)
    on_ray = RolloutConfig(method="trace", budget=24, max_new_tokens=24, backend="ray", workers=2)
    engine = HFEngine.from_policy(policy)
    executor = RayExecutor(functools.partial(tiny_worker, str(base.path), on_ray, lora), 2, engine=engine, model=policy.model)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for parameter in policy.model.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    engine.update_weights(policy.model, version=1)

    local = TreeRolloutCollector(engine, policy.tokenizer, env, FixedValues(), config, seed=2).collect(taskset.tasks[:6])
    remote = TreeRolloutCollector(engine, policy.tokenizer, env, FixedValues(), on_ray, seed=2, executor=executor).collect(taskset.tasks[:6])
    assert_same_trees(local.trees, remote.trees)

    adapters = sum(p.numel() * 4 for n, p in policy.model.named_parameters() if "lora_" in n)
    whole = sum(t.numel() * t.element_size() for t in policy.model.state_dict().values())
    assert executor.pushed_bytes == adapters and remote.stats["rollout/weight_push_bytes"] == adapters
    assert adapters < whole / 10, (adapters, whole)
    again = TreeRolloutCollector(engine, policy.tokenizer, env, FixedValues(), on_ray, seed=3, executor=executor).collect(taskset.tasks[:2])
    assert "rollout/weight_push_bytes" not in again.stats, "no push while the weights have not moved"


def test_the_rollout_command_writes_the_same_trees_on_ray_workers(tmp_path):
    env = {**os.environ, "TRACE_RL_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "trace_rl", "rollout", "--config", str(REPO / "configs" / "smoke.yaml")]
    outputs = {}
    for name, overrides in (("local", []), ("ray", ["rollout.backend=ray", "rollout.workers=2"])):
        begin = time.perf_counter()
        done = subprocess.run([*command, "--out", str(tmp_path / f"{name}.jsonl"), *overrides], check=False, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"trace-rl rollout, {name}: {time.perf_counter() - begin:.1f} s, timing_s/gen {figures['timing_s/gen']:.2f}, tokens_prefill {figures['rollout/tokens_prefill']:.0f}")
        assert figures["leaves"] == figures["budget"] == 16
        outputs[name] = figures
    local, remote = read_jsonl(tmp_path / "local.jsonl"), read_jsonl(tmp_path / "ray.jsonl")
    assert [t.task_id for t in remote] == [t.task_id for t in local]
    for a, b in zip(local, remote):
        assert [(n.parent, n.token_ids, n.mask, n.reward) for n in b.nodes] == [(n.parent, n.token_ids, n.mask, n.reward) for n in a.nodes]
        for x, y in zip(a.nodes, b.nodes):
            assert y.logprobs == pytest.approx(x.logprobs, abs=1e-5)
    for key in ("rollout/tokens_generated", "rollout/tokens_observation", "tree/effective_ratio"):
        assert outputs["ray"][key] == outputs["local"][key]


def test_the_runtime_env_ships_the_trace_rl_package_to_the_actors(tmp_path):
    """No runtime_env meant every node needed the code at the same path (issue 44): the actors of a Ray
    that RayExecutor starts import trace_rl from the copy Ray shipped, not from a path on their node."""
    script = (
        "import ray\n"
        "from trace_rl.rollout.ray_workers import runtime_env\n"
        "ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env())\n"
        "where = ray.remote(lambda: __import__('trace_rl').__file__)\n"
        "print(ray.get(where.remote()))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    shipped = done.stdout.strip().splitlines()[-1]
    assert "runtime_resources/py_modules_files" in shipped and shipped.endswith("trace_rl/__init__.py")
