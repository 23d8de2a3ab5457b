"""The collector against real tasks, env, tools and tokenizer, with a scripted engine for speed."""


import numpy as np
import pytest
from scripted_engine import FixedValues, KeyedScriptedEngine, ScriptedEngine, make_world

from trace_rl.core.tree import read_jsonl, write_jsonl
from trace_rl.planning.methods import METHODS, get_method
from trace_rl.planning.planner import Estimates, Planner, prefix_candidates
from trace_rl.predictor import PredictorConfig, build_predictor
from trace_rl.predictor.hashed import HashedNgramPredictor
from trace_rl.rollout.collector import RolloutConfig, TreeRolloutCollector


@pytest.fixture(scope="module")
def world():
    return make_world()


@pytest.mark.parametrize("method", METHODS)
def test_every_method_spends_the_budget_exactly(world, method):
    taskset, env, tokenizer, turns = world
    for budget in (24, 37):
        config = RolloutConfig(method=method, budget=budget, max_new_tokens=32)
        predictor = build_predictor(get_method(method).predictor, PredictorConfig(), seed=0)
        collector = TreeRolloutCollector(ScriptedEngine(tokenizer, turns), tokenizer, env, predictor, config, seed=1)
        batch = collector.collect(taskset.tasks[:8])
        assert sum(t.leaves().size for t in batch.trees) == budget
        assert batch.stats["rollout/leaves"] == budget
        roots = sum(t.root.budget for t in batch.trees)
        prefixes = sum(n.budget for t in batch.trees for n in t.nodes[1:])
        assert roots + prefixes == budget


def test_trees_keep_tokens_masks_logprobs_observations_and_rewards(world, tmp_path):
    taskset, env, tokenizer, turns = world
    config = RolloutConfig(method="trace", budget=32, max_new_tokens=32)
    engine = ScriptedEngine(tokenizer, turns)
    batch = TreeRolloutCollector(engine, tokenizer, env, HashedNgramPredictor(), config, seed=0).collect(taskset.tasks[:8])
    for tree in batch.trees:
        assert tree.root.mask == [0] * len(tree.root.token_ids) and tree.root.token_ids
        for node in tree.nodes[1:]:
            policy = [t for t, m in zip(node.token_ids, node.mask) if m]
            text = tokenizer.decode(policy)
            assert text in turns  # the policy's tokens are exactly what the engine sampled
            observation = [t for t, m in zip(node.token_ids, node.mask) if not m]
            if node.is_terminal:
                assert observation == []
            else:
                assert node.observation and node.observation in tokenizer.decode(observation)
            assert all(lp == pytest.approx(-np.log(len(turns))) for lp, m in zip(node.logprobs, node.mask) if m)
            assert all(lp == 0.0 for lp, m in zip(node.logprobs, node.mask) if not m)
        for leaf in tree.leaves():
            assert tree.nodes[leaf].reward in (0.0, 1.0)
    path = tmp_path / "trees.jsonl"
    write_jsonl(batch.trees, path)
    assert [t.to_dict() for t in read_jsonl(path)] == [t.to_dict() for t in batch.trees]


def test_continuations_of_one_prefix_share_one_engine_call(world):
    taskset, env, tokenizer, turns = world
    config = RolloutConfig(method="grpo", budget=16, max_new_tokens=32)
    engine = ScriptedEngine(tokenizer, turns)
    TreeRolloutCollector(engine, tokenizer, env, HashedNgramPredictor(), config).collect(taskset.tasks[:4])
    assert engine.calls[0] == (4, 4)  # four prompts, each prefilled once for its four rollouts


