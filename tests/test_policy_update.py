"""The pieces of the policy update: tree → sequences (each token once), and the clipped loss."""

import copy
import math

import numpy as np
import pytest
import torch

from trace_rl.core.advantage import NodeAdvantages, get_estimator
from trace_rl.core.tree import RolloutTree
from trace_rl.training.loss import policy_loss
from trace_rl.training.sequences import pad_batch, tree_sequences


def branched_tree() -> RolloutTree:
    """Root (prompt tokens 1 2) → P (policy 10 11, observation 12) → leaves A (20, r=1) and B (30, r=0)."""
    tree = RolloutTree.new("t", "q", prompt_token_ids=[1, 2])
    p = tree.add_turn(0, token_ids=[10, 11, 12], mask=[1, 1, 0], logprobs=[-0.1, -0.2, 0.0])
    tree.add_turn(p, token_ids=[20], mask=[1], logprobs=[-0.3], reward=1.0)
    tree.add_turn(p, token_ids=[30], mask=[1], logprobs=[-0.4], reward=0.0)
    return tree


def test_a_shared_prefix_is_trained_once_in_its_owner_sequence():
    tree = branched_tree()
    adv = NodeAdvantages(advantage=np.array([0.0, 0.5, 1.0, -1.0]), weight=np.array([0.0, 2.0, 1.0, 1.0]))
    first, second = tree_sequences([tree], [adv])
    assert first.token_ids == [1, 2, 10, 11, 12, 20] and second.token_ids == [1, 2, 10, 11, 12, 30]
    # P's policy tokens are trained in the first (owner) sequence only, with P's advantage and weight
    assert first.advantages == [0.0, 0.0, 0.5, 0.5, 0.0, 1.0]
    assert first.weights == [0.0, 0.0, 2.0, 2.0, 0.0, 1.0]
    assert first.old_logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, -0.3]
    assert second.advantages == [0.0] * 5 + [-1.0] and second.weights == [0.0] * 5 + [1.0]


def test_sequences_without_a_trained_token_are_dropped():
    tree = branched_tree()
    zero = NodeAdvantages(advantage=np.zeros(4), weight=np.zeros(4))
    assert tree_sequences([tree], [zero]) == []


def test_grpo_sequences_carry_the_same_gradient_as_one_sequence_per_leaf():
    tree = branched_tree()
    tree.add_turn(0, token_ids=[40, 41], mask=[1, 1], logprobs=[-0.5, -0.5], reward=0.0)  # a third rollout
    adv = get_estimator("grpo")([tree], eps=0.0)
    sequences = tree_sequences([tree], adv)
    # rewards 1, 0, 0: mean 1/3, std (ddof 1) 1/√3, so A = +2/√3 for the success and −1/√3 for failures
    leaf_adv = {2: 2 / math.sqrt(3), 3: -1 / math.sqrt(3), 4: -1 / math.sqrt(3)}
    # one sequence per leaf, every policy token on the path trained with the leaf's advantage:
    per_leaf = sum(a * sum(sum(tree.nodes[i].mask) for i in tree.path(leaf)) for leaf, a in leaf_adv.items())
    ours = sum(a * w for s in sequences for a, w in zip(s.advantages, s.weights))
    # = 3 tokens × 2/√3 − 3 tokens × 1/√3 − 2 tokens × 1/√3 = 1/√3
    assert ours == pytest.approx(per_leaf) and per_leaf == pytest.approx(1 / math.sqrt(3))
    assert sum(w for s in sequences for w in s.weights) == 2 * 2 + 1 + 1 + 2  # P's 2 tokens count for both leaves


def test_pad_batch_aligns_fields_with_next_token_logprobs():
    tree = branched_tree()
    adv = NodeAdvantages(advantage=np.array([0.0, 0.5, 1.0, -1.0]), weight=np.array([0.0, 1.0, 1.0, 1.0]))
    batch = pad_batch(tree_sequences([tree], [adv]))
    assert batch.input_ids.shape == (2, 6) and batch.advantages.shape == (2, 5)
    # position t predicts token t+1: token 10 (index 2) is predicted at position 1
    assert batch.advantages[0].tolist() == [0.0, 0.5, 0.5, 0.0, 1.0]
    assert batch.old_logprobs[0, 1].item() == pytest.approx(-0.1)


def test_policy_loss_is_the_clipped_token_mean():
    logp = torch.tensor([[math.log(1.5), math.log(0.5), 0.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    weights = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is not trained
    out = policy_loss(logp, old, adv, weights, denominator=2.0, clip_low=0.2, clip_high=0.28)
    # token 1: ratio 1.5, A=+1: max(-1.5, -1.28) = -1.28 (clipped); token 2: ratio 0.5, A=-1: max(0.5, 0.8) = 0.8
    assert out.loss.item() == pytest.approx((-1.28 + 0.8) / 2)
    assert out.clipfrac == pytest.approx(1.0)
    out.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.0])  # both clipped: no gradient


def test_policy_loss_gradient_follows_the_advantage_inside_the_clip_range():
    logp = torch.zeros(1, 2, requires_grad=True)
    out = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, -2.0]]), torch.ones(1, 2), denominator=2.0)
    out.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.5, 1.0])  # d/dlogp of -A·ratio / 2 at ratio 1
    assert out.clipfrac == 0.0 and out.ratio_mean == pytest.approx(1.0)


