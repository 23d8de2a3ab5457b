import json
import math

import numpy as np
import pytest

from trace_rl.core.tree import RolloutTree, read_jsonl, subtree_rewards, write_jsonl
from trace_rl.planning.metrics import (
    agreeing_budget,
    anchor_mixed_ratio,
    effective_ratio,
    mixed_budget_share,
    tree_metrics,
)


def chain(tree: RolloutTree, parent: int, turns: int, reward: float) -> int:
    """Append `turns` turns below `parent`, the last with `reward`; return the leaf id."""
    node = parent
    for turn in range(turns):
        last = turn == turns - 1
        node = tree.add_turn(
            node,
            thought=f"t{turn}",
            action=f"a{turn}",
            observation=f"o{turn}",
            token_ids=[10 + turn, 11 + turn, 12 + turn],
            mask=[1, 1, 0],
            logprobs=[-0.5, -0.25, 0.0],
            reward=reward if last else None,
        )
    return node


def branched_tree() -> RolloutTree:
    """Root with two bare rollouts (rewards 1 and 0); the failed one was branched at depth 1 twice.

        0 (root)
        ├── 1 ── 2 (r=1)
        └── 3 ─┬ 4 (r=0)
               ├ 5 (r=1)
               └ 6 (r=0)
    """
    tree = RolloutTree.new("q1", "What is 2+2?", prompt_token_ids=[1, 2, 3])
    chain(tree, 0, 2, 1.0)
    n3 = tree.add_turn(0, action="search x", token_ids=[5, 6], mask=[1, 0])
    tree.add_turn(n3, action="answer 5", reward=0.0)
    tree.add_turn(n3, action="answer 4", reward=1.0)
    tree.add_turn(n3, action="answer 3", reward=0.0)
    return tree


def test_backup_values_are_leaf_count_weighted_means_of_children():
    tree = branched_tree()
    backup = tree.backup()
    # leaves: 2 (1), 4 (0), 5 (1), 6 (0)
    assert backup.counts.tolist() == [4, 1, 1, 3, 1, 1, 1]
    assert backup.values[2] == 1.0 and backup.values[1] == 1.0
    assert backup.values[3] == pytest.approx(1 / 3)
    # root: (1 * 1 + 3 * 1/3) / 4 = 0.5
    assert backup.values[0] == pytest.approx(0.5)


def test_backup_of_unfinished_nodes_is_nan_with_zero_count():
    tree = RolloutTree.new("q", "p")
    pending = tree.add_turn(0, action="search")
    backup = tree.backup()
    assert backup.counts.tolist() == [0, 0]
    assert math.isnan(backup.values[pending]) and math.isnan(backup.values[0])


def test_branching_from_any_node_and_paths_and_histories():
    tree = branched_tree()
    assert tree.path(5) == [0, 3, 5]
    history = tree.history(5)
    assert history.depth == 2 and history.turns[0].action == "search x"
    assert tree.history(0).depth == 0
    assert tree.anchors().tolist() == [0, 3]
    assert tree.leaves().tolist() == [2, 4, 5, 6]


def test_terminal_nodes_cannot_grow_and_bad_turns_are_rejected():
    tree = branched_tree()
    with pytest.raises(ValueError, match="terminal"):
        tree.add_turn(2, action="more")
    with pytest.raises(ValueError, match="not a node"):
        tree.add_turn(99)
    with pytest.raises(ValueError, match="equal lengths"):
        tree.add_turn(0, token_ids=[1, 2], mask=[1])
    with pytest.raises(ValueError, match="finite"):
        tree.add_turn(0, reward=float("nan"))