def test_stage2_branches_continue_from_restored_prefixes(world):
    taskset, env, tokenizer, turns = world
    config = RolloutConfig(method="trace", budget=40, stage1_share=0.4, max_new_tokens=32)
    batch = TreeRolloutCollector(ScriptedEngine(tokenizer, turns), tokenizer, env, HashedNgramPredictor(), config, seed=3).collect(taskset.tasks[:8])
    branched = [(t, n) for t in batch.trees for n in t.nodes[1:] if n.budget > 0]
    assert branched, "Stage 2 expanded no prefix"
    for tree, node in branched:
        assert len(node.children) == 1 + node.budget  # the bare rollout's own child plus k continuations
        # the env was restored: every continuation's turn number follows the prefix's depth
        for child in node.children:
            assert tree.nodes[child].info["turn"] == node.depth + 1


def test_same_seed_gives_the_same_trees(world):
    taskset, env, tokenizer, turns = world
    config = RolloutConfig(method="trace", budget=24, max_new_tokens=32)

    def run():
        collector = TreeRolloutCollector(ScriptedEngine(tokenizer, turns), tokenizer, env, HashedNgramPredictor(), config, seed=5)
        return [t.to_dict() for t in collector.collect(taskset.tasks[:6]).trees]

    first, second = run(), run()
    for a, b in zip(first, second):
        for node in (*a["nodes"], *b["nodes"]):
            node["info"].pop("tool_seconds", None)
    assert first == second


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="unknown method 'tarce'; did you mean 'trace'"):
        RolloutConfig(method="tarce")
    with pytest.raises(ValueError, match="min_per_prompt must be >= 2"):
        RolloutConfig(min_per_prompt=1)
    with pytest.raises(ValueError, match="stage1_share"):
        RolloutConfig(stage1_share=0.0)


def test_every_turn_records_where_its_rollout_started(world):
    taskset, env, tokenizer, turns = world
    config = RolloutConfig(method="trace", budget=40, stage1_share=0.4, max_new_tokens=32)
    batch = TreeRolloutCollector(ScriptedEngine(tokenizer, turns), tokenizer, env, HashedNgramPredictor(), config, seed=3).collect(taskset.tasks[:8])
    continuations = 0
    for tree in batch.trees:
        for node in tree.nodes[1:]:
            parent = tree.nodes[node.parent]
            if node.rollout_start == node.parent:  # began a rollout: a bare one at the root, or a continuation
                continuations += node.parent != 0
                assert node.parent == 0 or parent.budget > 0, "a continuation starts only at an expanded prefix"
            else:
                assert node.rollout_start == parent.rollout_start
        starts = [tree.nodes[leaf].rollout_start for leaf in tree.leaves()]
        assert starts.count(0) == tree.root.budget  # every bare rollout (the leftover included) began at the root
        assert sum(n.budget for n in tree.nodes[1:]) == len(starts) - starts.count(0)
    assert continuations == sum(n.budget for t in batch.trees for n in t.nodes[1:]) > 0


def _bare(tree):
    """A copy of `tree` with only its bare rollouts (those begun at the root) and no allocation marks."""
    from trace_rl.core.tree import RolloutTree

    data = tree.to_dict()
    keep = [n for n in data["nodes"] if n["id"] == 0 or n["rollout_start"] == 0]
    ids = {n["id"]: i for i, n in enumerate(keep)}
    for n in keep:
        n["id"], n["parent"] = ids[n["id"]], None if n["parent"] is None else ids[n["parent"]]
        n["children"] = [ids[c] for c in n["children"] if c in ids]
        n["rollout_start"] = ids[n["rollout_start"]] if n["id"] else 0
        n["predicted"], n["budget"] = None, 0
    return RolloutTree.from_dict({**data, "nodes": keep})


