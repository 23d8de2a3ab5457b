"""Rollout trees: one prompt, ReAct turns as nodes, terminal rewards on leaves.

A node holds one turn (thought, action, observation) with its token ids, a mask telling the
policy's tokens (1, trained) from observation and prompt tokens (0, never trained), and the
behaviour policy's log-probs. Node ids are dense and a child's id is always larger than its
parent's, so one reverse sweep computes every backup value.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Turn:
    """The text of one ReAct turn, as the predictor and the policy see it."""

    thought: str = ""
    action: str = ""
    observation: str = ""


@dataclass(frozen=True)
class History:
    """Everything before a node's continuation: the prompt and the turns taken so far.

    The root's history has no turns. This is the predictor's input.
    """

    prompt: str
    turns: tuple[Turn, ...] = ()
    task_id: str = ""

    @property
    def depth(self) -> int:
        return len(self.turns)


@dataclass
class Node:
    id: int
    parent: int | None
    depth: int
    thought: str = ""
    action: str = ""
    observation: str = ""
    token_ids: list[int] = field(default_factory=list)
    """This node's tokens in order: the policy's turn, then the observation (root: the prompt)."""
    mask: list[int] = field(default_factory=list)
    """1 for tokens the policy wrote (trained), 0 for prompt and observation tokens."""
    logprobs: list[float] = field(default_factory=list)
    """Behaviour policy log-prob of each token; 0.0 where mask is 0."""
    reward: float | None = None
    """Terminal reward; set on leaves only."""
    children: list[int] = field(default_factory=list)
    predicted: float | None = None
    """The predictor's success estimate here when the allocator looked at this node."""
    budget: int = 0
    """Rollouts the allocator gave this node (root: Stage 1's m_i; prefix: Stage 2's k)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form facts about the turn (finish reason, parse error, tool timing)."""

    @property
    def is_terminal(self) -> bool:
        return self.reward is not None

    def turn(self) -> Turn:
        return Turn(self.thought, self.action, self.observation)


@dataclass(frozen=True)
class Backup:
    """Tree backups: `values[i]` is the mean leaf reward under node i, `counts[i]` the leaves under it.

    V̂(leaf) = r and V̂(y) = Σ_c n_c V̂(c) / n_y, which is exactly the mean reward of y's leaves.
    Nodes with no finished leaf below them have count 0 and value NaN.
    """

    values: np.ndarray  # (num_nodes,) float64
    counts: np.ndarray  # (num_nodes,) int64


