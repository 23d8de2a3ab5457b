"""TRL's GRPOTrainer on TRACE trees, end to end (`make test-trl`: needs the `trl` extra, in .venv-trl).

Each test runs a real `GRPOTrainer.train()` of two steps on a tiny model and checks what TRL trained
with against trace-rl's own view of the same trees: the rows per prompt, each row's reward, and the
advantages and loss mask that reached TRL's loss.
"""

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl")

from scripted_engine import ScriptedEngine, coin_flip_answers

from trace_rl.agent.tasks import load_taskset
from trace_rl.core.advantage import get_estimator
from trace_rl.engine.hf import HFEngine
from trace_rl.infra.config import FieldError, load_config
from trace_rl.integrations.trl import (
    ADVANTAGES,
    REWARD,
    TraceGRPOTrainer,
    TraceRollout,
    grpo_config,
)
from trace_rl.models import TinyConfig, load_policy
from trace_rl.predictor.base import backup_targets
from trace_rl.rollout.collector import TreeRolloutCollector
from trace_rl.run import Parts, RunConfig, build_env, build_predictor
from trace_rl.training.sequences import loss_denominator, tree_sequences

pytestmark = pytest.mark.trl

REPO = Path(__file__).resolve().parents[1]
PROMPTS, GENERATIONS = 2, 4


@dataclass
class RecordingRollout(TraceRollout):
    """The adapter's rollout_func, keeping every call's trees and the engine's weight version then."""

    calls: list = field(default_factory=list, init=False)

    def __call__(self, prompts, trainer):
        rows = super().__call__(prompts, trainer)
        self.calls.append({"prompts": list(prompts), "trees": self.last.trees, "version": self.collector.engine.weight_version, "step": trainer.state.global_step})
        return rows


