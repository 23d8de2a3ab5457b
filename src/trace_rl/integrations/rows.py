"""One row per leaf: how a foreign trainer (TRL, verl) sees a batch of TRACE trees.

Both TRL and verl train on flat rows of `prompt + completion` tokens with a per-token loss mask, so
a tree is handed over as one row per leaf (trees in order, leaves by id):

- `prompt_ids` = the root's tokens; `completion_ids` = every token after them on the leaf's path
  (policy turns and observations); `logprobs` = the behaviour log-probs (0 on observations);
- `train_mask` is 1 exactly on the tokens the row trains: the policy tokens of the nodes it owns
  (`trace_rl.training.sequences.tree_sequences`: a node belongs to the row of the first leaf below it).
  It is 0 on observations and on the copies of a shared prefix that another row owns, so each node's
  tokens enter a token-mean loss once, as in trace-rl's own update (the `trace` estimator gives every
  node weight 1), not once per leaf below the node;
- `ADVANTAGES`: the node's tree advantage on the tokens the row trains, 0 elsewhere;
- `REWARD`: the leaf's reward; `LEAF`: the leaf's node id in its tree.

An estimator that counts a shared node once per leaf (`grpo`, `treerl`, `tree_grpo`) needs a
per-token weight neither trainer's loss has, and `tree_rows` refuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from trace_rl.core.advantage import NodeAdvantages
from trace_rl.core.tree import RolloutTree
from trace_rl.training.sequences import tree_sequences

ADVANTAGES = "trace_advantages"
"""Row field: the tree advantage of every completion token (0 where the row does not train it)."""
REWARD = "trace_reward"
"""Row field: the reward of the row's leaf."""
LEAF = "trace_leaf"
"""Row field: the id of the row's leaf in its prompt's tree."""


def tree_rows(trees: Sequence[RolloutTree], advantages: Sequence[NodeAdvantages]) -> dict[str, list[Any]]:
    """Rows of a batch: one per leaf, trees in order, leaves by id (see the module docstring).

    Raises ValueError when the estimator counts a node other than 0 or 1 times (`grpo`, `treerl` and
    `tree_grpo` count a shared node once per leaf below it): neither TRL's loss nor verl's has a per-token weight, so a
    node's tokens are trained once (in the row that owns it) or not at all.
    """
    sequences = {(s.tree, s.nodes[-1]): s for s in tree_sequences(trees, advantages)}
    rows: dict[str, list[Any]] = {key: [] for key in ("prompt_ids", "completion_ids", "logprobs", "train_mask", ADVANTAGES, REWARD, LEAF)}
    for index, (tree, node_adv) in enumerate(zip(trees, advantages)):
        if not np.isin(node_adv.weight, (0.0, 1.0)).all():
            raise ValueError(f"tree {tree.task_id!r}: node weights {sorted(set(node_adv.weight.tolist()))}; rows can train a node 0 or 1 times")
        start = len(tree.root.token_ids)
        for leaf in tree.leaves().tolist():
            path = [tree.nodes[i] for i in tree.path(leaf)[1:]]
            completion = [token for node in path for token in node.token_ids]
            seq = sequences.get((index, leaf))  # None: the row trains nothing (every node owned elsewhere or untrained)
            rows["prompt_ids"].append(list(tree.root.token_ids))
            rows["completion_ids"].append(completion)
            rows["logprobs"].append([logprob for node in path for logprob in node.logprobs])
            rows["train_mask"].append([int(w > 0) for w in seq.weights[start:]] if seq else [0] * len(completion))
            rows[ADVANTAGES].append(list(seq.advantages[start:]) if seq else [0.0] * len(completion))
            rows[REWARD].append(float(tree.nodes[leaf].reward))
            rows[LEAF].append(leaf)
    return rows