@dataclass
class RolloutTree:
    """All rollouts of one prompt, sharing prefixes. `nodes[0]` is the root (the prompt)."""

    task_id: str
    prompt: str
    nodes: list[Node]
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def new(
        cls,
        task_id: str,
        prompt: str,
        prompt_token_ids: Sequence[int] = (),
        meta: dict[str, Any] | None = None,
    ) -> RolloutTree:
        ids = [int(t) for t in prompt_token_ids]
        root = Node(id=0, parent=None, depth=0, token_ids=ids, mask=[0] * len(ids), logprobs=[0.0] * len(ids))
        return cls(task_id=task_id, prompt=prompt, nodes=[root], meta=dict(meta or {}))

    @property
    def root(self) -> Node:
        return self.nodes[0]

    def add_turn(
        self,
        parent: int,
        *,
        thought: str = "",
        action: str = "",
        observation: str = "",
        token_ids: Sequence[int] = (),
        mask: Sequence[int] | None = None,
        logprobs: Sequence[float] | None = None,
        reward: float | None = None,
        info: dict[str, Any] | None = None,
    ) -> int:
        """Append a turn below `parent` and return its id.

        Appending to a node that already has children is branching: rollouts continued from an
        intermediate prefix are added this way. `mask` defaults to all policy tokens.
        """
        if not 0 <= parent < len(self.nodes):
            raise ValueError(f"parent {parent} is not a node of tree {self.task_id!r} ({len(self.nodes)} nodes)")
        if self.nodes[parent].is_terminal:
            raise ValueError(f"node {parent} of tree {self.task_id!r} is terminal (has a reward); it cannot have children")
        ids = [int(t) for t in token_ids]
        mask_list = [1] * len(ids) if mask is None else [int(m) for m in mask]
        lp_list = [0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs]
        if len(mask_list) != len(ids) or len(lp_list) != len(ids):
            raise ValueError(
                f"token_ids, mask and logprobs must have equal lengths, got {len(ids)}, {len(mask_list)}, {len(lp_list)}"
            )
        if any(m not in (0, 1) for m in mask_list):
            raise ValueError("mask entries must be 0 (observation/prompt) or 1 (policy)")
        if reward is not None:
            reward = float(reward)
            if not np.isfinite(reward):
                raise ValueError(f"reward must be finite, got {reward!r}")
        node_id = len(self.nodes)
        self.nodes.append(
            Node(
                id=node_id,
                parent=parent,
                depth=self.nodes[parent].depth + 1,
                thought=thought,
                action=action,
                observation=observation,
                token_ids=ids,
                mask=mask_list,
                logprobs=lp_list,
                reward=reward,
                info=dict(info or {}),
            )
        )
        self.nodes[parent].children.append(node_id)
        return node_id

    def path(self, node_id: int) -> list[int]:
        """Node ids from the root down to `node_id`, inclusive."""
        ids = []
        current: int | None = node_id
        while current is not None:
            ids.append(current)
            current = self.nodes[current].parent
        return ids[::-1]

    def history(self, node_id: int) -> History:
        """The predictor's view of the prefix ending at `node_id` (root: no turns)."""
        turns = tuple(self.nodes[i].turn() for i in self.path(node_id)[1:])
        return History(prompt=self.prompt, turns=turns, task_id=self.task_id)

    def leaves(self) -> np.ndarray:
        """Ids of finished rollouts' last nodes (terminal, with a reward), ascending."""
        return np.array([n.id for n in self.nodes if n.is_terminal], dtype=np.int64)

    def leaf_rewards(self) -> np.ndarray:
        return np.array([n.reward for n in self.nodes if n.is_terminal], dtype=np.float64)

    def anchors(self) -> np.ndarray:
        """Ids of branch points: nodes with at least two children (the root included)."""
        return np.array([n.id for n in self.nodes if len(n.children) >= 2], dtype=np.int64)

    def parents(self) -> np.ndarray:
        """Parent id of every node; -1 for the root."""
        return np.array([-1 if n.parent is None else n.parent for n in self.nodes], dtype=np.int64)

    def backup(self) -> Backup:
        """Backup values and leaf counts of every node in one reverse sweep over the ids."""
        size = len(self.nodes)
        sums = np.zeros(size, dtype=np.float64)
        counts = np.zeros(size, dtype=np.int64)
        for node in self.nodes:
            if node.is_terminal:
                sums[node.id] = node.reward
                counts[node.id] = 1
        for node in reversed(self.nodes[1:]):  # children have larger ids than parents
            sums[node.parent] += sums[node.id]
            counts[node.parent] += counts[node.id]
        with np.errstate(invalid="ignore", divide="ignore"):
            values = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        return Backup(values=values, counts=counts)

    def is_mixed(self) -> bool:
        """Whether the leaves disagree: at least two different rewards (a success and a failure)."""
        rewards = self.leaf_rewards()
        return rewards.size > 0 and bool(rewards.max() > rewards.min())

    def validate(self) -> None:
        """Raise ValueError if the structure is inconsistent (used after loading untrusted files)."""
        if not self.nodes or self.nodes[0].parent is not None or self.nodes[0].id != 0:
            raise ValueError(f"tree {self.task_id!r}: nodes[0] must be the root with id 0 and no parent")
        for index, node in enumerate(self.nodes):
            if node.id != index:
                raise ValueError(f"tree {self.task_id!r}: node at position {index} has id {node.id}")
            if index and not (node.parent is not None and 0 <= node.parent < index):
                raise ValueError(f"tree {self.task_id!r}: node {index} has parent {node.parent}, expected a smaller id")
            if index and node.depth != self.nodes[node.parent].depth + 1:
                raise ValueError(f"tree {self.task_id!r}: node {index} has depth {node.depth}")
            if node.is_terminal and node.children:
                raise ValueError(f"tree {self.task_id!r}: terminal node {index} has children")
            if not (len(node.token_ids) == len(node.mask) == len(node.logprobs)):
                raise ValueError(f"tree {self.task_id!r}: node {index} token_ids/mask/logprobs lengths differ")
            if any(m not in (0, 1) for m in node.mask):
                raise ValueError(f"tree {self.task_id!r}: node {index} has mask entries other than 0 and 1")
            if node.reward is not None and not np.isfinite(node.reward):
                raise ValueError(f"tree {self.task_id!r}: node {index} has a non-finite reward {node.reward!r}")
        for node in self.nodes[1:]:
            if node.id not in self.nodes[node.parent].children:
                raise ValueError(f"tree {self.task_id!r}: node {node.id} missing from its parent's children")

    def to_dict(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "prompt": self.prompt, "nodes": [asdict(n) for n in self.nodes], "meta": self.meta}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutTree:
        nodes = [Node(**node) for node in data["nodes"]]
        tree = cls(task_id=data["task_id"], prompt=data["prompt"], nodes=nodes, meta=dict(data.get("meta", {})))
        tree.validate()
        return tree