def test_the_collector_and_the_benchmark_plan_the_same_from_the_same_predictions(world):
    """One planner (`trace_rl.planning.planner.Planner`) for training and the benchmark: replaying the collector's
    planner and the benchmark's planner of the same method on the bare rollouts and the predictions the
    collector recorded both give the collector's allocation."""
    from trace_rl.research.bench import BenchConfig, planner_for

    taskset, env, tokenizer, turns = world
    for method in ("trace", "trace_stage2", "trace_stage1", "pcl"):  # the deterministic allocators
        config = RolloutConfig(method=method, budget=40, stage1_share=0.5, max_new_tokens=32)
        collector = TreeRolloutCollector(ScriptedEngine(tokenizer, turns), tokenizer, env, FixedValues(), config, seed=3)
        trees = collector.collect(taskset.tasks[:8]).trees
        bench = planner_for(method, BenchConfig(methods=[method], budget=40, stage1_share=0.5))
        assert isinstance(collector.planner, Planner) and type(bench) is type(collector.planner)
        assert bench.settings == collector.planner.settings
        originals = [[n.id for n in t.nodes if n.id == 0 or n.rollout_start == 0] for t in trees]  # bare node ids
        for planner in (collector.planner, bench):
            replay = [_bare(t) for t in trees]
            planner.roots(replay, Estimates(np.array([t.root.predicted for t in trees])))
            candidates = prefix_candidates(replay, lambda i, n: trees[i].nodes[originals[i][n]].predicted is not None)
            values = np.array([trees[i].nodes[originals[i][n]].predicted for i, n in candidates])
            planner.prefixes(replay, candidates, Estimates(values), np.random.default_rng(0))
            for tree, bare, ids in zip(trees, replay, originals):
                assert [n.budget for n in bare.nodes] == [tree.nodes[i].budget for i in ids]
                assert sum(n.budget for n in tree.nodes) == tree.leaves().size  # nothing outside the plan


def test_per_tree_collection_gives_every_tree_its_own_budget_planned_on_its_own_prefixes(world):
    """`collect(per_tree=True)` (TRL's fixed `num_generations`): each tree holds exactly `budget` leaves,
    Stage 1 gives its root the Stage-1 budget, and its Stage 2 is what the planner gives that tree alone."""
    taskset, env, tokenizer, turns = world
    config = RolloutConfig(method="trace", budget=6, stage1_share=0.5, max_new_tokens=32)
    batch = TreeRolloutCollector(ScriptedEngine(tokenizer, turns), tokenizer, env, FixedValues(), config, seed=3).collect(taskset.tasks[:8], per_tree=True)
    assert [t.leaves().size for t in batch.trees] == [6] * 8
    assert batch.stats["rollout/budget"] == batch.stats["rollout/leaves"] == 48
    assert sum(n.budget for t in batch.trees for n in t.nodes[1:]) > 0, "Stage 2 expanded no prefix"
    planner = Planner(get_method("trace"), config.allocation())
    for tree in batch.trees:
        bare = _bare(tree)
        planner.roots([bare], Estimates(np.array([tree.root.predicted])))
        assert bare.root.budget == 3
        ids = [n.id for n in tree.nodes if n.id == 0 or n.rollout_start == 0]
        candidates = prefix_candidates([bare], lambda i, n: tree.nodes[ids[n]].predicted is not None)
        values = np.array([tree.nodes[ids[n]].predicted for _, n in candidates])
        planner.prefixes([bare], candidates, Estimates(values), np.random.default_rng(0))
        assert [n.budget for n in bare.nodes] == [tree.nodes[i].budget for i in ids]
        assert sum(n.budget for n in tree.nodes) == 6


