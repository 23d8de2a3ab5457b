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

    make venv                                           # on a fresh machine, first
    python experiments/evidence_study.py start          # setup, then every phase in the background
    python experiments/evidence_study.py status
    python experiments/evidence_study.py pause stop "the test suite"   # ... pause cont
    python experiments/evidence_study.py save           # (start does this every few minutes)
    python experiments/evidence_study.py stop           # each run stops after its step, checkpointed
                                                        # (a resume at the plan's commit is not bitwise: stop rarely)
    python experiments/evidence_study.py choose         # the strongest baseline (the runner does it after phase 2)
    python experiments/evidence_study.py finish         # once every phase is done

Pauses are logged in `experiments/evidence_study/pauses.log` (`results.py study --pauses` reads it),
so the wall-clock figures leave out the time the runs were stopped for the sessions' own work.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

MAIN = Path(__file__).resolve().parents[1]
SAVED = MAIN / "experiments" / "evidence_study"
PAUSES = SAVED / "pauses.log"
RESUMES = SAVED / "resumes.log"
MACHINES = SAVED / "machines.log"
WORK = Path(os.environ.get("EVIDENCE_WORK", "/work/exp-evidence"))
PLAN_COMMIT = "8034c58366e746d2d5e690240c8908d3c8e626e9"
"""The code every run of the study is made with (the plan's commit; its `code.json` says so)."""
PHASES = (("evidence_tiny", "configs/evidence_tiny.yaml"),
          ("evidence_tiny_brace", "configs/evidence_tiny_brace.yaml"),
          ("evidence_tiny_more_seeds", "configs/evidence_tiny_more_seeds.yaml"))
STEPS = 100
RUN_FILES = ("metrics.jsonl", "config.yaml", "code.json")
SAVE_EVERY_S = 300
BANKS = ("evidence_tiny/grpo_4",)
"""Runs phase 2 reads (`brace`'s warm bank: every bare rollout's outcome in their saved trees)."""
BANK_FIELDS = ("id", "parent", "depth", "children", "reward", "rollout_start", "budget")
"""What a node keeps in a bank run's saved trees: its place in the tree and its outcome (`bank_counts`)."""
START = "react"

sys.path.insert(0, str(MAIN / "scripts"))


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _python() -> str:
    return str(MAIN / ".venv" / "bin" / "python")


def _finished(run: Path) -> bool:
    """A training run whose log reached the plan's last step, or a start evaluation with its record
    (as `trace-rl compare` decides what to skip)."""
    from trace_rl.storage.rundir import RunDir

    return bool(RunDir(run).metrics()) if run.parent.name == START else RunDir(run).finished_steps() >= STEPS


def _runs(folder: Path) -> list[Path]:
    """The runs of a phase's comparison folder that have begun their log (`seed_runs`)."""
    from trace_rl.storage.rundir import seed_runs

    return seed_runs(folder)


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
            shutil.rmtree(run)
        run.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            tar.extractall(run, filter="data")
        restored += 1
    print(f"setup: worktree {WORK} at {PLAN_COMMIT[:7]}; {restored} saved runs unpacked")


def _figures(run: Path) -> dict:
    """What `results.py trees` and `probe` take from a run's saved trees (None where it has none)."""
    import results  # scripts/results.py
    from trace_rl.research.stage2_probe import probe_run
    from trace_rl.research.study import clock, read_pauses

    figures = {"trees": results.tree_figures(run, 5, 12), "probe": None, "clock": None}
    try:
        figures["clock"] = clock(run, read_pauses(PAUSES) if PAUSES.is_file() else [])
    except ValueError:  # a pause still open (a save by hand while the runs are stopped): the export recomputes it
        pass
    probe = probe_run(run, warmup=5)
    if probe.get("prefixes"):
        figures["probe"] = probe
    return figures


def _bank_trees(run: Path) -> dict[str, tuple[bytes, float]]:
    """A bank run's saved trees with each node cut to `BANK_FIELDS` (text, tokens and log-probs out,
    about a twentieth of the bytes), by name, with each file's time (its step's end: the clock); the
    outcomes `brace` banks from them are checked equal to the full trees'."""
    from trace_rl.predictor.bank import bank_counts

    out = {}
    for path in sorted((run / "trees").glob("step_*.jsonl")):
        lines = []
        for line in path.read_text().splitlines():
            tree = json.loads(line)
            tree["prompt"], tree["nodes"] = "", [{k: node[k] for k in BANK_FIELDS if k in node} for node in tree["nodes"]]
            lines.append(json.dumps(tree) + "\n")
        out[f"trees/{path.name}"] = ("".join(lines).encode(), path.stat().st_mtime)
    with tempfile.TemporaryDirectory() as cut:
        for name, (data, _) in out.items():
            (Path(cut) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(cut) / name).write_bytes(data)
        if out and bank_counts([cut], 0.5) != bank_counts([run], 0.5):
            raise RuntimeError(f"{run}: the cut trees bank other outcomes than the full ones")
    return out


