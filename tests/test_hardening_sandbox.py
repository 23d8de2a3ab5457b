"""The sandbox where bubblewrap is missing (simulated with a PATH that has no `bwrap`): the documented
fallback is reachable from the run config and from `trace-rl tasks`, and a machine that cannot run
model code gets a one-line error saying what to do, before any work. Issue 12, defect class 7."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from trace_rl.agent import sandbox
from trace_rl.agent.sandbox import SandboxUnavailable
from trace_rl.cli import main
from trace_rl.infra.config import ConfigError, load_config
from trace_rl.run import RunConfig

REPO = Path(__file__).resolve().parents[1]
ROOT = os.geteuid() == 0


@pytest.fixture
def no_bubblewrap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """`bwrap` is not on PATH; the cached probe is forgotten before and after, and the run's model
    cache points at an empty folder (nothing may be built there)."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setenv("TRACE_RL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sandbox, "_FALLBACK_WARNED", False)
    sandbox._bwrap_problem.cache_clear()
    yield
    sandbox._bwrap_problem.cache_clear()


def fallback_interpreter() -> str:
    """An interpreter the rlimits fallback can run here (any, unless we are root)."""
    found = sandbox._interpreter_for_everyone() if ROOT else sys.executable
    if found is None:
        pytest.skip("no python3 that every user can run on this machine")
    return found


def test_without_any_usable_sandbox_the_commands_end_in_one_line_saying_what_to_do(
    no_bubblewrap: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(sandbox, "_rlimits_problem", lambda interp: "no uid to run the code as (test)")
    assert main(["tasks", "toolmath", "--num-tasks", "2", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("trace-rl tasks: no sandbox can run model code here. bwrap: bwrap is not installed")
    assert "apt-get install bubblewrap" in err and "--sandbox-python PATH or --sandbox-isolation" in err

    out = tmp_path / "trees.jsonl"
    config = str(REPO / "configs" / "smoke.yaml")
    assert main(["rollout", "--config", config, "--out", str(out), "task.name=toolmath"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "task.sandbox.python=PATH or task.sandbox.isolation" in err
    assert not (tmp_path / "cache").exists() and not out.exists()  # refused before any model was built


@pytest.mark.skipif(not ROOT, reason="only root needs an interpreter other users can run")
def test_as_root_the_error_names_an_interpreter_the_fallback_can_run(no_bubblewrap: None) -> None:
    own = sandbox._interpreter(sys.executable)
    if sandbox._rlimits_problem(own) is None:
        pytest.skip("this process's interpreter is one every user can run: the fallback works as it is")
    with pytest.raises(SandboxUnavailable, match=f"bwrap is not installed.*such as {fallback_interpreter()}$"):
        sandbox.check_sandbox()


def test_the_fallback_is_reachable_from_the_tasks_command(
    no_bubblewrap: None, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="trace_rl.agent.sandbox"):
        code = main(["tasks", "toolmath", "--num-tasks", "3", "--json", "--sandbox-python", fallback_interpreter()])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["tasksets"]["toolmath"]["oracle_success"] == 1.0
    assert any("falling back to isolation='rlimits'" in r.getMessage() for r in caplog.records)


def test_the_sandbox_is_chosen_by_the_run_config(capsys: pytest.CaptureFixture[str]) -> None:
    from trace_rl.agent.tasks import load_taskset
    from trace_rl.agent.tools import run_tool
    from trace_rl.agent.types import ToolCall
    from trace_rl.run import build_env

    python = fallback_interpreter()
    if sandbox.isolation_problem("rlimits", python):
        pytest.skip(f"the rlimits fallback cannot run here: {sandbox.isolation_problem('rlimits', python)}")
    config = load_config(RunConfig, overrides=["task.name=toolmath", "task.sandbox.isolation=rlimits",
                                                f"task.sandbox.python={python}"])
    env = build_env(config, load_taskset("toolmath", split="train", num_tasks=2))
    result = run_tool(env.tools, ToolCall("python", {"code": "import os, sys\nprint(sys.executable)\nprint(os.getcwd())"}))
    executable, cwd = result.output.splitlines()
    assert executable == os.path.realpath(python)
    assert "trace-rl-sandbox-" in cwd  # the fallback's host folder; inside bubblewrap it would be /tmp


def test_an_isolation_this_machine_lacks_is_refused_when_the_env_is_built(no_bubblewrap: None) -> None:
    from trace_rl.agent.tasks import load_taskset
    from trace_rl.run import build_env

    config = load_config(RunConfig, overrides=["task.name=toolmath", "task.sandbox.isolation=bwrap"])
    with pytest.raises(SandboxUnavailable, match="isolation='bwrap' is not usable here: bwrap is not installed"):
        build_env(config, load_taskset("toolmath", split="train", num_tasks=2))


@pytest.mark.parametrize(
    ("override", "message"),
    [("task.sandbox.python=python3", "task.sandbox.python must be an absolute path"),
     ("task.sandbox.isolation=docker", r"task.sandbox.isolation='docker' is not accepted.*auto, bwrap, rlimits")],
    ids=["relative-python", "unknown-isolation"],
)
def test_bad_sandbox_settings_are_refused_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, overrides=[override])