def test_jsonl_round_trip_is_lossless(tmp_path):
    tree = branched_tree()
    tree.nodes[3].predicted = 0.123456789012345678
    tree.nodes[3].budget = 3
    tree.nodes[1].logprobs = [-1 / 3]
    tree.nodes[1].token_ids = [7]
    tree.nodes[1].mask = [1]
    tree.meta["step"] = 4
    path = tmp_path / "trees.jsonl"
    write_jsonl([tree, tree], path)
    loaded = read_jsonl(path)
    assert len(loaded) == 2
    assert loaded[0].to_dict() == tree.to_dict()
    assert loaded[0].nodes[1].logprobs[0] == -1 / 3
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) >= {"task_id", "prompt", "nodes"}
    assert first["nodes"][0]["reward"] is None and first["nodes"][2]["reward"] == 1.0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("parent", 5, "expected a smaller id"), ("reward", float("nan"), "non-finite reward"), ("mask", [2], "mask entries")],
)
def test_reading_a_corrupt_tree_names_the_line_and_the_fault(tmp_path, field, value, message):
    tree = branched_tree().to_dict()
    tree["nodes"][2][field] = value
    if field == "mask":
        tree["nodes"][2].update(token_ids=[1], logprobs=[0.0])
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(tree) + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:1: .*{message}"):
        read_jsonl(path)


def uniform_tree(task_id: str, rewards: list[float]) -> RolloutTree:
    tree = RolloutTree.new(task_id, task_id)
    for reward in rewards:
        chain(tree, 0, 2, reward)
    return tree


def test_effective_ratio_counts_only_prompts_with_rollouts():
    trees = [
        uniform_tree("a", [1, 0]),
        uniform_tree("b", [1, 1, 1]),
        uniform_tree("c", [0, 0]),
        RolloutTree.new("filtered", "no rollouts"),
    ]
    assert effective_ratio(trees) == pytest.approx(1 / 3)
    assert effective_ratio([]) == 0.0
    # leaves: a=2 (mixed), b=3, c=2 -> 2/7 of the budget sits in a mixed group
    assert mixed_budget_share(trees) == pytest.approx(2 / 7)
    metrics = tree_metrics(trees)
    assert metrics["tree/effective_per_candidate"] == pytest.approx(1 / 4)
    assert metrics["tree/leaves_per_prompt"] == pytest.approx(7 / 3)
    assert metrics["tree/leaves"] == 7
    # every rollout writes 2 turns of 2 policy tokens (the third token is an observation): 28 tokens
    assert metrics["tree/tokens_generated"] == 28
    assert metrics["tree/mixed_leaves_per_ktoken"] == pytest.approx(2 / 0.028)  # a's 2 leaves
    assert metrics["tree/mixed_prompts_per_ktoken"] == pytest.approx(1 / 0.028)  # a


def test_the_budget_that_cannot_teach_is_split_by_outcome_and_its_largest_prompt_named():
    trees = [
        uniform_tree("mixed", [1, 0, 0, 0, 0, 0, 0, 0, 0, 0]),  # 10 leaves, but mixed: not counted as unmixed
        uniform_tree("solved", [1, 1, 1]),
        uniform_tree("failed", [0] * 6),  # the allocator kept betting: 0 for 6
        uniform_tree("pair", [0, 0]),
        RolloutTree.new("filtered", "no rollouts"),
    ]
    failed, solved, most = agreeing_budget(trees)
    assert (failed, solved, most) == (pytest.approx(8 / 21), pytest.approx(3 / 21), 6)
    metrics = tree_metrics(trees)
    assert metrics["tree/failed_budget_share"] + metrics["tree/solved_budget_share"] + metrics["tree/mixed_budget_share"] == pytest.approx(1.0)
    assert metrics["tree/most_leaves_unmixed"] == 6
    assert agreeing_budget([uniform_tree("m", [1, 0])]) == (0.0, 0.0, 0)
    assert agreeing_budget([RolloutTree.new("f", "none")]) == (0.0, 0.0, 0)


