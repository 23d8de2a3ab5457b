"""The pieces of the policy update: tree → sequences (each token once), and the clipped loss."""

import math

import numpy as np
import pytest
import torch

from trace_rl.advantage import NodeAdvantages, get_estimator
from trace_rl.train.loss import policy_loss
from trace_rl.train.sequences import pad_batch, tree_sequences
from trace_rl.tree import RolloutTree


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