def _pack(run: Path, figures: dict, bank: bool = False) -> bytes:
    """A deterministic tar.xz of the run's files and its figures (names sorted, no owners; no times
    but a bank run's tree files', which say when its steps ended)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=9) as tar:
        members = {name: ((run / name).read_bytes(), 0.0) for name in RUN_FILES if (run / name).is_file()}
        members["figures.json"] = ((json.dumps(figures, indent=1) + "\n").encode(), 0.0)
        if bank:
            members.update(_bank_trees(run))
        for name in sorted(members):
            data, mtime = members[name]
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, int(mtime)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _has_trees(archive: Path) -> bool:
    with tarfile.open(archive) as tar:
        return any(name.startswith("trees/") for name in tar.getnames())


def save(commit: bool = True) -> list[str]:
    """Pack every finished run not yet saved into experiments/evidence_study/, and commit them (a bank
    run saved without its trees, by a runner older than `BANKS`, is packed again with them)."""
    new = []
    for folder, _ in PHASES:
        for run in _runs(WORK / "runs" / folder):
            archive = SAVED / folder / run.parent.name / f"{run.name}.tar.xz"
            bank = f"{folder}/{run.parent.name}" in BANKS
            saved = archive.exists() and (not bank or _has_trees(archive) or not (run / "trees").is_dir())
            if saved or not _finished(run):
                continue
            figures = _figures(run) if run.parent.name != START else {}
            archive.parent.mkdir(parents=True, exist_ok=True)
            archive.write_bytes(_pack(run, figures, bank=bank))
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


def choose() -> str:
    """The plan's rule, applied once phases 1 and 2 are done: the strongest baseline (the candidate row
    with the highest mean final accuracy over seeds 0-2, ties to the earlier row) is added to phase 3's
    config and named in the plan, in one commit, before phase 3 starts. Returns the row."""
    from trace_rl.research.study import study

    if _phase3_ready():
        import yaml

        return yaml.safe_load((MAIN / PHASES[2][1]).read_text())["methods"][3]
    result = study([WORK / "runs" / f for f, _ in PHASES[:2]], steps=STEPS, candidates=ROWS[:ROWS.index("trace_stage1")], baseline_seeds=[0, 1, 2])
    rule = result["strongest_baseline"]
    row = rule["row"]
    if row is None:
        sys.exit(f"the strongest baseline cannot be chosen yet: {rule['means']}")
    means = ", ".join(f"`{r}` {m:.4f}" for r, m in sorted(rule["means"].items(), key=lambda item: -item[1]))
    config, plan = MAIN / PHASES[2][1], MAIN / "docs" / "results" / "evidence_tiny" / "plan.md"
    text = config.read_text()
    old = "methods: [trace_stage1, trace, trace_expected]"
    if old not in text:
        sys.exit(f"{config} does not hold {old!r}: add the row by hand")
    config.write_text(text.replace(old, f"methods: [trace_stage1, trace, trace_expected, {row}]  # {row}: the strongest baseline by the plan's rule"))
    marker = "   phase 3 starts.\n"
    plan_text = plan.read_text()
    if marker not in plan_text:
        sys.exit(f"{plan} has no {marker!r} to follow: name the row by hand")
    plan.write_text(plan_text.replace(marker, marker + f"   **Chosen ({_now()[:10]}, by `experiments/evidence_study.py choose`, phases 1 and 2 done): `{row}`.** "
                                      f"Mean final accuracy over seeds 0-2: {means}.\n", 1))
    subprocess.run(["git", "-C", str(MAIN), "commit", "-q", "-m", f"evidence study: the strongest baseline is {row}, phase 3 adds it",
                    "-m", f"The plan's rule over seeds 0-2 after phases 1 and 2: {means}.", "--", str(config), str(plan)], check=True)
    print(f"the strongest baseline: {row} ({means})")
    return row


def run_phases() -> None:
    """Every phase in turn (phase 3 once its baseline is named), saving finished runs as they come."""
    env = {**os.environ, "PYTHONPATH": str(WORK / "src")}
    for folder, config in PHASES:
        if folder == PHASES[2][0]:
            print(f"== {_now()} the strongest baseline: {choose()}", flush=True)
            (WORK / config).write_text((MAIN / config).read_text())
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


ROWS = ("grpo", "grpo_4", "grpo_8", "dapo_8x4", "knapsack", "pcl", "knapsack_16", "brace", "trace_stage1", "trace", "trace_expected")
"""The plan's rows in its table's order; the strongest baseline is chosen among those before `trace_stage1`."""
CONTRASTS = ("trace:@strongest", "trace:trace_stage1", "trace_expected:trace_stage1", "trace_expected:trace")
"""The plan's primary contrast first, then what the tree adds and what valuing prefixes by the expectation changes."""


