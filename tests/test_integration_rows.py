"""Rows of TRACE trees for foreign trainers (`trace_rl.integrations.rows`, shared by TRL and verl)."""

import numpy as np
import pytest

from trace_rl.core.advantage import get_estimator
from trace_rl.core.tree import RolloutTree
from trace_rl.integrations.rows import ADVANTAGES, LEAF, REWARD, tree_rows


def test_tree_rows_train_a_shared_prefix_in_the_first_row_only_and_mask_observations():
    """Root [1, 2] -> P (policy 3, 4, observation 5) -> leaves A (6, reward 1) and B (7, 8, reward 0)."""
    tree = RolloutTree.new("t", "q", [1, 2])
    p = tree.add_turn(0, token_ids=[3, 4, 5], mask=[1, 1, 0], logprobs=[-0.1, -0.2, 0.0])
    tree.add_turn(p, token_ids=[6], logprobs=[-0.3], reward=1.0)
    tree.add_turn(p, token_ids=[7, 8], logprobs=[-0.4, -0.5], reward=0.0, starts_rollout=True)
    rows = tree_rows([tree], get_estimator("trace")([tree]))
    # V(P) = 0.5 = V(root): P's advantage is 0; the leaves contrast at P (sigma = 0.7071) and at the root
    a = (0.5 / (np.sqrt(0.5) + 1e-6)) * 2
    assert rows["prompt_ids"] == [[1, 2], [1, 2]]
    assert rows["completion_ids"] == [[3, 4, 5, 6], [3, 4, 5, 7, 8]]
    assert rows["logprobs"] == [[-0.1, -0.2, 0.0, -0.3], [-0.1, -0.2, 0.0, -0.4, -0.5]]
    assert rows["train_mask"] == [[1, 1, 0, 1], [0, 0, 0, 1, 1]]  # P trained once, in A's row; its observation never
    np.testing.assert_allclose(rows[ADVANTAGES][0], [0.0, 0.0, 0.0, a])
    np.testing.assert_allclose(rows[ADVANTAGES][1], [0.0, 0.0, 0.0, -a, -a])
    assert rows[REWARD] == [1.0, 0.0]
    assert rows[LEAF] == [2, 3]
    with pytest.raises(ValueError, match="rows can train a node 0 or 1 times"):
        tree_rows([tree], get_estimator("grpo")([tree]))  # grpo counts P once per leaf below it
