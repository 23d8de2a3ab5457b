"""Advantage estimators against trees worked out by hand.

Conventions in the arithmetic below: V = mean leaf reward under a node, σ = std of leaf rewards with
ddof=1, and the estimators run with eps=0 so the expected values are exact (a separate test checks
that the default eps only moves them by ~1e-6). S2 = √2, S3 = √3.
"""

import math

import numpy as np
import pytest

from trace_rl.core.advantage import (
    DEFAULT_ESTIMATOR,
    ESTIMATORS,
    NodeAdvantages,
    advantage_metrics,
    get_estimator,
    grpo_leaves,
    token_advantages,
    token_weights,
    trace_contrast,
    tree_grpo,
    treerl,
)
from trace_rl.core.tree import Node, RolloutTree

S2, S3 = math.sqrt(2.0), math.sqrt(3.0)
EXACT = {"rel": 1e-12, "abs": 1e-12}


def turn(tree: RolloutTree, parent: int, reward: float | None = None) -> int:
    """A policy turn of 2 tokens; a non-final turn also carries a 1-token observation (mask 0)."""
    if reward is None:
        return tree.add_turn(parent, action="call", observation="obs", token_ids=[40, 41, 42], mask=[1, 1, 0])
    return tree.add_turn(parent, action="answer", token_ids=[50, 51], mask=[1, 1], reward=reward)


def bare_chains(rewards: list[float]) -> RolloutTree:
    """One 2-turn bare rollout per reward: node 2k+1 is rollout k's first turn, 2k+2 its leaf."""
    tree = RolloutTree.new("chains", "prompt", prompt_token_ids=[1, 2, 3])
    for reward in rewards:
        turn(tree, turn(tree, 0), reward)
    return tree


def prefix_tree(rewards: tuple[float, float, float, float] = (1.0, 1.0, 0.0, 0.0)) -> RolloutTree:
    """A depth-1 prefix with three answers below it, and a sibling 2-turn chain.

        0 ─┬ 1 A ─┬ 2 (1)
           │      ├ 3 (1)
           │      └ 4 (0)
           └ 5 B ── 6 (0)
    """
    tree = RolloutTree.new("prefix", "prompt", prompt_token_ids=[1, 2, 3])
    a = turn(tree, 0)
    for reward in rewards[:3]:
        turn(tree, a, reward)
    turn(tree, turn(tree, 0), rewards[3])
    return tree


def nested_tree() -> RolloutTree:
    """Two nested anchors below the root, and a one-turn rollout.

        0 ─┬ 1 A ─┬ 2 A1 ─┬ 3 x (1)
           │      │       └ 4 y (0)
           │      └ 5 z (1)
           └ 6 B (0)
    """
    tree = RolloutTree.new("nested", "prompt", prompt_token_ids=[1, 2, 3])
    a = turn(tree, 0)
    a1 = turn(tree, a)
    turn(tree, a1, 1.0)
    turn(tree, a1, 0.0)
    turn(tree, a, 1.0)
    turn(tree, 0, 0.0)
    return tree


def unfinished_tree() -> RolloutTree:
    """Nodes 3, 6 and 7 have no finished leaf below them (truncated rollouts).

        0 ─┬ 1 A ─┬ 2 (1)
           │      └ 3 (no reward, no children)
           ├ 4 B ── 5 (0)
           └ 6 C ── 7 (no reward, no children)
    """
    tree = RolloutTree.new("unfinished", "prompt", prompt_token_ids=[1, 2, 3])
    a = turn(tree, 0)
    turn(tree, a, 1.0)
    turn(tree, a)
    turn(tree, turn(tree, 0), 0.0)
    turn(tree, turn(tree, 0))
    return tree


def random_tree(rng: np.random.Generator, size: int, *, branching: bool = True) -> RolloutTree:
    """Random shape and rewards; some internal nodes end up with no finished leaf."""
    tree = RolloutTree.new("random", "prompt", prompt_token_ids=[1, 2])
    open_nodes = [0]
    for _ in range(size):
        parent = int(rng.choice(open_nodes))
        if rng.random() < 0.45:
            turn(tree, parent, float(rng.choice([0.0, 1.0, 0.5])))
        else:
            open_nodes.append(turn(tree, parent))
        if not branching and parent != 0:
            open_nodes.remove(parent)
    return tree