def test_kl_term_is_zero_at_the_reference_and_positive_away_from_it():
    logp = torch.tensor([[-1.0, -2.0]])
    same = policy_loss(logp, logp, torch.zeros(1, 2), torch.ones(1, 2), denominator=2.0, ref_logprobs=logp, kl_coef=0.1)
    assert same.kl == pytest.approx(0.0)
    away = policy_loss(logp, logp, torch.zeros(1, 2), torch.ones(1, 2), denominator=2.0, ref_logprobs=logp + 0.5, kl_coef=0.1)
    assert away.kl == pytest.approx(math.exp(0.5) - 0.5 - 1.0)
    assert away.loss.item() == pytest.approx(0.1 * away.kl)


# ---------------------------------------------------------------- the trainer's update on hand-made trees


class _Engine:
    accepts_weights = True
    weight_version = 0

    def update_weights(self, model, *, version: int) -> None:
        self.weight_version = version


def small_llama(seed: int = 0, *, attn: str = "sdpa", kv_heads: int = 2):
    """A 2-layer Llama with grouped-query attention (4 heads, `kv_heads` key/value heads), weights large
    enough (init 0.2) that attention is far from uniform, so a wrong mask or position shows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=256, initializer_range=0.2, attn_implementation=attn,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).float()


def update_trainer(model, run_dir, *, update: str, kl_coef: float = 0.0, max_context_tokens: int = 2048, **train):
    """A `Trainer` whose only working parts are the ones `_update_policy` uses (fp32, one optimiser
    step over all the data unless told otherwise)."""
    from types import SimpleNamespace

    from trace_rl.planning.methods import get_method
    from trace_rl.rollout.collector import RolloutConfig
    from trace_rl.training.trainer import TrainConfig, Trainer, TrainingSetup

    options = {"mini_batches": 1, "epochs": 1, "grad_clip": 1e9, "lr": 1e-3, "precision": "fp32", **train}
    config = TrainConfig(update=update, kl_coef=kl_coef, **options)
    collector = SimpleNamespace(config=RolloutConfig(max_context_tokens=max_context_tokens, max_new_tokens=8, temperature=0.7))
    setup = TrainingSetup(
        method=get_method("trace"), model=model, engine=_Engine(), collector=collector, predictor=None,
        train_tasks=[], test_tasks=[], prompts_per_step=1, seed=0,
    )
    return Trainer(config, setup, run_dir)


def on_policy(model, trees, *, temperature: float) -> None:
    """Set every policy token's behaviour log-prob to the model's own (an on-policy batch)."""
    from trace_rl.models import token_logprobs

    for tree in trees:
        for node in tree.nodes[1:]:
            path = tree.path(node.id)
            ids = [t for i in path for t in tree.nodes[i].token_ids]
            if len(ids) < 2 or not node.token_ids:
                continue
            with torch.no_grad():
                lp = token_logprobs(model, torch.tensor([ids]), temperature=temperature)[0]
            own = lp[len(ids) - len(node.token_ids) - 1 :].tolist()
            node.logprobs = [v if m else 0.0 for v, m in zip(own, node.mask)]


@pytest.mark.parametrize("update", ["per_leaf", "packed"])
def test_ratio_mean_is_one_on_an_on_policy_step_and_counts_only_tokens_in_the_loss(tmp_path, update):
    # a mixed tree and a tree whose leaves agree: the second one's tokens have advantage 0, so they are
    # skipped (no KL term) but count in the token mean's denominator; the ratio must not count them
    mixed = branched_tree()
    agreed = RolloutTree.new("u", "q", prompt_token_ids=[1, 3])
    agreed.add_turn(0, token_ids=[40, 41, 42], mask=[1, 1, 1], reward=1.0)
    agreed.add_turn(0, token_ids=[43, 44], mask=[1, 1], reward=1.0)
    model = small_llama()
    on_policy(model, [mixed, agreed], temperature=0.7)
    advantages = get_estimator("trace")([mixed, agreed])
    assert not advantages[1].advantage.any() and advantages[1].weight[1:].all()
    trainer = update_trainer(model, tmp_path, update=update)
    metrics = trainer._update_policy(tree_sequences([mixed, agreed], advantages))
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/clipfrac"] == 0.0


@pytest.mark.parametrize(("update", "estimator"), [("per_leaf", "grpo"), ("packed", "grpo"), ("packed", "trace")])
def test_one_update_raises_the_rewarded_leaf_and_lowers_the_unrewarded_one(tmp_path, update, estimator):
    """The whole update, end to end, moves the policy the way the rewards say: after one optimiser step
    on a two-leaf tree (A rewarded, B not), the model puts more probability on A's token and less on B's."""
    from trace_rl.models import token_logprobs

    tree = branched_tree()
    model = small_llama()
    on_policy(model, [tree], temperature=0.7)

    def leaf_logprob(leaf: int) -> float:
        ids = [t for i in tree.path(leaf) for t in tree.nodes[i].token_ids]
        with torch.no_grad():
            return float(token_logprobs(model, torch.tensor([ids]), temperature=0.7)[0, -1])

    before = {leaf: leaf_logprob(leaf) for leaf in (2, 3)}
    advantages = get_estimator(estimator)([tree])
    trainer = update_trainer(model, tmp_path, update=update, lr=1e-2)
    trainer._update_policy(tree_sequences([tree], advantages))
    after = {leaf: leaf_logprob(leaf) for leaf in (2, 3)}
    assert after[2] > before[2] + 1e-3, (before, after)
    assert after[3] < before[3] - 1e-3, (before, after)


@pytest.mark.parametrize("update", ["per_leaf", "packed"])
def test_an_update_recomputes_the_behaviour_logprobs_of_a_bf16_engine(tmp_path, update):
    """A bf16 engine's log-probs differ from the update's fp32 ones by rounding: the update replaces them
    with its own before its first optimiser step, so an on-policy step's ratio is 1 and the gap is
    logged; with an fp32 engine they are kept (the same perturbed numbers then move the ratio)."""
    mixed = branched_tree()
    model = small_llama()
    on_policy(model, [mixed], temperature=0.7)
    for node in mixed.nodes[1:]:  # what a bf16 engine records: each log-prob off by rounding
        node.logprobs = [v - 0.05 if m else 0.0 for v, m in zip(node.logprobs, node.mask)]
    advantages = get_estimator("trace")([mixed])
    gaps = {}
    for precision in ("bf16", "fp32"):
        trainer = update_trainer(copy.deepcopy(model), tmp_path / precision, update=update)
        trainer.setup.engine.precision = precision
        metrics = trainer._update_policy(tree_sequences([mixed], advantages))
        gaps[precision] = metrics.get("actor/rollout_logprob_gap")
        if precision == "bf16":
            assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        else:
            assert metrics["actor/ratio_mean"] == pytest.approx(math.exp(0.05), abs=1e-4)
    assert gaps == {"bf16": pytest.approx(0.05, abs=1e-5), "fp32": None}


@pytest.mark.parametrize(("mini_batches", "epochs"), [(1, 1), (2, 1), (3, 2)])
def test_the_first_mini_batch_takes_its_behaviour_logprobs_from_its_own_forward(tmp_path, mini_batches, epochs):
    """With a bf16 engine the update recomputes the behaviour log-probs, but not of the first optimiser
    step's mini-batch, whose own forward gives them. Every optimiser step's gradient equals that of the
    same update from exactly on-policy log-probs with nothing recomputed, over mini-batches and epochs
    (a tiny learning rate keeps Adam's sign-like steps on near-zero gradients from amplifying float noise)."""
    trees = []
    for index in range(4):
        tree = RolloutTree.new(f"t{index}", "q", prompt_token_ids=[1, 2 + index])
        p = tree.add_turn(0, token_ids=[10 + index, 11, 12], mask=[1, 1, 0])
        tree.add_turn(p, token_ids=[20 + index], mask=[1], reward=1.0)
        tree.add_turn(p, token_ids=[30], mask=[1], reward=0.0)
        trees.append(tree)
    model = small_llama()
    on_policy(model, trees, temperature=0.7)
    advantages = get_estimator("trace")(trees)

    def run(trainer):
        grads = []
        step = trainer.optimizer.step
        trainer.optimizer.step = lambda: grads.append([p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]) or step()
        return trainer._update_policy(tree_sequences(trees, advantages)), grads

    options = dict(update="packed", mini_batches=mini_batches, epochs=epochs, micro_batch_size=1, lr=1e-8)
    exact_metrics, exact_grads = run(update_trainer(copy.deepcopy(model), tmp_path / "exact", **options))
    for tree in trees:  # what a bf16 engine records: off by rounding
        for node in tree.nodes[1:]:
            node.logprobs = [v - 0.05 if m else 0.0 for v, m in zip(node.logprobs, node.mask)]
    shortcut = update_trainer(copy.deepcopy(model), tmp_path / "bf16", **options)
    shortcut.setup.engine.precision = "bf16"
    recomputed = []
    original = shortcut._recompute_old_logprobs
    shortcut._recompute_old_logprobs = lambda units, *rest: recomputed.append(len(units)) or original(units, *rest)
    metrics, grads = run(shortcut)
    assert recomputed == [4 - len(np.array_split(range(4), mini_batches)[0])]  # every tree but the first mini-batch's
    assert metrics["actor/rollout_logprob_gap"] == pytest.approx(0.05, abs=1e-5)  # over every trained token
    assert metrics["actor/ratio_mean"] == pytest.approx(exact_metrics["actor/ratio_mean"], abs=1e-6)
    assert len(grads) == len(exact_grads) == mini_batches * epochs
    for mine, theirs in zip(grads, exact_grads):
        for a, b in zip(mine, theirs):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), float((a - b).abs().max())
