"""Run folders under kills, signals, re-runs, changed resumes and damaged checkpoints (issue 12, class 4).

The CLI tests run the real `trace-rl train` / `eval` on configs/smoke.yaml in subprocesses; one
module-wide cache holds the smoke warm start, made once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from test_train import metrics_without_timing, scripted_parts, small_config

from trace_rl.run import build_trainer
from trace_rl.storage.rundir import RunDir, RunDirError, RunDirWarning, atomic_write
from trace_rl.training.trainer import StopRequest

REPO = Path(__file__).resolve().parents[1]
SMALL = ["train.eval_every=0", "rollout.budget=8", "prompts_per_step=2", "task.test_tasks=2"]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("cache")
    return {**os.environ, "TRACE_RL_CACHE": str(cache), "PYTHONPATH": str(REPO / "src")}


def trace_rl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trace_rl", *args], check=False, env=env, capture_output=True, text=True, timeout=900)


def train_args(out: Path, *overrides: str) -> list[str]:
    return ["train", "--config", str(REPO / "configs" / "smoke.yaml"), "--out", str(out), *SMALL, *overrides]


def start(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trace_rl", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_steps(process: subprocess.Popen, run_dir: Path, steps: int) -> None:
    """Until `metrics.jsonl` has `steps` lines (the process must still be running)."""
    deadline = time.monotonic() + 600
    while not (run_dir / "metrics.jsonl").exists() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < steps:
        assert process.poll() is None, f"the run ended before step {steps}: {process.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.05)


def stopped_twice(process: subprocess.Popen) -> str:
    """SIGTERM, and again 0.2 s later: the process must stop at once with 143 and no traceback; its stderr."""
    process.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr
    return stderr


def logged_steps(run_dir: Path) -> list[int]:
    """The `step` of every line of metrics.jsonl, as the file holds them (no deduplication)."""
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def unbroken(env, tmp_path_factory) -> Path:
    """A finished 3-step smoke run with a checkpoint after every step (step_0002.pt and step_0003.pt kept)."""
    run_dir = tmp_path_factory.mktemp("unbroken") / "run"
    result = trace_rl(env, *train_args(run_dir, "train.steps=3", "train.checkpoint_every=1"))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "copy"))


# ---------------------------------------------------------------- through the CLI


def test_a_run_killed_before_its_first_checkpoint_is_resumed_never_appended_to(env, unbroken, tmp_path):
    killed = tmp_path / "killed"
    process = start(env, *train_args(killed, "train.steps=3", "train.checkpoint_every=10"))
    wait_for_steps(process, killed, 2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "checkpoints").exists() and logged_steps(killed) == [1, 2]

    again = trace_rl(env, *train_args(killed, "train.steps=3", "train.checkpoint_every=10"))
    assert again.returncode == 2 and "--resume" in again.stderr and "Traceback" not in again.stderr
    assert logged_steps(killed) == [1, 2], "a refused re-run must leave the folder as it was"

    resumed = trace_rl(env, "train", "--resume", str(killed))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "warning" in resumed.stderr and "no checkpoint yet" in resumed.stderr
    assert logged_steps(killed) == [1, 2, 3]
    assert metrics_without_timing(killed) == metrics_without_timing(unbroken)


def test_resume_keeps_the_earlier_config_and_refuses_changes_to_what_the_run_is(env, unbroken, tmp_path):
    run_dir = copy_of(unbroken, tmp_path)
    original = (run_dir / "config.yaml").read_text()

    refused = trace_rl(env, "train", "--resume", str(run_dir), "rollout.budget=4")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "rollout.budget=4" in refused.stderr and "trained with 8" in refused.stderr
    assert (run_dir / "config.yaml").read_text() == original and not list(run_dir.glob("config.step_*"))

    longer = trace_rl(env, "train", "--resume", str(run_dir), "train.steps=4")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "config.step_0003.yaml" in longer.stderr and "train.steps=4 (was 3)" in longer.stderr
    assert (run_dir / "config.step_0003.yaml").read_text() == original
    assert "steps: 4" in (run_dir / "config.yaml").read_text()
    assert logged_steps(run_dir) == [1, 2, 3, 4]


def test_a_cut_short_or_empty_latest_checkpoint_falls_back_to_the_previous_one(env, unbroken, tmp_path):
    run_dir = copy_of(unbroken, tmp_path)
    latest = run_dir / "checkpoints" / "step_0003.pt"
    assert (run_dir / "checkpoints" / "latest").read_text() == latest.name
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 2])

    evaluated = trace_rl(env, "eval", str(run_dir), "--samples", "1")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout.strip().splitlines()[-1])["step"] == 2
    warning = next(line for line in evaluated.stderr.splitlines() if "warning" in line)
    assert "step_0003.pt" in warning and "cut short" in warning and "step_0002.pt" in warning

    latest.write_bytes(b"")
    resumed = trace_rl(env, "train", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_0003.pt (empty)" in resumed.stderr and "step_0002.pt" in resumed.stderr
    assert metrics_without_timing(run_dir) == metrics_without_timing(unbroken)


def test_sigint_stops_at_the_step_boundary_with_a_checkpoint_and_exit_130(env, tmp_path):
    run_dir = tmp_path / "run"
    process = start(env, *train_args(run_dir, "train.steps=4", "train.checkpoint_every=100"))
    wait_for_steps(process, run_dir, 1)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("trace-rl train: stopped by SIGINT after step") and f"trace-rl train --resume {run_dir}" in last
    done = logged_steps(run_dir)
    assert done == list(range(1, len(done) + 1)) and len(done) < 4
    assert list(RunDir(run_dir).checkpoint_files()) == [done[-1]], "the step it stopped after is checkpointed"

    resumed = trace_rl(env, "train", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert logged_steps(run_dir) == [1, 2, 3, 4]


def test_a_second_sigterm_stops_at_once_leaving_the_last_checkpoint_and_exit_143(env, tmp_path):
    run_dir = tmp_path / "run"
    process = start(env, *train_args(run_dir, "train.steps=6", "train.checkpoint_every=1"))
    wait_for_steps(process, run_dir, 1)
    latest = run_dir / "checkpoints" / "latest"
    while not (latest.exists() and latest.read_text() == "step_0001.pt"):
        assert process.poll() is None
        time.sleep(0.05)
    time.sleep(0.5)  # into step 2: a signal right after step 1's checkpoint finds the loop's stop check and stops there
    stderr = stopped_twice(process)
    last = stderr.strip().splitlines()[-1]
    assert "stopped by SIGTERM at once" in last and "the last checkpoint is step" in last and "--resume" in last
    assert RunDir(run_dir).load_checkpoint()["step"] == max(RunDir(run_dir).checkpoint_files())
    assert not [p.name for p in run_dir.rglob(".*tmp*")], "an interrupted write leaves no temporary file"


def test_a_signal_while_the_process_exits_still_gives_128_plus_its_number():
    # A stopped run returns 143 and the interpreter then shuts down (torch's teardown takes a moment); a second
    # SIGTERM landing there must not kill the process by the signal (-15 to a caller) but exit 143 at once.
    late_signal = (
        "import atexit, os, signal, time\n"
        "import trace_rl.cli as cli\n"
        "cli.main = lambda argv=None: print('{\"done\": true}') or 0\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30)))\n"
        "cli.run()\n"
    )
    result = subprocess.run([sys.executable, "-c", late_signal], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-2000:]
    assert result.stdout.strip() == '{"done": true}' and "Traceback" not in result.stderr


def compare_config(tmp_path: Path) -> Path:
    """Two methods on one seed, two workers, on configs/smoke.yaml's run (no starting-policy evaluation)."""
    import yaml

    run = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    run["rollout"]["budget"], run["prompts_per_step"], run["task"]["test_tasks"] = 8, 2, 2
    run["train"].update(steps=6, eval_every=0, checkpoint_every=100)
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump({"methods": ["grpo", "trace"], "seeds": [0], "workers": 2, "evaluate_start": False, "run": run}))
    return path