def run(name: str, tree: RolloutTree, **options) -> NodeAdvantages:
    if name != "treerl":  # treerl divides by no std, so it has no eps
        options.setdefault("eps", 0.0)
    (result,) = get_estimator(name)([tree], **options)
    return result


# ---------------------------------------------------------------- bare rollouts: rewards 1, 0, 0, 0


def test_grpo_on_bare_chains_is_textbook_grpo():
    # mean 1/4; σ² = (9/16 + 3·1/16) / 3 = 1/4, σ = 1/2
    # A(1) = (3/4)/(1/2) = 3/2, A(0) = (-1/4)/(1/2) = -1/2, on both turns of each rollout
    result = run("grpo", bare_chains([1, 0, 0, 0]))
    assert result.advantage.tolist() == pytest.approx([0, 3 / 2, 3 / 2] + [-1 / 2] * 6, **EXACT)
    assert result.weight.tolist() == [0] + [1] * 8


def test_grpo_without_reward_scaling_only_centres_rewards():
    # Dr. GRPO: A = r - 1/4
    result = run("grpo", bare_chains([1, 0, 0, 0]), scale_rewards=False)
    assert result.advantage.tolist() == pytest.approx([0, 3 / 4, 3 / 4] + [-1 / 4] * 6, **EXACT)


def test_default_eps_only_nudges_the_exact_values():
    (result,) = grpo_leaves([bare_chains([1, 0, 0, 0])])
    # 3/4 / (1/2 + 1e-6)
    assert result.advantage[1] == pytest.approx(0.75 / (0.5 + 1e-6), rel=1e-12)
    assert result.advantage[1] == pytest.approx(3 / 2, rel=1e-5)


@pytest.mark.parametrize("name", ["trace", "tree_grpo"])
def test_trace_and_tree_grpo_equal_grpo_on_bare_chains(name):
    # trace: no prefix term at the root, chain nodes have V(s) = V(parent); tree_grpo: each
    # subtree under the root holds one leaf, so the intra-tree term is 0
    tree = bare_chains([1, 0, 0, 0])
    expected = run("grpo", tree)
    result = run(name, tree)
    assert result.advantage.tolist() == pytest.approx(expected.advantage.tolist(), **EXACT)
    assert result.weight.tolist() == expected.weight.tolist()


def test_treerl_on_bare_chains_gives_first_turns_both_terms():
    # V(root) = 1/4. First turn s (parent root, mixed): (r - 1/4) + (r - 1/4); second turn: (r - 1/4) + 0
    # n(s) = 1, so the sqrt divisor is 1
    result = run("treerl", bare_chains([1, 0, 0, 0]))
    assert result.advantage.tolist() == pytest.approx([0, 3 / 2, 3 / 4] + [-1 / 2, -1 / 4] * 3, **EXACT)
    assert result.weight.tolist() == [0] + [1] * 8


def test_bare_chains_property_trace_equals_grpo_on_random_unbranched_trees():
    rng = np.random.default_rng(0)
    for _ in range(30):
        tree = random_tree(rng, 12, branching=False)
        assert all(len(n.children) <= 1 for n in tree.nodes[1:])
        expected, result = run("grpo", tree), run("trace", tree)
        assert result.advantage == pytest.approx(expected.advantage, **EXACT)
        assert result.weight.tolist() == expected.weight.tolist()


# ---------------------------------------------------------------- prefix A with answers 1, 1, 0; chain B with 0
# leaves 1, 1, 0, 0: V(root) = 1/2, σ_root² = 4·(1/4)/3 = 1/3, σ_root = 1/S3
# V(A) = 2/3, σ_A² = (2·(1/9) + 4/9)/2 = 1/3, σ_A = 1/S3; V(B) = 0


def test_grpo_on_shared_prefix():
    # leaf: ±(1/2)·S3 = ±S3/2; A: mean(S3/2, S3/2, -S3/2) = S3/6 with weight 3; B: -S3/2 with weight 1
    result = run("grpo", prefix_tree())
    assert result.advantage.tolist() == pytest.approx([0, S3 / 6, S3 / 2, S3 / 2, -S3 / 2, -S3 / 2, -S3 / 2], **EXACT)
    assert result.weight.tolist() == [0, 3, 1, 1, 1, 1, 1]


