"""Checkpoints are data, not code (issue 12, class 5): loading a run folder from someone else runs
nothing it brings, and reads nothing outside it."""

from __future__ import annotations

import builtins
import fractions
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import scripted_parts, small_config

from trace_rl.infra.config import load_config
from trace_rl.run import RunConfig, build_trainer
from trace_rl.storage.rundir import RunDir, RunDirError

REPO = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickled, it creates `marker`: what an attacker's checkpoint would do, harmlessly."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.open, (str(self.marker), "w"))


def run_folder(tmp_path: Path) -> RunDir:
    """A folder with a valid smoke config.yaml, as a foreign run folder would have."""
    run = RunDir(tmp_path / "foreign")
    run.write_config(load_config(RunConfig, REPO / "configs" / "smoke.yaml", ["rollout.budget=8", "prompts_per_step=2", "task.test_tasks=2"]))
    run.checkpoints_dir.mkdir()
    return run


def trace_rl(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRACE_RL_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "trace_rl", *args], check=False, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize(
    "command, zip_format",
    [(("eval",), True), (("train", "--resume"), True), (("eval",), False)],
    ids=["eval", "resume", "eval-legacy-format"],
)
def test_a_checkpoint_with_a_pickle_payload_runs_nothing_and_is_refused(tmp_path, command, zip_format):
    run = run_folder(tmp_path)
    marker = tmp_path / "payload-ran"
    torch.save({"step": 1, "model": Payload(marker)}, run.checkpoint_path(1), _use_new_zipfile_serialization=zip_format)
    (run.checkpoints_dir / "latest").write_text("step_0001.pt")

    result = trace_rl(tmp_path, *command, str(run.path))
    assert not marker.exists(), "loading the checkpoint ran its pickle"
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert re.search(r"step_0001\.pt is not plain data \(it would call \S*open\)", result.stderr)
    assert "never runs code from a checkpoint" in result.stderr


def test_eval_refuses_a_latest_pointer_outside_the_folder(tmp_path):
    run = run_folder(tmp_path)
    elsewhere = tmp_path / "elsewhere.pt"
    torch.save({"step": 7, "model": {}}, elsewhere)
    (run.checkpoints_dir / "latest").write_text(str(elsewhere))
    result = trace_rl(tmp_path, "eval", str(run.path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "must name a step_XXXX.pt file" in result.stderr and "refused" in result.stderr


@pytest.mark.parametrize("pointer", ["absolute", "../../../outside/step_0001.pt", "sub/step_0001.pt", "link"])
def test_a_checkpoint_outside_the_folder_is_refused(tmp_path, pointer):
    outside = tmp_path / "outside"
    outside.mkdir()
    torch.save({"step": 1}, outside / "step_0001.pt")
    (outside / "sub").mkdir()
    torch.save({"step": 1}, outside / "sub" / "step_0001.pt")
    run = RunDir(tmp_path / "a" / "run")
    run.checkpoints_dir.mkdir(parents=True)
    (run.checkpoints_dir / "sub").symlink_to(outside / "sub")
    if pointer == "absolute":
        pointer = str(outside / "step_0001.pt")
    if pointer == "link":  # a step file that is a link out of the folder
        (run.checkpoints_dir / "step_0001.pt").symlink_to(outside / "step_0001.pt")
        pointer = "step_0001.pt"
    (run.checkpoints_dir / "latest").write_text(pointer)
    with pytest.raises(RunDirError, match="refused"):
        run.load_checkpoint()


def test_a_trained_checkpoint_is_plain_data_with_json_rng_states(tmp_path):
    config = small_config(steps=1, checkpoint_every=1)
    trainer = build_trainer(config, scripted_parts(config, tmp_path / "cache"), tmp_path / "run")
    trainer.run()
    state = torch.load(RunDir(tmp_path / "run").checkpoint_path(1), weights_only=True)
    assert isinstance(state["torch_rng"], torch.Tensor)
    json.dumps([state["trainer_rng"], state["collector"], state["totals"], state["references"]])
    assert trainer.load_checkpoint() == 1


def test_a_value_that_is_not_data_is_refused_when_saved_naming_its_key(tmp_path):
    with pytest.raises(TypeError, match=r"checkpoint\.predictor\.odds is a Fraction"):
        RunDir(tmp_path).save_checkpoint({"step": 1, "predictor": {"odds": fractions.Fraction(1, 3)}}, 1)
    assert not RunDir(tmp_path).has_checkpoint()


def test_a_checkpoint_from_before_data_only_checkpoints_is_refused_with_a_clear_message(tmp_path):
    run = RunDir(tmp_path)
    run.checkpoints_dir.mkdir()
    torch.save({"step": 1, "predictor": {"weights": np.zeros(4)}}, run.checkpoint_path(1))  # what the trainer wrote before
    (run.checkpoints_dir / "latest").write_text("step_0001.pt")
    with pytest.raises(RunDirError, match=r"before checkpoints were data-only is refused the same way; train it again"):
        run.load_checkpoint()