def test_stage2_objective_prompt_spends_stage_2_where_a_prompt_can_still_turn_mixed(world):
    """`rollout.stage2_objective: prompt`: the collector's Stage 2 is `expand_for_prompts` on each
    prefix's prompt and on whether that prompt's bare rollouts already mixed."""
    from trace_rl.core.solvers import expand_for_prompts

    taskset, env, tokenizer, turns = world
    config = RolloutConfig(method="trace", budget=40, stage1_share=0.5, max_new_tokens=32, stage2_objective="prompt")
    trees = TreeRolloutCollector(ScriptedEngine(tokenizer, turns), tokenizer, env, FixedValues(), config, seed=3).collect(taskset.tasks[:8]).trees
    replay = [_bare(t) for t in trees]
    originals = [[n.id for n in t.nodes if n.id == 0 or n.rollout_start == 0] for t in trees]
    candidates = prefix_candidates(replay, lambda i, n: trees[i].nodes[originals[i][n]].predicted is not None)
    values = np.array([trees[i].nodes[originals[i][n]].predicted for i, n in candidates])
    outcomes = np.array([replay[i].backup().values[n] > 0.5 for i, n in candidates], dtype=np.float64)
    bare_success = [t.leaf_rewards() > 0.5 for t in replay]
    mixed = np.array([bare_success[i].any() and not bare_success[i].all() for i, _ in candidates])
    expected = expand_for_prompts(values, outcomes, [i for i, _ in candidates], mixed, config.stage2_budget)
    assert [trees[i].nodes[originals[i][n]].budget for i, n in candidates] == expected.tolist()
    assert not mixed.all(), "every prompt mixed: the test would not tell the objectives apart"


def untimed(trees) -> list[dict]:
    """The trees as data, without the tool calls' wall times."""
    out = [t.to_dict() for t in trees]
    for tree in out:
        for node in tree["nodes"]:
            (node.get("info") or {}).pop("tool_seconds", None)
    return out


class SplitRunner:
    """An `Executor` that splits each execution among `workers` runners as the Ray backend does
    (`trace_rl.rollout.split`), in this process: no Ray needed to pin down its seeding."""

    def __init__(self, runners):
        self.runners = runners

    def run(self, batch, requests, *, seed, temperature=None):
        from collections import defaultdict

        from trace_rl.rollout.split import merge, part_of, partition

        slowest = defaultdict(float)
        for runner, trees in zip(self.runners, partition(batch, requests, len(self.runners))):
            if trees:
                part, mine = part_of(batch, requests, trees)
                given = set(part.states)
                runner.run(part, mine, seed=seed, temperature=temperature)
                part.states = {key: state for key, state in part.states.items() if key not in given}
                merge(batch, trees, part, slowest)
        for key, seconds in slowest.items():
            batch.timings[key] += seconds


def test_a_batch_split_among_workers_grows_the_trees_a_whole_one_does(world):
    """Engine-call seeds derive from the execution's seed and the call's phase, never from which trees
    share a call (`rollout.call_seed`): with an engine keyed as the `hf` engine is, three workers given
    parts of the batch grow exactly the trees one runner grows, and the collector's RNG ends equal."""
    from trace_rl.rollout.collector import RolloutRunner

    taskset, env, tokenizer, turns = world
    config = RolloutConfig(method="trace", budget=40, stage1_share=0.5, max_new_tokens=32)
    whole = TreeRolloutCollector(KeyedScriptedEngine(tokenizer, turns), tokenizer, env, FixedValues(), config, seed=3)
    runners = [RolloutRunner(KeyedScriptedEngine(tokenizer, turns), tokenizer, env, config) for _ in range(3)]
    split = TreeRolloutCollector(KeyedScriptedEngine(tokenizer, turns), tokenizer, env, FixedValues(), config, seed=3, executor=SplitRunner(runners))
    for _ in range(2):  # two batches: the RNG stays in step too
        a, b = whole.collect(taskset.tasks[:8]), split.collect(taskset.tasks[:8])
        assert untimed(a.trees) == untimed(b.trees)
        assert a.stats["rollout/tokens_generated"] == b.stats["rollout/tokens_generated"]
    assert sum(len(r.engine.calls) > 0 for r in runners) >= 2, "the batch was not split"
    assert whole.rng.bit_generator.state == split.rng.bit_generator.state