def test_trace_on_shared_prefix():
    # A: root term (2/3 - 1/2)·S3 = S3/6, no prefix term (its parent is the root)
    # answers 1: S3/2 + (1 - 2/3)·S3 = 5·S3/6; answer 0: -S3/2 + (0 - 2/3)·S3 = -7·S3/6
    # B and its answer: -S3/2 (B has a single child, so no prefix term); every weight 1
    result = run("trace", prefix_tree())
    expected = [0, S3 / 6, 5 * S3 / 6, 5 * S3 / 6, -7 * S3 / 6, -S3 / 2, -S3 / 2]
    assert result.advantage.tolist() == pytest.approx(expected, **EXACT)
    assert result.weight.tolist() == [0, 1, 1, 1, 1, 1, 1]


def test_treerl_on_shared_prefix():
    # A: (1/6 + 1/6) / sqrt(3) = S3/9 (weight 3); answers 1: 1/2 + 1/3 = 5/6; answer 0: -1/2 - 2/3 = -7/6
    # B: -1/2 - 1/2 = -1; B's answer: -1/2 + 0 (B is not mixed)
    result = run("treerl", prefix_tree())
    assert result.advantage.tolist() == pytest.approx([0, S3 / 9, 5 / 6, 5 / 6, -7 / 6, -1, -1 / 2], **EXACT)
    assert result.weight.tolist() == [0, 3, 1, 1, 1, 1, 1]
    unscaled = run("treerl", prefix_tree(), normalize_by_sqrt_leaves=False)
    assert unscaled.advantage[1] == pytest.approx(1 / 3, **EXACT)
    assert unscaled.advantage[2:].tolist() == pytest.approx(result.advantage[2:].tolist(), **EXACT)


def test_tree_grpo_on_shared_prefix():
    # subtree A: intra (1 - 2/3)·S3 = S3/3 and (0 - 2/3)·S3 = -2·S3/3; subtree B: one leaf, intra 0
    # leaves: S3/2 + S3/3 = 5·S3/6, -S3/2 - 2·S3/3 = -7·S3/6, B's: -S3/2
    # A: mean(5, 5, -7)·S3/6 = S3/6 with weight 3
    result = run("tree_grpo", prefix_tree())
    expected = [0, S3 / 6, 5 * S3 / 6, 5 * S3 / 6, -7 * S3 / 6, -S3 / 2, -S3 / 2]
    assert result.advantage.tolist() == pytest.approx(expected, **EXACT)
    assert result.weight.tolist() == [0, 3, 1, 1, 1, 1, 1]


# ---------------------------------------------------------------- nested anchors
# leaves x=1, y=0, z=1, B=0: V(root) = 1/2, σ_root = 1/S3
# V(A) = 2/3 (leaves 1, 0, 1), σ_A = 1/S3; V(A1) = 1/2 (leaves 1, 0), σ_A1² = (1/4 + 1/4)/1, σ_A1 = 1/S2

NESTED_EXPECTED = {
    # leaves ±S3/2; A: mean(S3/2, -S3/2, S3/2) = S3/6 (weight 3); A1: mean(S3/2, -S3/2) = 0 (weight 2)
    "grpo": ([0, S3 / 6, 0, S3 / 2, -S3 / 2, S3 / 2, -S3 / 2], [0, 3, 2, 1, 1, 1, 1]),
    # A: S3/6; A1: 0 + (1/2 - 2/3)·S3 = -S3/6; x: S3/2 + (1/2)·S2; y: -S3/2 - (1/2)·S2
    # z: S3/2 + (1 - 2/3)·S3 = 5·S3/6; B: -S3/2 (parent is the root)
    "trace": ([0, S3 / 6, -S3 / 6, S3 / 2 + S2 / 2, -S3 / 2 - S2 / 2, 5 * S3 / 6, -S3 / 2], [0, 1, 1, 1, 1, 1, 1]),
    # A: (1/6 + 1/6)/S3 = S3/9; A1: (0 - 1/6)/S2 = -S2/12; x: 1/2 + 1/2 = 1; y: -1
    # z: 1/2 + 1/3 = 5/6; B: -1/2 - 1/2 = -1
    "treerl": ([0, S3 / 9, -S2 / 12, 1, -1, 5 / 6, -1], [0, 3, 2, 1, 1, 1, 1]),
    # subtree A (x, y, z = 1, 0, 1): intra S3/3, -2·S3/3, S3/3; B alone: 0
    # x: 5·S3/6, y: -7·S3/6, z: 5·S3/6, B: -S3/2; A1: mean(5, -7)·S3/6 = -S3/6; A: (5 - 7 + 5)·S3/18 = S3/6
    "tree_grpo": ([0, S3 / 6, -S3 / 6, 5 * S3 / 6, -7 * S3 / 6, 5 * S3 / 6, -S3 / 2], [0, 3, 2, 1, 1, 1, 1]),
}