def write_jsonl(trees: Iterable[RolloutTree], path: str | Path) -> None:
    """One tree per line. Floats are written with repr precision, so reading back is lossless."""
    with open(path, "w", encoding="utf-8") as handle:
        for tree in trees:
            handle.write(json.dumps(tree.to_dict(), ensure_ascii=False, allow_nan=False) + "\n")


def read_jsonl(path: str | Path) -> list[RolloutTree]:
    trees = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                trees.append(RolloutTree.from_dict(json.loads(line)))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_number}: not a rollout tree: {exc}") from exc
    return trees


# ---------------------------------------------------------------- batch metrics


def effective_ratio(trees: Sequence[RolloutTree]) -> float:
    """Share of prompts that got rollouts whose leaves are mixed (Knapsack-RL's effective prompt ratio)."""
    sampled = [t for t in trees if t.leaves().size]
    return float(np.mean([t.is_mixed() for t in sampled])) if sampled else 0.0


def anchor_mixed_ratio(trees: Sequence[RolloutTree]) -> float:
    """Share of anchors (nodes with ≥2 children, roots included) whose descendant leaves are mixed."""
    mixed, total = 0, 0
    for tree in trees:
        anchors = tree.anchors()
        if not anchors.size:
            continue
        rewards = np.full(len(tree.nodes), np.nan)
        for node in tree.nodes:
            if node.is_terminal:
                rewards[node.id] = node.reward
        low, high = _subtree_min_max(tree, rewards)
        mixed += int(np.sum(high[anchors] > low[anchors]))
        total += anchors.size
    return mixed / total if total else 0.0


def _subtree_min_max(tree: RolloutTree, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    low = np.where(np.isnan(rewards), np.inf, rewards)
    high = np.where(np.isnan(rewards), -np.inf, rewards)
    for node in reversed(tree.nodes[1:]):
        low[node.parent] = min(low[node.parent], low[node.id])
        high[node.parent] = max(high[node.parent], high[node.id])
    return low, high


def mixed_budget_share(trees: Sequence[RolloutTree]) -> float:
    """Share of all leaves (the budget) that belong to a prompt whose leaves are mixed.

    A mixed anchor lies inside a mixed prompt, so this is also the share of rollouts that sit in a
    mixed group or anchor: the part of the budget that can yield a non-zero GRPO-style gradient.
    """
    leaves = np.array([t.leaves().size for t in trees], dtype=np.int64)
    mixed = np.array([t.is_mixed() for t in trees], dtype=bool)
    total = int(leaves.sum())
    return float(leaves[mixed].sum() / total) if total else 0.0


def tree_metrics(trees: Sequence[RolloutTree]) -> dict[str, float]:
    """The `tree/*` metrics of one batch."""
    leaves = np.array([t.leaves().size for t in trees], dtype=np.float64)
    sampled = leaves > 0
    branch_depths = [t.nodes[a].depth for t in trees for a in t.anchors() if a != 0]
    mixed = np.array([t.is_mixed() for t in trees], dtype=bool)
    return {
        "tree/effective_ratio": effective_ratio(trees),
        "tree/effective_per_candidate": float(mixed.mean()) if len(trees) else 0.0,
        "tree/mixed_budget_share": mixed_budget_share(trees),
        "tree/anchor_mixed_ratio": anchor_mixed_ratio(trees),
        "tree/leaves_per_prompt": float(leaves[sampled].mean()) if sampled.any() else 0.0,
        "tree/prompts_sampled": float(sampled.sum()),
        "tree/leaves": float(leaves.sum()),
        "tree/branch_depth/mean": float(np.mean(branch_depths)) if branch_depths else 0.0,
        "tree/branch_points": float(len(branch_depths)),
    }