def test_with_the_prefix_cache_a_batch_prefills_little_more_than_its_prompts_and_observations(world, tmp_path):
    """Real tiny policy and HF engine: each turn prefills only its new observation (and the token
    before it), a continuation only what its prefix did not hold; the trees are those of a run
    without the cache."""
    from trace_rl.engine.hf import HFEngine
    from trace_rl.models import TinyConfig, load_policy

    taskset, env, _, _ = world
    texts = [p.text for p in taskset.corpus[:50]]
    policy = load_policy("tiny", seed=0, tokenizer_texts=texts, tiny=TinyConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, vocab_size=600), cache_dir=tmp_path)
    config = RolloutConfig(method="trace", budget=24, max_new_tokens=24)

    def collect(cache_mb):
        engine = HFEngine.from_policy(policy, prefix_cache_mb=cache_mb)
        return TreeRolloutCollector(engine, policy.tokenizer, env, HashedNgramPredictor(), config, seed=2).collect(taskset.tasks[:6])

    cached, plain = collect(1024), collect(0)
    assert [[n.token_ids for n in t.nodes] for t in cached.trees] == [[n.token_ids for n in t.nodes] for t in plain.trees]
    prompts = sum(len(t.root.token_ids) for t in cached.trees)
    needed = prompts + cached.stats["rollout/tokens_observation"]
    assert plain.stats["rollout/tokens_prefill"] > 2 * needed  # without the cache every turn re-prefills its history
    assert cached.stats["rollout/tokens_prefill"] <= 1.5 * needed


def test_sample_keeps_at_most_a_wave_of_rollouts_in_flight_and_returns_one_tree_per_task(world, monkeypatch):
    import trace_rl.rollout.collector as rollout

    taskset, env, tokenizer, turns = world
    monkeypatch.setattr(rollout, "SAMPLE_WAVE", 6)
    engine = ScriptedEngine(tokenizer, turns)
    collector = TreeRolloutCollector(engine, tokenizer, env, HashedNgramPredictor(), RolloutConfig(max_new_tokens=32))
    trees = collector.sample(taskset.tasks[:7], 3)
    assert [t.task_id for t in trees] == [t.task_id for t in taskset.tasks[:7]]
    assert all(t.leaves().size == 3 and t.root.budget == 3 for t in trees)
    assert max(prompts * n for prompts, n in engine.calls) <= 6  # two tasks x 3 samples per wave


class RoutedEngine(KeyedScriptedEngine):
    """Records the route key the collector gives each prompt, and what the prompt was."""

    routes_by_key = True

    def __init__(self, tokenizer, turns) -> None:
        super().__init__(tokenizer, turns)
        self.routed: list[tuple[str, tuple[int, ...]]] = []

    def generate(self, prompts, params, *, route_keys=None):
        assert route_keys is not None and len(route_keys) == len(prompts)
        self.routed += [(key, tuple(prompt)) for key, prompt in zip(route_keys, prompts)]
        return super().generate(prompts, params)


def test_an_engine_that_routes_gets_each_rollouts_tree_as_its_route_key(world):
    """Every call of a tree (its first turns, later turns and Stage-2 branches) carries the tree's
    task id, so an engine in front of several servers keeps the tree on one; the trees are the ones
    an engine without routing grows."""
    taskset, env, tokenizer, turns = world
    engine = RoutedEngine(tokenizer, turns)
    config = RolloutConfig(method="trace", budget=24, max_new_tokens=32)
    routed = TreeRolloutCollector(engine, tokenizer, env, FixedValues(), config, seed=3).collect(taskset.tasks[:6]).trees
    plain = TreeRolloutCollector(KeyedScriptedEngine(tokenizer, turns), tokenizer, env, FixedValues(), config, seed=3).collect(taskset.tasks[:6]).trees
    def grown(trees):  # tool timings aside
        dicts = [t.to_dict() for t in trees]
        for node in (n for d in dicts for n in d["nodes"]):
            node["info"].pop("tool_seconds", None)
        return dicts

    assert grown(routed) == grown(plain)
    roots = {tuple(t.root.token_ids): t.task_id for t in routed}
    assert len(engine.routed) > len(routed)  # later turns and branches too
    for key, prompt in engine.routed:
        assert [task for root, task in roots.items() if prompt[: len(root)] == root] == [key]