@pytest.mark.parametrize("name", sorted(NESTED_EXPECTED))
def test_estimators_on_nested_anchors(name):
    advantage, weight = NESTED_EXPECTED[name]
    result = run(name, nested_tree())
    assert result.advantage.tolist() == pytest.approx(advantage, **EXACT)
    assert result.weight.tolist() == weight


def test_trace_coefficients_scale_each_term():
    tree = nested_tree()
    root_only = run("trace", tree, prefix_coef=0.0)
    assert root_only.advantage == pytest.approx(run("grpo", tree).advantage, **EXACT)
    prefix_only = run("trace", tree, root_coef=0.0)
    # A: no prefix term; A1: -S3/6; x, y: ±S2/2; z: S3/3; B: 0
    assert prefix_only.advantage.tolist() == pytest.approx([0, 0, -S3 / 6, S2 / 2, -S2 / 2, S3 / 3, 0], **EXACT)
    doubled = run("trace", tree, root_coef=2.0, prefix_coef=2.0)
    assert doubled.advantage == pytest.approx(2 * run("trace", tree).advantage, **EXACT)


# ---------------------------------------------------------------- the grpo equivalence


@pytest.mark.parametrize("tree", [prefix_tree(), nested_tree()], ids=["prefix", "nested"])
def test_grpo_weighted_node_advantage_is_the_sum_over_its_sequences(tree):
    result = run("grpo", tree)
    # prefix tree, node A: 3 · S3/6 = S3/2 = S3/2 + S3/2 - S3/2, the three sequences through A
    for node in tree.nodes[1:]:
        below = [leaf for leaf in tree.leaves() if node.id in tree.path(leaf)]
        expected = sum(result.advantage[leaf] for leaf in below)
        assert result.weight[node.id] * result.advantage[node.id] == pytest.approx(expected, **EXACT)


def test_grpo_equivalence_on_random_trees():
    """Training every root-to-leaf sequence with its leaf's GRPO advantage, summed per node."""
    rng = np.random.default_rng(1)
    for _ in range(30):
        tree = random_tree(rng, 15)
        (result,) = grpo_leaves([tree])  # default eps
        leaves = tree.leaves()
        rewards = tree.leaf_rewards()
        if leaves.size >= 2 and rewards.max() > rewards.min():
            per_sequence = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
        else:
            per_sequence = np.zeros(leaves.size)
        for node in tree.nodes[1:]:
            through = [k for k, leaf in enumerate(leaves) if node.id in tree.path(int(leaf))]
            assert result.weight[node.id] == len(through)
            total = result.weight[node.id] * result.advantage[node.id]
            assert total == pytest.approx(per_sequence[through].sum(), abs=1e-9)


# ---------------------------------------------------------------- degenerate trees, all estimators


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_all_equal_tree_gives_zero_advantages_and_keeps_weights(name):
    for rewards in [(1.0, 1.0, 1.0, 1.0), (0.0, 0.0, 0.0, 0.0), (0.3, 0.3, 0.3, 0.3)]:
        tree = prefix_tree(rewards)
        result = run(name, tree)
        assert result.advantage.tolist() == [0.0] * 7
        assert result.weight.tolist() == run(name, prefix_tree()).weight.tolist()


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_nodes_without_finished_leaves_get_zero_not_nan(name):
    result = run(name, unfinished_tree())
    assert np.isfinite(result.advantage).all()
    for node in (3, 6, 7):
        assert result.advantage[node] == 0.0 and result.weight[node] == 0.0