def _merge(found: dict, saved: dict) -> tuple[dict, list[str]]:
    """`found` (row -> {"seeds": {seed: figures}}) with the saved figures of runs it lacks, and each
    row's mean over its seeds recomputed (`results.with_seed_means`); and the runs ("row/seed") whose
    figures came from their saved copy."""
    import results  # scripts/results.py

    filled = []
    for row, seeds in saved.items():
        for seed, figures in seeds.items():
            if seed not in found.get(row, {}).get("seeds", {}):
                found.setdefault(row, {"seeds": {}})["seeds"][seed] = figures
                filled.append(f"{row}/{seed}")
    for row in found.values():
        row["seeds"] = dict(sorted(row["seeds"].items()))
    return results.with_seed_means(found), filled


def _saved_figures(folder: str, kind: str) -> dict:
    """row -> seed -> the `kind` figures ("trees", "probe", "clock") saved with each finished run."""
    out: dict = {}
    for archive in sorted((SAVED / folder).glob("*/seed_*.tar.xz")):
        with tarfile.open(archive) as tar:
            figures = json.loads(tar.extractfile("figures.json").read())
        if figures.get(kind):
            out.setdefault(archive.parent.name, {})[archive.name.split(".")[0]] = figures[kind]
    return out


def _bank_note(bank: str) -> str:
    """How to rerun (`results.py reproduce`) a run that reads the warm bank `bank`: its config names the
    bank's runs by a path relative to where it runs, and their trees are in this repository only as
    `save` cut them (every outcome `brace` banks, checked)."""
    saved = SAVED.relative_to(MAIN) / bank
    return (f"# brace's warm bank is runs/{bank}/seed_<k> (relative to where it runs), whose trees are saved in {saved}/seed_<k>.tar.xz;\n"
            f"# to reproduce a brace run of seed k, first: mkdir -p runs/{bank}/seed_k && tar xJf {saved}/seed_k.tar.xz -C runs/{bank}/seed_k\n")


def finish() -> None:
    """The study's results into docs/results/: each phase exported (logs packed, no plots of its own),
    where the budget went and what Stage 2 bought (`trees.json`, `probe.json`: recomputed from the live
    trees, with the saved figures of runs whose trees this machine no longer has), then the
    pre-registered analysis over the three folders with its plots (`study --out`), and the pause and
    resume logs beside it."""
    import results  # scripts/results.py
    from trace_rl.research.study import CLOCK_FILE, PROBE_FILE
    from trace_rl.storage.rundir import read_run_file

    if _runner() is not None:
        sys.exit("the runner is still going: finish once every phase is done")
    for folder, config in PHASES:
        going = [str(r) for r in _runs(WORK / "runs" / folder) if not _finished(r)]
        if going or not (WORK / "runs" / folder / "summary.json").is_file():
            sys.exit(f"{folder} is not done ({', '.join(going) or 'no summary.json'})")
    results_dir = MAIN / "docs" / "results"
    for folder, config in PHASES:
        live, dest = WORK / "runs" / folder, results_dir / folder
        (dest / "command.txt").parent.mkdir(parents=True, exist_ok=True)
        (dest / "command.txt").write_text(
            f"# made by experiments/evidence_study.py start: at the plan's commit {PLAN_COMMIT[:7]} (a worktree),\n"
            f"# runs saved to experiments/evidence_study/ as they finished; resumes and pauses in ../evidence_tiny/\n"
            f"trace-rl compare --config {config} --out runs/{folder}\n"
            + "".join(_bank_note(bank) for bank in BANKS if f"runs/{bank}/" in (MAIN / config).read_text()))
        results.export(live, dest, MAIN / config, pauses=PAUSES, plots=False)
        clocks = json.loads(read_run_file(dest / CLOCK_FILE))
        for row, seeds in _saved_figures(folder, "clock").items():  # runs whose trees are gone keep their saved clock
            for seed, clock in seeds.items():
                clocks.setdefault(row, {}).setdefault(seed[5:], clock)
        (dest / CLOCK_FILE).write_text(json.dumps(clocks, indent=1, sort_keys=True) + "\n")
        results.pack(dest)
        trees = results.trees(live)
        trees["methods"], filled = _merge(trees["methods"], _saved_figures(folder, "trees"))
        if filled:  # their trees are not on this machine: the figures saved when each finished
            trees["from_saved_figures"] = filled
        (dest / "trees.json").write_text(json.dumps(trees, indent=1) + "\n")
        probe = results.probe([live])
        probe["rows"], filled = _merge(probe["rows"], _saved_figures(folder, "probe"))
        if filled:
            probe["from_saved_figures"] = filled
        (dest / PROBE_FILE).write_text(json.dumps(probe, indent=1) + "\n")
    study = results_dir / PHASES[0][0]
    results.main(["study", *(str(results_dir / f) for f, _ in PHASES), "--steps", str(STEPS), "--reference", "grpo",
                  *(a for c in CONTRASTS for a in ("--contrast", c)), "--candidates", *ROWS[:ROWS.index("trace_stage1")],
                  "--baseline-seeds", "0", "1", "2", "--order", *ROWS, "--out", str(study)])
    for log in (PAUSES, RESUMES, MACHINES):
        if log.is_file():
            (study / log.name).write_text(log.read_text())
    size = subprocess.run(["du", "-sk", str(results_dir)], capture_output=True, text=True, check=True).stdout.split()[0]
    print(f"docs/results: {size} KiB (du -sk)")


