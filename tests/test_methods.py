"""The method registry: one name, one meaning, read by every consumer."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest

from trace_rl.planning.methods import METHODS, MethodName, get_method

REPO = Path(__file__).resolve().parents[1]
NAMES = ("grpo", "prompt_only", "knapsack", "pcl", "random_tree", "dapo", "brace", "trace_stage1", "trace_stage2", "trace")


def test_the_registry_holds_every_method_and_the_config_type_lists_exactly_them():
    assert tuple(METHODS) == NAMES
    assert typing.get_args(MethodName) == tuple(METHODS)
    for name, spec in METHODS.items():
        assert spec.name == name and spec.description and spec.source
        assert get_method(name) is spec


def test_an_unknown_method_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match=r"unknown method 'tarce'; did you mean 'trace'\? \(known: grpo, prompt_only, knapsack"):
        get_method("tarce")


def test_each_method_means_what_its_source_says():
    assert get_method("grpo").stage2 is None and not get_method("grpo").uses_values
    assert get_method("prompt_only").predictor == "prompt_history"  # TRACE's Stage 1 on each prompt's own history
    assert get_method("knapsack").predictor == "knapsack_history"
    assert get_method("trace_stage1").predictor == "shared" and get_method("trace_stage1").stage2 is None
    assert get_method("dapo").resample == "dapo" and get_method("dapo").estimator == "grpo"
    assert get_method("random_tree").estimator == "tree_grpo" and not get_method("random_tree").uses_values
    trace = get_method("trace")
    assert trace.stage1.__name__ == "exact_stage1" and trace.stage2.__name__ == "expand_stage2" and trace.estimator == "trace"


def test_methods_command_lists_the_registry(capsys):
    from trace_rl.cli import main

    assert main(["methods"]) == 0
    listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["methods"]
    assert [m["name"] for m in listed] == list(NAMES)
    assert listed[2]["stage1"] == "knapsack" and "Knapsack RL" in listed[2]["source"]


@pytest.mark.parametrize("method", NAMES)
def test_rollout_command_spends_exactly_the_budget_for_every_method(method, tmp_path, capsys, monkeypatch):
    from trace_rl.cli import main

    monkeypatch.setenv("TRACE_RL_CACHE", str(tmp_path.parent / "shared-cache"))  # one smoke warm start for all
    out = tmp_path / "trees.jsonl"
    assert main(["rollout", "--config", str(REPO / "configs/smoke.yaml"), "--out", str(out), f"rollout.method={method}"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["budget"] == result["leaves"] == 16 and result["tree/leaves"] == 16
    assert out.is_file()


def test_training_on_a_server_engine_without_weight_sync_is_refused_before_any_work(tmp_path, capsys):
    from trace_rl.cli import main

    code = main([
        "train", "--config", str(REPO / "configs/smoke.yaml"), "--out", str(tmp_path / "run"),
        "engine.name=openai", "engine.server_urls=[http://127.0.0.1:9]",
    ])
    assert code == 2
    err = capsys.readouterr().err
    assert "engine.name=openai trains only with a weight push" in err and "engine.weight_sync" in err
    assert not (tmp_path / "run").exists()  # refused before the folder, the model or the tasks