def test_unfinished_branches_do_not_count_as_contrast():
    # leaves 1 (below A) and 0 (below B): V(root) = 1/2, σ_root² = 1/2, root term ±(1/2)·S2 = ±S2/2
    # A has two children but only one with a finished leaf: no prefix-level contrast at A
    grpo = run("grpo", unfinished_tree())
    assert grpo.advantage.tolist() == pytest.approx([0, S2 / 2, S2 / 2, 0, -S2 / 2, -S2 / 2, 0, 0], **EXACT)
    assert grpo.weight.tolist() == [0, 1, 1, 0, 1, 1, 0, 0]
    trace = run("trace", unfinished_tree())
    assert trace.advantage.tolist() == pytest.approx(grpo.advantage.tolist(), **EXACT)
    # treerl: A: 1/2 + 1/2 = 1; its answer: 1/2 + 0; B: -1; B's answer: -1/2
    assert run("treerl", unfinished_tree()).advantage.tolist() == pytest.approx([0, 1, 1 / 2, 0, -1, -1 / 2, 0, 0], **EXACT)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_root_without_rollouts_gives_zero(name):
    tree = RolloutTree.new("empty", "prompt", prompt_token_ids=[1, 2, 3])
    result = run(name, tree)
    assert result.advantage.tolist() == [0.0] and result.weight.tolist() == [0.0]
    assert [t.tolist() for t in token_advantages(tree, result)] == [[0.0, 0.0, 0.0]]


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_single_rollout_has_nothing_to_contrast(name):
    tree = bare_chains([1.0])
    assert run(name, tree).advantage.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_estimator_contract_on_random_batches(name):
    rng = np.random.default_rng(2)
    trees = [random_tree(rng, int(rng.integers(0, 20))) for _ in range(25)]
    results = get_estimator(name)(trees)
    assert len(results) == len(trees)
    for tree, result in zip(trees, results):
        counts = tree.backup().counts
        assert result.advantage.shape == result.weight.shape == (len(tree.nodes),)
        assert np.isfinite(result.advantage).all() and (result.weight >= 0).all()
        assert result.advantage[0] == 0.0 and result.weight[0] == 0.0
        assert (result.advantage[counts == 0] == 0).all() and (result.weight[counts == 0] == 0).all()
        assert (result.weight[1:][counts[1:] > 0] > 0).all()
        if not tree.is_mixed():
            assert (result.advantage == 0).all()


def test_batch_results_follow_tree_order():
    trees = [nested_tree(), bare_chains([1, 0, 0, 0]), prefix_tree()]
    results = trace_contrast(trees, eps=0.0)
    for tree, result in zip(trees, results):
        assert result.advantage == pytest.approx(run("trace", tree).advantage, **EXACT)


# ---------------------------------------------------------------- per-token views


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_observation_and_prompt_tokens_get_zero(name):
    tree = nested_tree()
    result = run(name, tree)
    advantages, weights = token_advantages(tree, result), token_weights(tree, result)
    for node, adv, weight in zip(tree.nodes, advantages, weights):
        mask = np.array(node.mask)
        assert adv.shape == weight.shape == (len(node.token_ids),)
        assert (adv[mask == 0] == 0).all() and (weight[mask == 0] == 0).all()
        assert (adv[mask == 1] == result.advantage[node.id]).all()
        assert (weight[mask == 1] == result.weight[node.id]).all()
    assert advantages[0].tolist() == [0.0, 0.0, 0.0]  # the prompt


def test_token_advantages_follow_each_nodes_mask():
    # node 1 (A) of the prefix tree: tokens [40, 41, 42], mask [1, 1, 0], trace advantage S3/6
    tree = prefix_tree()
    result = run("trace", tree)
    per_node = token_advantages(tree, result)
    assert [len(a) for a in per_node] == [len(n.token_ids) for n in tree.nodes] == [3, 3, 2, 2, 2, 3, 2]
    assert per_node[1].tolist() == pytest.approx([S3 / 6, S3 / 6, 0.0], **EXACT)
    assert per_node[4].tolist() == pytest.approx([-7 * S3 / 6] * 2, **EXACT)
    assert token_weights(tree, run("grpo", tree))[1].tolist() == [3.0, 3.0, 0.0]