def start() -> None:
    setup()
    if _runner() is not None:
        print(f"already running (process group {_runner()})")
        return
    _log_resumes()
    _log_machine()
    (WORK / "runs").mkdir(exist_ok=True)
    log = open(WORK / "runs" / "evidence.log", "a")
    job = subprocess.Popen([sys.executable, __file__, "run"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (WORK / "runs" / "runner.pid").write_text(f"{job.pid}\n")
    print(f"started: process group {job.pid}, log {WORK / 'runs' / 'evidence.log'}")


def _log_resumes() -> None:
    """Note each run that (re)starts from a checkpoint rather than from its first step: the study's
    results list them. At the plan's commit a resumed run can leave its unbroken twin at float noise
    (the `hf` engine's prefix cache, fixed in 8f67add, after the plan): a valid run, but not the same
    numbers past the resume, so `results.py reproduce` is checked on steps before it."""
    lines = []
    for folder, _ in PHASES:
        for run in _runs(WORK / "runs" / folder):
            latest = run / "checkpoints" / "latest"
            if not _finished(run) and latest.is_file():
                lines.append(f"{_now()} {folder}/{run.parent.name}/{run.name} from {latest.read_text().strip()}\n")
    if lines:
        with RESUMES.open("a") as log:
            log.writelines(lines)


def _log_machine() -> None:
    """The CPU the runs go on from now (the plan's commit records no CPU in `code.json`): runs are
    reproducible on one kind of CPU, and a step's time depends on it."""
    sys.path.insert(0, str(MAIN / "benchmarks"))
    from hardware import cpuinfo  # benchmarks/hardware.py

    model, flags = cpuinfo()
    with MACHINES.open("a") as log:
        log.write(f"{_now()} {model}, {' '.join(flags) or 'no AVX2'}, {os.cpu_count()} cores\n")


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


def stop() -> None:
    """Stop the runs cleanly: SIGTERM to the comparison alone (it stops each run after its step, with a
    checkpoint there, and the runner exits with it); a signal to the whole group would reach the
    workers twice and stop them at once, back at their last periodic checkpoint."""
    group = _runner()
    if group is None:
        sys.exit("no runner is running")
    found = subprocess.run(["pgrep", "-g", str(group), "-f", "trace_rl compare"], capture_output=True, text=True).stdout.split()
    compare = [int(p) for p in found if int(p) != group and os.getpgid(int(p)) == group]
    for pid in compare[:1]:
        os.kill(pid, signal.SIGTERM)
    print(f"stopping: comparison {compare[:1] or 'none found'} of process group {group}")


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
    for name in ("setup", "start", "run", "save", "status", "stop", "choose", "finish"):
        sub.add_parser(name)
    paused = sub.add_parser("pause")
    paused.add_argument("action", choices=("stop", "cont"))
    paused.add_argument("why", nargs="?", default="")
    args = parser.parse_args(argv)
    if args.command == "pause":
        pause(args.action, args.why)
    else:
        {"setup": setup, "start": start, "run": run_phases, "save": save, "status": status, "stop": stop, "choose": choose, "finish": finish}[args.command]()


if __name__ == "__main__":
    main()
