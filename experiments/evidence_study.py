"""Run the pre-registered study of issue 42 (docs/results/evidence_tiny/plan.md) so that it survives
a lost machine: its runs are made by the plan's own commit in a worktree beside this checkout, and
each finished run is saved here, in this repository, as it finishes.

The study takes many sessions of a 2-core machine, and a session may start on a fresh machine that
holds only what this repository holds: a worktree, its checkpoints and its saved trees (about 3 MB a
run packed) would be lost. So `save` packs each finished run's log, config and code record
(`metrics.jsonl`, `config.yaml`, `code.json`, a few KB) into `experiments/evidence_study/` and
commits them, with the figures that need the run's trees (`results.py trees` and `probe`, computed by
their own functions) in a `figures.json` beside them; `setup` on a fresh machine makes the worktree
again and unpacks what was saved, so the comparisons skip those runs. `finish` exports the study into
`docs/results/` from the live runs, and takes the tree figures of runs whose trees were lost from
their `figures.json` (saying so in the results).

    python experiments/evidence_study.py start          # setup, then every phase in the background
    python experiments/evidence_study.py status
    python experiments/evidence_study.py pause stop "the test suite"   # ... pause cont
    python experiments/evidence_study.py save           # (start does this every few minutes)
    python experiments/evidence_study.py finish         # once every phase is done

Pauses are logged in `experiments/evidence_study/pauses.log` (`results.py study --pauses` reads it),
so the wall-clock figures leave out the time the runs were stopped for the sessions' own work.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path

MAIN = Path(__file__).resolve().parents[1]
SAVED = MAIN / "experiments" / "evidence_study"
PAUSES = SAVED / "pauses.log"
WORK = Path(os.environ.get("EVIDENCE_WORK", "/work/exp-evidence"))
PLAN_COMMIT = "8034c58366e746d2d5e690240c8908d3c8e626e9"
"""The code every run of the study is made with (the plan's commit; its `code.json` says so)."""
PHASES = (("evidence_tiny", "configs/evidence_tiny.yaml"),
          ("evidence_tiny_brace", "configs/evidence_tiny_brace.yaml"),
          ("evidence_tiny_more_seeds", "configs/evidence_tiny_more_seeds.yaml"))
STEPS = 100
RUN_FILES = ("metrics.jsonl", "config.yaml", "code.json")
SAVE_EVERY_S = 300
START = "react"

sys.path.insert(0, str(MAIN / "scripts"))


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _python() -> str:
    return str(MAIN / ".venv" / "bin" / "python")


def _finished(run: Path) -> bool:
    """A training run whose log reached the plan's last step, or a start evaluation with its record."""
    log = run / "metrics.jsonl"
    if not log.is_file():
        return False
    lines = log.read_text().splitlines()
    if not lines:
        return False
    return run.parent.name == START or json.loads(lines[-1]).get("step", 0) >= STEPS


def _runs(folder: Path):
    for method in sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else ():
        for run in sorted(method.glob("seed_*")):
            yield run


def _phase3_ready() -> bool:
    """Phase 3 waits for the strongest baseline to be named in its config (a fourth row), committed."""
    import yaml

    config = yaml.safe_load((MAIN / PHASES[2][1]).read_text())
    return len(config["methods"]) == 4


def setup() -> None:
    """The worktree at the plan's commit with main's phase configs, and every saved run unpacked into it."""
    if not (WORK / ".git").exists():
        subprocess.run(["git", "-C", str(MAIN), "worktree", "prune"], check=True)
        subprocess.run(["git", "-C", str(MAIN), "worktree", "add", "--detach", str(WORK), PLAN_COMMIT], check=True)
    for _, config in PHASES:
        (WORK / config).write_text((MAIN / config).read_text())
    restored = 0
    for archive in sorted(SAVED.glob("*/*/seed_*.tar.xz")):
        run = WORK / "runs" / archive.relative_to(SAVED).with_suffix("").with_suffix("")
        if _finished(run):
            continue
        if run.exists():  # an unfinished copy of a run that finished elsewhere: the saved one stands
            subprocess.run(["rm", "-rf", str(run)], check=True)
        run.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            tar.extractall(run, filter="data")
        restored += 1
    print(f"setup: worktree {WORK} at {PLAN_COMMIT[:7]}; {restored} saved runs unpacked")


def _figures(run: Path) -> dict:
    """What `results.py trees` and `probe` take from a run's saved trees (None where it has none)."""
    import results  # scripts/results.py
    from trace_rl.research.stage2_probe import probe_run

    figures = {"trees": results.tree_figures(run, 5, 12), "probe": None}
    probe = probe_run(run, warmup=5)
    if probe.get("prefixes"):
        figures["probe"] = probe
    return figures


def _pack(run: Path, figures: dict) -> bytes:
    """A deterministic tar.xz of the run's files and its figures (names sorted, no times or owners)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=9) as tar:
        members = {name: (run / name).read_bytes() for name in RUN_FILES if (run / name).is_file()}
        members["figures.json"] = (json.dumps(figures, indent=1) + "\n").encode()
        for name in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(members[name]), 0o644
            tar.addfile(info, io.BytesIO(members[name]))
    return buffer.getvalue()


def save(commit: bool = True) -> list[str]:
    """Pack every finished run not yet saved into experiments/evidence_study/, and commit them."""
    new = []
    for folder, _ in PHASES:
        for run in _runs(WORK / "runs" / folder):
            archive = SAVED / folder / run.parent.name / f"{run.name}.tar.xz"
            if archive.exists() or not _finished(run):
                continue
            figures = _figures(run) if run.parent.name != START else {}
            archive.parent.mkdir(parents=True, exist_ok=True)
            archive.write_bytes(_pack(run, figures))
            new.append(f"{folder}/{run.parent.name}/{run.name}")
    if new and commit:
        paths = [str(SAVED.relative_to(MAIN))]
        subprocess.run(["git", "-C", str(MAIN), "add", "--", *paths], check=True)
        message = f"evidence study: save {len(new)} finished run{'s' * (len(new) > 1)}\n\n" + "\n".join(new)
        for _ in range(5):  # the session may hold the index for a moment
            if subprocess.run(["git", "-C", str(MAIN), "commit", "-q", "-m", message, "--", *paths]).returncode == 0:
                break
            time.sleep(10)
    for line in new:
        print(f"saved {line}")
    return new


def run_phases() -> None:
    """Every phase in turn (phase 3 once its baseline is named), saving finished runs as they come."""
    env = {**os.environ, "PYTHONPATH": str(WORK / "src")}
    for folder, config in PHASES:
        if folder == PHASES[2][0] and not _phase3_ready():
            print(f"== {_now()} phase 3 waits for the strongest baseline in {config}", flush=True)
            break
        print(f"== {_now()} {folder}", flush=True)
        job = subprocess.Popen([_python(), "-m", "trace_rl", "compare", "--config", config, "--out", f"runs/{folder}"], cwd=WORK, env=env)
        while job.poll() is None:
            try:
                job.wait(timeout=SAVE_EVERY_S)
            except subprocess.TimeoutExpired:
                pass
            save()
        if job.returncode:
            print(f"== {_now()} {folder} exited {job.returncode}", flush=True)
            sys.exit(job.returncode)
    print(f"== {_now()} done", flush=True)


def start() -> None:
    setup()
    if _runner() is not None:
        print(f"already running (process group {_runner()})")
        return
    log = open(WORK / "runs" / "evidence.log", "a")
    job = subprocess.Popen([sys.executable, __file__, "run"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (WORK / "runs" / "runner.pid").write_text(f"{job.pid}\n")
    print(f"started: process group {job.pid}, log {WORK / 'runs' / 'evidence.log'}")


def _runner() -> int | None:
    path = WORK / "runs" / "runner.pid"
    if not path.is_file():
        return None
    pid = int(path.read_text())
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return None
    return pid


def pause(action: str, why: str = "") -> None:
    """Stop (SIGSTOP) or continue the runner's whole process group, and log it for the wall-clock."""
    group = _runner()
    if group is None:
        sys.exit("no runner is running")
    logged = [line.split()[0] for line in (PAUSES.read_text().splitlines() if PAUSES.is_file() else []) if line.strip() and not line.startswith("#")]
    if (logged[-1] if logged else "cont") == action:
        sys.exit(f"the runs are already {'paused' if action == 'stop' else 'going'} ({PAUSES})")
    os.killpg(group, signal.SIGSTOP if action == "stop" else signal.SIGCONT)
    PAUSES.parent.mkdir(parents=True, exist_ok=True)
    with PAUSES.open("a") as log:
        log.write(f"{action} {_now()}" + (f" {why}" if why and action == "stop" else "") + "\n")
    print(f"{action}: process group {group}")


def status() -> None:
    for folder, _ in PHASES:
        runs = list(_runs(WORK / "runs" / folder))
        saved = list((SAVED / folder).glob("*/seed_*.tar.xz"))
        going = [f"{r.parent.name}/{r.name}" for r in runs if not _finished(r)]
        print(f"{folder}: {sum(map(_finished, runs))} finished here, {len(saved)} saved; going: {', '.join(going) or '-'}")
    print(f"runner: {_runner() or 'not running'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("setup", "start", "run", "save", "status"):
        sub.add_parser(name)
    paused = sub.add_parser("pause")
    paused.add_argument("action", choices=("stop", "cont"))
    paused.add_argument("why", nargs="?", default="")
    args = parser.parse_args(argv)
    if args.command == "pause":
        pause(args.action, args.why)
    else:
        {"setup": setup, "start": start, "run": run_phases, "save": save, "status": status}[args.command]()


if __name__ == "__main__":
    main()