def test_token_advantages_reject_advantages_of_another_tree():
    result = run("trace", nested_tree())
    with pytest.raises(ValueError, match=r"has 5 nodes but its advantages have shape \(7,\)"):
        token_advantages(bare_chains([1, 0]), result)


# ---------------------------------------------------------------- metric


def test_nonzero_adv_token_share_counts_tokens_as_often_as_they_are_trained():
    # every non-root node has 2 policy tokens
    # nested, grpo: weights A 3, A1 2, four leaves 1 -> 2·(3 + 2 + 4) = 18 trained, A1's 4 have A = 0 -> 14
    # all-equal prefix tree, grpo: 2·(3 + 5) = 16 trained, none non-zero
    # nested, trace: 6 nodes · 2 = 12, all non-zero; all-equal, trace: 12 trained, none non-zero
    trees = [nested_tree(), prefix_tree((1.0, 1.0, 1.0, 1.0))]
    assert advantage_metrics(trees[:1], grpo_leaves(trees[:1])) == {"tree/nonzero_adv_token_share": pytest.approx(14 / 18)}
    assert advantage_metrics(trees, grpo_leaves(trees))["tree/nonzero_adv_token_share"] == pytest.approx(14 / 34)
    assert advantage_metrics(trees[:1], trace_contrast(trees[:1]))["tree/nonzero_adv_token_share"] == 1.0
    assert advantage_metrics(trees, trace_contrast(trees))["tree/nonzero_adv_token_share"] == pytest.approx(1 / 2)


def test_nonzero_adv_token_share_is_zero_when_nothing_is_trained():
    empty = [RolloutTree.new("empty", "prompt")]
    assert advantage_metrics(empty, treerl(empty)) == {"tree/nonzero_adv_token_share": 0.0}
    with pytest.raises(ValueError, match="2 trees but 1"):
        advantage_metrics(empty * 2, treerl(empty))


# ---------------------------------------------------------------- registry and options


def test_registry_names_and_default():
    assert sorted(ESTIMATORS) == ["grpo", "trace", "tree_grpo", "treerl"]
    assert DEFAULT_ESTIMATOR == "trace"
    assert get_estimator("grpo") is grpo_leaves and get_estimator("tree_grpo") is tree_grpo


def test_get_estimator_suggests_the_nearest_name():
    with pytest.raises(ValueError, match=r"unknown advantage.name 'trcae'; did you mean 'trace'\?"):
        get_estimator("trcae")
    with pytest.raises(ValueError, match=r"did you mean 'tree_grpo'\?"):
        get_estimator("treegrpo")
    with pytest.raises(ValueError, match=r"known: \['grpo', 'trace', 'tree_grpo', 'treerl'\]") as info:
        get_estimator("ppo")
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_unknown_or_positional_options_are_rejected(name):
    estimator = get_estimator(name)
    with pytest.raises(TypeError, match="unexpected keyword argument 'epsilon'"):
        estimator([nested_tree()], epsilon=0.1)
    with pytest.raises(TypeError):
        estimator([nested_tree()], 0.1)


def test_bad_option_values_raise_naming_the_option():
    with pytest.raises(ValueError, match="eps"):
        grpo_leaves([nested_tree()], eps=-1.0)
    with pytest.raises(ValueError, match="prefix_coef"):
        trace_contrast([nested_tree()], prefix_coef=float("nan"))


def test_non_finite_reward_raises_naming_the_node():
    tree = nested_tree()
    tree.nodes.append(Node(id=7, parent=0, depth=1, reward=float("nan")))
    tree.nodes[0].children.append(7)
    with pytest.raises(ValueError, match="node 7 has reward nan"):
        trace_contrast([tree])


def test_node_advantages_validate_their_arrays():
    with pytest.raises(ValueError, match="one length"):
        NodeAdvantages(advantage=np.zeros(3), weight=np.zeros(2))
    with pytest.raises(ValueError, match="finite"):
        NodeAdvantages(advantage=np.array([np.nan]), weight=np.zeros(1))
    with pytest.raises(ValueError, match=">= 0"):
        NodeAdvantages(advantage=np.zeros(1), weight=np.array([-1.0]))