def test_ctrl_c_stops_a_parallel_compare_after_each_runs_step_and_the_same_command_continues(env, tmp_path):
    out, config = tmp_path / "cmp", compare_config(tmp_path)
    args = ["compare", "--config", str(config), "--out", str(out)]
    process = subprocess.Popen([sys.executable, "-m", "trace_rl", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)  # its own process group, as a terminal's job is
    wait_for_steps(process, out / "grpo" / "seed_0", 1)
    wait_for_steps(process, out / "trace" / "seed_0", 1)
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole group, workers included
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("trace-rl compare: stopped by SIGINT") and f"--out {out}" in last
    assert not (out / "summary.json").exists()
    for method in ("grpo", "trace"):
        done = logged_steps(out / method / "seed_0")
        assert done == list(range(1, len(done) + 1)) and len(done) < 6, (method, done)
        assert list(RunDir(out / method / "seed_0").checkpoint_files()) == [done[-1]], f"{method} is checkpointed where it stopped"

    again = trace_rl(env, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert logged_steps(out / "grpo" / "seed_0") == logged_steps(out / "trace" / "seed_0") == [1, 2, 3, 4, 5, 6]
    assert set(json.loads((out / "summary.json").read_text())["methods"]) == {"grpo", "trace"}


def test_a_one_worker_compare_says_where_it_is_during_the_warm_start_and_the_start_evaluation(tmp_path):
    import yaml

    # a fresh cache, so the warm start runs here; stderr is a pipe, so progress comes as plain lines
    env = {**os.environ, "TRACE_RL_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO / "src")}
    config = yaml.safe_load(compare_config(tmp_path).read_text())
    config.update(workers=1, evaluate_start=True, methods=["grpo"])
    config["run"]["train"]["steps"] = 1
    config["run"]["sft"] = {**config["run"].get("sft", {}), "steps": 4, "demos": 8}
    path = tmp_path / "one_worker.yaml"
    path.write_text(yaml.safe_dump(config))
    result = trace_rl(env, "compare", "--config", str(path), "--out", str(tmp_path / "cmp"))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    warm = [i for i, line in enumerate(lines) if line.startswith("warm start: 4/4")]
    start = [i for i, line in enumerate(lines) if line.startswith("react seed_0: the starting policy:") and "done" in line]
    assert warm and start and warm[0] < start[0], result.stderr[-3000:]


def test_a_second_sigterm_stops_a_parallel_compare_at_once_and_exit_143(env, tmp_path):
    out = tmp_path / "cmp"
    process = start(env, "compare", "--config", str(compare_config(tmp_path)), "--out", str(out))
    wait_for_steps(process, out / "grpo" / "seed_0", 1)
    stderr = stopped_twice(process)
    assert "stopped by SIGTERM at once" in stderr.strip().splitlines()[-1]
    for method in ("grpo", "trace"):
        steps = logged_steps(out / method / "seed_0") if (out / method / "seed_0" / "metrics.jsonl").exists() else []
        assert steps == list(range(1, len(steps) + 1)) and len(steps) < 6


# ---------------------------------------------------------------- in process


def test_a_stop_request_checkpoints_the_step_it_ends_on_and_resumes_to_the_same_metrics(tmp_path):
    cache = tmp_path / "cache"
    config = small_config(steps=4, checkpoint_every=10)
    unbroken = build_trainer(config, scripted_parts(config, cache), tmp_path / "unbroken")
    unbroken.run()

    stop = StopRequest()
    first = build_trainer(config, scripted_parts(config, cache), tmp_path / "stopped")
    train_step = first.train_step

    def step_with_a_signal_during_step_2() -> dict[str, float]:
        metrics = train_step()
        if first.step == 2:
            assert stop.listening
            stop.signal = signal.SIGINT  # what the CLI's handler does while the loop listens
        return metrics

    first.train_step = step_with_a_signal_during_step_2
    first.run(stop=stop)
    assert first.step == 2 and list(RunDir(tmp_path / "stopped").checkpoint_files()) == [2] and not stop.listening
    resumed = build_trainer(config, scripted_parts(config, cache), tmp_path / "stopped")
    assert resumed.load_checkpoint() == 2
    resumed.run()
    assert metrics_without_timing(tmp_path / "stopped") == metrics_without_timing(tmp_path / "unbroken")
    for a, b in zip(unbroken.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_loading_skips_a_cut_short_checkpoint_but_never_a_refused_one(tmp_path):
    run = RunDir(tmp_path)
    for step in (1, 2):
        run.save_checkpoint({"step": step}, step)
    newest = run.checkpoint_path(2)
    newest.write_bytes(newest.read_bytes()[:-20])
    with pytest.warns(RunDirWarning, match=r"step_0002\.pt \(cut short.*using step_0001\.pt"):
        assert run.load_checkpoint()["step"] == 1

    torch.save({"step": 2, "code": print}, newest)  # complete, but not data: refused, not skipped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RunDirError, match=r"step_0002\.pt is not plain data \(it would call \S*print\)"):
            run.load_checkpoint()


def test_checkpoints_are_kept_by_step_number_past_step_9999(tmp_path):
    run = RunDir(tmp_path)
    for step in (9998, 9999, 10000):
        run.save_checkpoint({"step": step}, step)
    assert sorted(p.name for p in run.checkpoints_dir.glob("step_*.pt")) == ["step_10000.pt", "step_9999.pt"]
    assert run.load_checkpoint()["step"] == 10000


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("old")

    def interrupted(tmp: str) -> None:
        Path(tmp).write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, interrupted)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


# ---------------------------------------------------------------- folders a user edits, shares or fills (issue 43)


def one_line_error(result: subprocess.CompletedProcess, command: str = "train") -> str:
    """The refusal: exit 2, no traceback, its message the last stderr line."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"trace-rl {command}: ")
    return last


def test_a_resume_refuses_an_edited_config_yaml_since_the_checkpoint_holds_the_config_it_trained_with(env, unbroken, tmp_path):
    run_dir = copy_of(unbroken, tmp_path)
    edited = (run_dir / "config.yaml").read_text().replace("method: trace", "method: grpo").replace("budget: 8", "budget: 16")
    assert edited != (run_dir / "config.yaml").read_text()
    (run_dir / "config.yaml").write_text(edited)
    before = (run_dir / "metrics.jsonl").read_text()

    message = one_line_error(trace_rl(env, "train", "--resume", str(run_dir), "train.steps=4"))
    assert "rollout.method='grpo' (it was trained with 'trace')" in message and "rollout.budget=16 (it was trained with 8)" in message
    assert "config.yaml was edited since" in message
    assert (run_dir / "metrics.jsonl").read_text() == before and not list(run_dir.glob("config.step_*"))


def test_an_edit_a_resume_may_make_is_taken_and_the_archive_holds_the_checkpoints_config(env, unbroken, tmp_path):
    run_dir = copy_of(unbroken, tmp_path)
    original = (run_dir / "config.yaml").read_text()
    (run_dir / "config.yaml").write_text(original.replace("\n  steps: 3\n", "\n  steps: 4\n"))
    resumed = trace_rl(env, "train", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (run_dir / "config.step_0003.yaml").read_text() == original  # from the checkpoint, not the edited file
    assert logged_steps(run_dir) == [1, 2, 3, 4]
    assert "\n  steps: 4\n" in torch.load(run_dir / "checkpoints" / "step_0004.pt", weights_only=True)["config"]


def test_a_second_writer_refuses_at_once_naming_the_first_and_a_killed_ones_lock_is_free(env, tmp_path):
    run_dir = tmp_path / "run"
    holder = "import sys, time\nfrom trace_rl.storage.rundir import RunDir\nwith RunDir(sys.argv[1]).lock():\n    print('held', flush=True)\n    time.sleep(600)\n"
    process = subprocess.Popen([sys.executable, "-c", holder, str(run_dir)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match=rf"{run_dir} is being written by pid {process.pid} on "):
            with RunDir(run_dir).lock():
                pass
        message = one_line_error(trace_rl(env, *train_args(run_dir, "train.steps=1")))
        assert f"pid {process.pid}" in message and "one writer" in message
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"], "the refused writer wrote nothing"
    finally:
        process.kill()
        process.wait()
    with RunDir(run_dir).lock():  # SIGKILL: the kernel released the lock with the process
        pass


def test_out_refuses_a_folder_of_the_users_own_files_and_leaves_them_as_they_were(env, tmp_path):
    for files in ({"notes.txt": "mine"}, {"config.yaml": "# my own config\nseed: 3\n"}):
        out = tmp_path / next(iter(files)).replace(".", "_")
        out.mkdir()
        for name, text in files.items():
            (out / name).write_text(text)
        message = one_line_error(trace_rl(env, *train_args(out, "train.steps=1")))
        assert "not a run's" in message and next(iter(files)) in message
        assert {p.name: p.read_text() for p in out.iterdir() if p.name != ".lock"} == files


def test_a_last_line_cut_short_is_written_again_from_the_checkpoint(env, unbroken, tmp_path):
    run_dir = copy_of(unbroken, tmp_path)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    resumed = trace_rl(env, "train", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (run_dir / "metrics.jsonl").read_text() == "".join(lines)


def test_temporary_files_of_a_killed_writer_are_removed_on_start(env, unbroken, tmp_path):
    run_dir = copy_of(unbroken, tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    left = [run_dir / f".metrics.jsonl.tmp{dead}", run_dir / "checkpoints" / f".step_0004.pt.tmp{dead}"]
    for path in left:
        path.write_bytes(b"half")
    resumed = trace_rl(env, "train", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not [p for p in left if p.exists()]


def test_a_folder_whose_metrics_are_not_a_runs_is_one_line_for_train_resume_and_report(env, unbroken, tmp_path):
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "metrics.jsonl").write_text('{"loss": 1.0}\n{"loss": 0.5}\n')
    assert "integer 'step'" in one_line_error(trace_rl(env, *train_args(unrelated, "train.steps=1")))
    assert "integer 'step'" in one_line_error(trace_rl(env, "report", str(unrelated)), "report")

    run_dir = copy_of(unbroken, tmp_path)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text(lines[0] + "{not json\n" + "".join(lines[1:]))
    assert "metrics.jsonl:2: not JSON" in one_line_error(trace_rl(env, "train", "--resume", str(run_dir)))


def in_small_disk(env: dict[str, str], script: str, *, size: str = "1m", tmp_path: Path) -> subprocess.CompletedProcess:
    """`script` (sh) in a mount namespace with a `size` tmpfs at $DISK: a real full disk or, remounted
    read-only, a real read-only folder (as root, which file modes would not stop)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {disk}"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.decode()[:200]}")
    wrapped = f"mount -t tmpfs -o size={size} tmpfs {disk} && cd {disk} && {script}"
    return subprocess.run(["unshare", "-m", "sh", "-c", wrapped], env={**env, "DISK": str(disk)}, capture_output=True, text=True, timeout=900)


def test_a_full_disk_is_one_line_naming_the_file_and_leaves_nothing_half_written(env, tmp_path):
    check = (
        "import os, pathlib, torch\n"
        "from trace_rl.storage.rundir import RunDir, RunDirError\n"
        "run = RunDir(os.environ['DISK'] + '/run')\n"
        "run.save_checkpoint({'step': 1, 'w': torch.zeros(10)}, 1)\n"
        "run.append_metrics({'step': 1, 'loss': 0.5})\n"
        "for attempt, write in (('checkpoint', lambda: run.save_checkpoint({'step': 2, 'w': torch.zeros(2**20)}, 2)),\n"
        "                       ('metrics', lambda: run.append_metrics({'step': 2, 'pad': 'x' * 2**21}))):\n"
        "    try:\n"
        "        write()\n"
        "    except RunDirError as exc:\n"
        "        print(attempt, exc)\n"
        "print(run.load_checkpoint()['step'], run.metrics_path.read_text().count(chr(10)), run.metrics()[-1]['step'])\n"
        "print(sorted(p.name for p in pathlib.Path(run.path).rglob('*')))\n"
    )
    script = tmp_path / "check.py"
    script.write_text(check)
    result = in_small_disk(env, f"{sys.executable} {script}", size="1m", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout.splitlines()
    assert out[0].startswith("checkpoint cannot write ") and "step_0002.pt" in out[0] and "MiB free" in out[0]
    assert out[1].startswith("metrics cannot write ") and "metrics.jsonl: No space left on device" in out[1]
    assert out[2] == "1 1 1", "the old checkpoint and the whole lines stay"
    assert out[3] == str(["checkpoints", "latest", "metrics.jsonl", "step_0001.pt"]), "no temporary or half-written file"


def test_a_read_only_run_folder_is_one_line_for_resume_and_report(env, unbroken, tmp_path):
    script = (
        f"cp -r {unbroken} run && mount -o remount,ro $DISK && "
        f"{sys.executable} -m trace_rl train --resume run; echo rc=$?; {sys.executable} -m trace_rl report run; echo rc=$?"
    )
    result = in_small_disk(env, script, size="64m", tmp_path=tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.startswith("trace-rl ")]
    assert len(lines) >= 2, result.stdout + result.stderr[-3000:]
    resume, report = lines[-2:]
    assert "Traceback" not in result.stderr and result.stdout.count("rc=2") == 2, result.stdout + result.stderr[-3000:]
    assert resume.startswith("trace-rl train: cannot write to run: Read-only file system")
    assert report.startswith("trace-rl report: cannot write run/") and "Read-only file system" in report