class RecordingTrainer(TraceGRPOTrainer):
    """Keeps what the reward functions saw and what each loss call trained with."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scored, self.losses = [], []

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        rows = [(p, list(ids), x["trace_leaf"], x["trace_reward"]) for p, ids, x in zip(prompts, completion_ids_list, inputs)]
        self.scored.append((rows, rewards[:, 0].tolist()))
        return rewards

    def _compute_loss(self, model, inputs):
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "tool_mask", "num_items_in_batch")
        self.losses.append({k: inputs[k].detach().cpu() for k in keys})
        return super()._compute_loss(model, inputs)


def small_config(**overrides) -> RunConfig:
    settings = {"prompts_per_step": PROMPTS, "task.max_turns": 3, "rollout.budget": GENERATIONS, "rollout.max_new_tokens": 16, "train.steps": 2, "train.lr": 1e-3}
    return load_config(RunConfig, None, [f"{k}={v}" for k, v in {**settings, **overrides}.items()])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    train = load_taskset("multihop", split="train", num_tasks=16, seed=0)
    texts = [p.text for p in train.corpus[:80]]
    tiny = TinyConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, vocab_size=512)
    cache = tmp_path_factory.mktemp("cache")
    return train, lambda: load_policy("tiny", seed=0, tokenizer_texts=texts, tiny=tiny, cache_dir=cache)


def build(world, engine_kind: str, config: RunConfig, output_dir: Path, **extra):
    """(policy, rollout, trainer): the HF engine over the trainer's own model, or a scripted engine
    whose coin-flip answers make mixed trees (so the advantages are not all zero)."""
    train, make_policy = world
    policy = make_policy()
    env = build_env(config, train)
    if engine_kind == "hf":
        engine = HFEngine.from_policy(policy)
    else:
        engine = ScriptedEngine(policy.tokenizer, menu_for=coin_flip_answers(train.tasks))
    predictor = build_predictor(config)
    collector = TreeRolloutCollector(engine, policy.tokenizer, env, predictor, config.rollout, seed=config.seed)
    parts = Parts(train=train, test=train, env=env, policy=policy, engine=engine, predictor=predictor, collector=collector)
    rollout = RecordingRollout(parts.collector, parts.train.tasks)
    return policy, rollout, grpo_config(config, output_dir=str(output_dir), disable_tqdm=True, **extra)


def expected_rows(trees):
    """Each leaf's row as trace-rl trains it, written out from the node advantages: a node's policy
    tokens are trained (mask 1, its advantage) in the row of the first leaf below it, else context."""
    rows = []
    for tree, node_adv in zip(trees, get_estimator("trace")(trees)):
        owned = set()
        for leaf in tree.leaves().tolist():
            tokens, advantages, mask = [], [], []
            for i in tree.path(leaf)[1:]:
                node = tree.nodes[i]
                mine = i not in owned
                owned.add(i)
                tokens += node.token_ids
                mask += [int(mine and m == 1) for m in node.mask]
                advantages += [float(node_adv.advantage[i]) if mine and m == 1 else 0.0 for m in node.mask]
            rows.append((tuple(tree.root.token_ids), tuple(tokens), tuple(mask), tuple(advantages)))
    return sorted(rows)


def trained_rows(loss_inputs):
    """The rows of one loss call, as TRL trained them (padding removed)."""
    rows = []
    for b in range(loss_inputs["completion_ids"].shape[0]):
        prompt = loss_inputs["prompt_ids"][b][loss_inputs["prompt_mask"][b] == 1].tolist()
        n = int(loss_inputs["completion_mask"][b].sum())
        completion = loss_inputs["completion_ids"][b, :n].tolist()
        mask = (loss_inputs["tool_mask"][b, :n] * loss_inputs["completion_mask"][b, :n]).tolist()
        rows.append((tuple(prompt), tuple(completion), tuple(mask), tuple(loss_inputs["advantages"][b, :n].tolist())))
    return sorted(rows)


@pytest.mark.parametrize("engine_kind", ["hf", "scripted"])
def test_grpo_trainer_trains_every_tree_node_once_with_trace_rls_advantages_and_leaf_rewards(world, engine_kind, tmp_path):
    config = small_config()
    policy, rollout, args = build(world, engine_kind, config, tmp_path)
    trainer = RecordingTrainer(policy.model, rollout, args)
    before = [p.detach().clone() for p in policy.model.parameters()]
    trainer.train()

    assert trainer.state.global_step == 2 and len(rollout.calls) == 2 and len(trainer.losses) == 2
    for call, (scored, rewards), loss in zip(rollout.calls, trainer.scored, trainer.losses):
        trees = call["trees"]
        # every prompt got exactly num_generations rows, all from its own tree of num_generations leaves
        assert len(set(call["prompts"])) == PROMPTS and all(call["prompts"].count(p) == GENERATIONS for p in call["prompts"])
        assert [t.prompt for t in trees] == call["prompts"][::GENERATIONS]
        assert all(t.leaves().size == GENERATIONS and t.root.budget + sum(n.budget for n in t.nodes[1:]) == GENERATIONS for t in trees)
        # each row's reward is its own leaf's: the tokens it was scored with are that leaf's path, every leaf once
        by_prompt = {t.prompt: t for t in trees}
        for (prompt, completion_ids, leaf, reward), scored_reward in zip(scored, rewards):
            tree = by_prompt[prompt]
            assert completion_ids == [tok for i in tree.path(leaf)[1:] for tok in tree.nodes[i].token_ids]
            assert reward == scored_reward == tree.nodes[leaf].reward
        for tree in trees:
            assert sorted(leaf for p, _, leaf, _ in scored if p == tree.prompt) == tree.leaves().tolist()
        # TRL's loss got trace-rl's advantages on exactly the tokens trace-rl trains, each node once
        expected, trained = expected_rows(trees), trained_rows(loss)
        assert [row[:3] for row in trained] == [row[:3] for row in expected]
        np.testing.assert_allclose([a for row in trained for a in row[3]], [a for row in expected for a in row[3]], atol=1e-6)
        sequences = tree_sequences(trees, get_estimator("trace")(trees))
        assert float(loss["num_items_in_batch"]) == loss_denominator(sequences)  # dapo's denominator is trace-rl's
        np.testing.assert_allclose(
            float((loss["advantages"] * loss["tool_mask"] * loss["completion_mask"]).sum()),
            sum(w * a for s in sequences for w, a in zip(s.weights, s.advantages)), atol=1e-4,
        )

    changed = any(not np.array_equal(a.numpy(), b.detach().numpy()) for a, b in zip(before, policy.model.parameters()))
    if engine_kind == "hf":
        # sampled from the trainer's own, live module: the second batch after the first update
        assert rollout.collector.engine.model is trainer.model
        assert [(c["step"], c["version"]) for c in rollout.calls] == [(0, 0), (1, 1)]
    else:
        advantages = [a for loss in trainer.losses for a in loss["advantages"].flatten().tolist()]
        assert any(t.is_mixed() for c in rollout.calls for t in c["trees"]) and any(advantages)
        assert changed  # the tree advantages moved the weights


def test_a_resumed_trl_run_grows_the_trees_an_unbroken_one_grows(world, tmp_path):
    """TRL's checkpoints held the model only (issue 44): the predictor and the collector's RNG travel
    beside them (`trace_rl_state.pt`), so a run resumed after step 2 plans step 3 as an unbroken run."""
    def comparable(trees):
        return [[(n.token_ids, n.reward, n.rollout_start) for n in tree.nodes] for tree in trees]

    policy, unbroken, args = build(world, "scripted", small_config(**{"train.steps": 3}), tmp_path / "unbroken")
    RecordingTrainer(policy.model, unbroken, args).train()

    policy, first, args = build(world, "scripted", small_config(), tmp_path / "out", save_strategy="steps", save_steps=1)
    RecordingTrainer(policy.model, first, args).train()
    assert (tmp_path / "out" / "checkpoint-2" / "trace_rl_state.pt").is_file()
    policy, resumed, args = build(world, "scripted", small_config(**{"train.steps": 3}), tmp_path / "out", save_strategy="steps", save_steps=1)
    RecordingTrainer(policy.model, resumed, args).train(resume_from_checkpoint=True)
    assert [call["step"] for call in resumed.calls] == [2]
    assert comparable(resumed.calls[0]["trees"]) == comparable(unbroken.calls[2]["trees"])

    (tmp_path / "out" / "checkpoint-3" / "trace_rl_state.pt").unlink()
    policy, again, args = build(world, "scripted", small_config(**{"train.steps": 4}), tmp_path / "out", save_strategy="steps", save_steps=1)
    with pytest.raises(FileNotFoundError, match="trace_rl_state.pt is missing"):
        RecordingTrainer(policy.model, again, args).train(resume_from_checkpoint=True)


def test_trace_trainer_refuses_a_config_that_would_not_train_the_tree_advantages(world, tmp_path):
    config = small_config()
    policy, rollout, _ = build(world, "scripted", config, tmp_path)
    for change, key in (
        ({"num_generations": 8, "per_device_train_batch_size": 8}, "num_generations"),
        ({"loss_type": "grpo"}, "loss_type"),
        ({"temperature": 0.7}, "temperature"),
        ({"mask_truncated_completions": True}, "mask_truncated_completions"),
    ):
        args = grpo_config(config, output_dir=str(tmp_path), **change)
        with pytest.raises(FieldError, match=f"GRPOConfig.{key}"):
            TraceGRPOTrainer(policy.model, rollout, args)


def test_the_example_makes_real_updates_through_trl_from_a_warm_start_that_earns_reward(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRACE_RL_CACHE", str(tmp_path / "cache"))  # a private warm start
    spec = importlib.util.spec_from_file_location("trl_trace", REPO / "examples" / "trl_trace.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    summary = example.main(["--steps", "2"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert summary["steps"] == 2 and lines[-1] == summary
    steps = [line for line in lines if "tree/leaves" in line]
    assert [line["step"] for line in steps] == [1, 2]
    assert all(line["rollout/leaves"] == 8 and line["tree/leaves_per_prompt"] == 4 for line in steps)
    # real updates (issue 44: every reward, loss and gradient was 0): rewards, mixed groups, a gradient, weights that moved
    assert any(line["rewards/leaf_reward/mean"] > 0 and line["tree/effective_ratio"] > 0 for line in steps)
    assert any(line["grad_norm"] > 0 for line in steps) and summary["max_weight_change"] > 0
    assert list((tmp_path / "cache").glob("sft-*/trace_rl_sft.json")), "the warm start was not made in the private cache"
