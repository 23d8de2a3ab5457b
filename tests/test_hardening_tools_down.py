"""Tools that say when they are down (issue 43, class 4): a retrieval server that does not answer stops a
run before any work, naming its URL, and one that dies mid-run shows in every step's metrics and the
report as the share of tool calls that found it unavailable."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trace_rl.agent.agents import OracleAgent, run_episode
from trace_rl.agent.env import ToolEnv
from trace_rl.agent.protocol import get_format
from trace_rl.agent.tasks import load_taskset
from trace_rl.agent.tools.retrieval_server import RetrievalServer
from trace_rl.core.tree import RolloutTree
from trace_rl.infra.config import ConfigError, TaskConfig
from trace_rl.planning.metrics import rollout_metrics, tool_metrics
from trace_rl.run import check_search_server

REPO = Path(__file__).resolve().parents[1]
DEAD = "http://127.0.0.1:9/retrieve"
"""The discard port: nothing listens there, so a connection is refused at once."""


def test_a_dead_retrieval_server_is_refused_before_any_work_naming_its_url():
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"task.search_url='http://127.0.0.1:9/retrieve' does not work: cannot reach retrieval server"):
        check_search_server(TaskConfig(search_url=DEAD))
    assert time.monotonic() - started < 30, "a refused connection must not wait out the retries' timeouts"


def test_a_live_retrieval_server_passes_and_none_needs_no_check():
    taskset = load_taskset("multihop", num_tasks=4)
    with RetrievalServer(taskset.corpus) as server:
        check_search_server(TaskConfig(search_url=server.url))
    check_search_server(TaskConfig(search_url=None))


def test_train_with_a_dead_server_exits_2_in_one_line_before_the_warm_start(tmp_path):
    cache = tmp_path / "cache"
    command = [sys.executable, "-m", "trace_rl", "train", "--config", str(REPO / "configs" / "smoke.yaml"),
               "--out", str(tmp_path / "run"), f"task.search_url={DEAD}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TRACE_RL_CACHE": str(cache), "PYTHONPATH": str(REPO / "src")})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"trace-rl train: task.search_url='{DEAD}' does not work")
    assert not cache.exists() or not list(cache.iterdir()), "no warm start was trained on failed searches"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def oracle_trees(env: ToolEnv, taskset, tasks) -> list[RolloutTree]:
    """One tree per task, holding the oracle's episode as the collector records it (a turn's StepInfo
    and whether it was cut by the turn limit)."""
    agent = OracleAgent(taskset.oracle, get_format("tag"))
    trees = []
    for task in tasks:
        episode = run_episode(env, task, agent)
        tree, parent = RolloutTree.new(task.task_id, episode.prompt), 0
        for step in episode.steps:
            info = {**step.info.to_dict(), "truncated": step.truncated}
            parent = tree.add_turn(parent, info=info, reward=step.reward if step.done else None)
        trees.append(tree)
    return trees


def test_a_server_that_dies_mid_run_shows_as_every_tool_call_unavailable():
    taskset = load_taskset("multihop", num_tasks=6)
    with RetrievalServer(taskset.corpus) as server:
        env = ToolEnv.for_taskset(taskset, search_url=server.url, max_turns=6, topk=2)
        before = oracle_trees(env, taskset, taskset.tasks[:3])
    after = oracle_trees(env, taskset, taskset.tasks[3:])  # the server has stopped

    alive = tool_metrics(before)
    calls = sum(1 for tree in before for node in tree.nodes[1:] if node.info["call"]["name"] == "search")
    assert alive == {"tool/calls": float(calls), "tool/error_rate": 0.0, "tool/unavailable_rate": 0.0}
    assert rollout_metrics(before)["critic/score/mean"] == 1.0

    dead = tool_metrics(after)
    assert dead["tool/calls"] >= 3 and dead["tool/unavailable_rate"] == dead["tool/error_rate"] == 1.0
    assert rollout_metrics(after)["tool/unavailable_rate"] == 1.0


def test_answers_malformed_turns_and_a_last_turn_whose_tool_never_ran_are_not_tool_calls():
    tree = RolloutTree.new("t", "prompt")
    search = {"name": "search", "arguments": {"query": "x"}}
    first = tree.add_turn(0, info={"call": search, "tool_error": None})
    bad = tree.add_turn(first, info={"call": None, "parse_error": "no action", "tool_error": None})
    failed = tree.add_turn(bad, info={"call": search, "tool_error": "arguments"})
    tree.add_turn(failed, info={"call": search, "tool_error": None, "truncated": True}, reward=0.0)
    tree.add_turn(first, info={"call": {"name": "answer", "arguments": {"answer": "y"}}, "answer": "y"}, reward=1.0)
    assert tool_metrics([tree]) == {"tool/calls": 2.0, "tool/error_rate": 0.5, "tool/unavailable_rate": 0.0}
    assert tool_metrics([RolloutTree.new("u", "prompt")]) == {}