def test_anchor_mixed_ratio_and_branch_depth():
    tree = branched_tree()  # anchors: root (mixed), node 3 (leaves 0, 1, 0: mixed)
    same = uniform_tree("s", [1, 1])  # anchor: root, not mixed
    assert anchor_mixed_ratio([tree, same]) == pytest.approx(2 / 3)
    metrics = tree_metrics([tree, same])
    assert metrics["tree/branch_depth/mean"] == 1.0 and metrics["tree/branch_points"] == 1


def test_backup_matches_mean_leaf_reward_on_random_trees():
    rng = np.random.default_rng(0)
    for _ in range(50):
        tree = RolloutTree.new("r", "r")
        open_nodes = [0]
        for _ in range(rng.integers(1, 30)):
            parent = int(rng.choice(open_nodes))
            finish = rng.random() < 0.4
            node = tree.add_turn(parent, reward=float(rng.integers(0, 2)) if finish else None)
            if not finish:
                open_nodes.append(node)
        backup = tree.backup()
        for node in tree.nodes:
            below = [n for n in tree.leaves() if node.id in tree.path(int(n))]
            assert backup.counts[node.id] == len(below)
            if below:
                assert backup.values[node.id] == pytest.approx(np.mean([tree.nodes[n].reward for n in below]))


def test_interleaved_growth_records_where_each_rollout_started():
    """A collector that grows several rollouts at once says which turn starts a rollout; the order of
    children (which an interleaved collector does not control) no longer decides it."""
    tree = RolloutTree.new("t", "q")
    a1 = tree.add_turn(0, thought="a1", starts_rollout=True)
    tree.add_turn(0, thought="b1", reward=0.0, starts_rollout=True)
    c = tree.add_turn(a1, thought="c", reward=1.0, starts_rollout=True)  # a continuation from a1 comes first
    a2 = tree.add_turn(a1, thought="a2", reward=0.0, starts_rollout=False)  # then rollout a goes on
    assert tree.nodes[c].rollout_start == a1 and tree.nodes[a2].rollout_start == 0
    assert tree.nodes[a1].children == [c, a2]  # child order says the opposite: the field is what counts
    again = RolloutTree.from_dict(json.loads(json.dumps(tree.to_dict())))
    assert [n.rollout_start for n in again.nodes] == [0, 0, 0, a1, 0]


def test_rollout_start_must_be_the_parent_or_the_parents_start():
    tree = RolloutTree.new("t", "q")
    one = tree.add_turn(0, thought="x")
    two = tree.add_turn(one, thought="y", reward=1.0)
    data = tree.to_dict()
    data["nodes"][two]["rollout_start"] = 5
    with pytest.raises(ValueError, match="node 2 has rollout_start 5, expected its parent 1"):
        RolloutTree.from_dict(data)


def test_files_written_before_rollout_start_existed_read_it_from_the_shape():
    tree = RolloutTree.new("t", "q")
    one = tree.add_turn(0, thought="x")
    tree.add_turn(one, thought="y", reward=1.0)
    tree.add_turn(one, thought="z", reward=0.0)  # a continuation branched from node 1
    data = tree.to_dict()
    for node in data["nodes"]:
        del node["rollout_start"]
    assert [n.rollout_start for n in RolloutTree.from_dict(data).nodes] == [0, 0, 0, 1]


def test_subtree_rewards_is_one_sweep_of_every_node_s_leaves():
    tree = RolloutTree.new("t", "q")
    one = tree.add_turn(0)
    tree.add_turn(one, reward=1.0)
    tree.add_turn(one, reward=0.0)
    tree.add_turn(0, reward=1.0)
    tree.add_turn(0)  # unfinished: no leaf below it
    stats = subtree_rewards(tree)
    np.testing.assert_array_equal(stats.counts, [3, 2, 1, 1, 1, 0])
    np.testing.assert_array_equal(stats.sums, [2.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(stats.mixed, [True, True, False, False, False, False])
    assert stats.low[5] == np.inf and stats.high[5] == -np.inf
