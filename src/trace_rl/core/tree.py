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
    stage2_value: float | None = None
    """The estimate Stage 2 allocated with here when it was not `predicted` (`rollout.stage2_evidence`:
    the posterior on the batch's bare rollouts, `trace_rl.planning.evidence`)."""
    budget: int = 0
    """Rollouts the allocator gave this node (root: Stage 1's m_i; prefix: Stage 2's k)."""
    rollout_start: int = 0
    """Id of the node where the rollout that made this node began (0: the root; the root itself: 0).
    Recorded when the turn is added, so no reader has to guess it from the order of children."""
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
        starts_rollout: bool | None = None,
    ) -> int:
        """Append a turn below `parent` and return its id.

        `starts_rollout` says whether this turn begins a new rollout at `parent` (a bare rollout at
        the root, or a continuation branched from an intermediate prefix) or continues the rollout
        that made `parent`; the answer is stored as `rollout_start`. Collectors that grow several
        rollouts at once must pass it. None applies the sequential rule: a turn continues its
        parent's rollout when the parent is not the root and has no child yet. `mask` defaults to
        all policy tokens.
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
        if starts_rollout is None:
            starts_rollout = parent == 0 or bool(self.nodes[parent].children)
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
                rollout_start=parent if starts_rollout else self.nodes[parent].rollout_start,
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
        stats = subtree_rewards(self)
        with np.errstate(invalid="ignore", divide="ignore"):
            values = np.where(stats.counts > 0, stats.sums / np.maximum(stats.counts, 1), np.nan)
        return Backup(values=values, counts=stats.counts)

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
            if index and node.rollout_start not in (node.parent, self.nodes[node.parent].rollout_start):
                raise ValueError(
                    f"tree {self.task_id!r}: node {index} has rollout_start {node.rollout_start}, expected its parent "
                    f"{node.parent} (a new rollout) or its parent's rollout_start {self.nodes[node.parent].rollout_start}"
                )
        for node in self.nodes[1:]:
            if node.id not in self.nodes[node.parent].children:
                raise ValueError(f"tree {self.task_id!r}: node {node.id} missing from its parent's children")

    def to_dict(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "prompt": self.prompt, "nodes": [asdict(n) for n in self.nodes], "meta": self.meta}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutTree:
        nodes = [Node(**node) for node in data["nodes"]]
        if not any("rollout_start" in node for node in data["nodes"]):  # written before the field existed
            for node in nodes[1:]:
                parent = nodes[node.parent] if isinstance(node.parent, int) and 0 <= node.parent < node.id else None
                if parent is not None:
                    continues = node.parent != 0 and parent.children[:1] == [node.id]
                    node.rollout_start = parent.rollout_start if continues else node.parent
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


# ---------------------------------------------------------------- subtree sweep


@dataclass(frozen=True)
class SubtreeRewards:
    """Per node, what its finished leaves hold (the node included when it is a leaf): one reverse sweep.

    Every reader of "the leaves below a node" (backups, mixed anchors, advantages, the viewer) uses
    this one sweep. `low` / `high` are +inf / -inf where no leaf lies below.
    """

    counts: np.ndarray  # (N,) int64: finished leaves below
    sums: np.ndarray  # (N,) float64: sum of their rewards
    squares: np.ndarray  # (N,) float64: sum of their squared rewards
    low: np.ndarray  # (N,) float64: smallest reward below
    high: np.ndarray  # (N,) float64: largest reward below

    @property
    def mixed(self) -> np.ndarray:
        """Nodes whose leaves hold two different rewards (a success and a failure)."""
        return self.high > self.low


def subtree_rewards(tree: RolloutTree) -> SubtreeRewards:
    size = len(tree.nodes)
    counts = np.zeros(size, dtype=np.int64)
    sums = np.zeros(size, dtype=np.float64)
    squares = np.zeros(size, dtype=np.float64)
    low = np.full(size, np.inf)
    high = np.full(size, -np.inf)
    for node in tree.nodes:
        if node.is_terminal:
            r = float(node.reward)
            counts[node.id], sums[node.id], squares[node.id], low[node.id], high[node.id] = 1, r, r * r, r, r
    for node in reversed(tree.nodes[1:]):  # children have larger ids than parents
        p = node.parent
        counts[p] += counts[node.id]
        sums[p] += sums[node.id]
        squares[p] += squares[node.id]
        low[p] = min(low[p], low[node.id])
        high[p] = max(high[p], high[node.id])
    return SubtreeRewards(counts=counts, sums=sums, squares=squares, low=low, high=high)
