"""Results as data: export a finished comparison into docs/results/<name>/, check and query those files.

    python scripts/results.py export runs/paper_main docs/results/paper_main --config configs/paper_main.yaml
    python scripts/results.py reproduce docs/results/groups_paper/trace/seed_0 --steps 2   # with the commit its code.json names
    python scripts/results.py signal            # which allocation figure goes with held-out gain, over every folder
    python scripts/results.py trees runs/paper_main --out docs/results/paper_main/trees.json   # figures from saved trees
    python scripts/results.py pack              # every folder under docs/results: run logs into runs.tar.xz, plots smaller
    python scripts/results.py study docs/results/evidence_tiny docs/results/evidence_tiny_brace --steps 100 \
        --reference grpo --contrast trace:trace_stage1 --out docs/results/evidence_tiny   # a plan over several folders

An exported folder holds what it takes to check or redo every number: the compare config and the
command, `summary.json` / `summary.md` as `trace-rl compare` wrote them (recomputed from the copied
runs), each run's `config.yaml`, `metrics.jsonl` and `code.json` (`<method>/seed_<k>/`) packed
into the folder's `runs.tar.xz` (`pack`: `tar -xJf runs.tar.xz` puts them back; every reader here and in
trace_rl takes either form, `trace_rl.storage.rundir.read_run_file` / `run_folders`; no checkpoints, no trees), and the plots, as
256-colour PNGs. The documentation site's results pages are generated from these files when it
is built (`scripts/docs_hooks.py`), so a page can only say what the files say. `reproduce` reruns a run folder's first
steps with the code it was made with and checks that they give the numbers it recorded. `signal` reads
every committed run at once and asks which per-step figure of the allocation goes with learning.
`trees` recomputes where the budget went from a comparison's saved trees (which exports leave out),
for runs made before a `tree/*` figure existed. `study` reads the folders of a pre-registered plan's
phases as one (`trace_rl.research.study`): every row seed by seed, the strongest baseline by the plan's
rule, and the plan's contrasts paired by seed with a t interval and a sign test. `probe` asks of a
run's saved trees what Stage 2 bought (`trace_rl.research.stage2_probe`).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import math
import os
import shutil
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from trace_rl.core.tree import read_jsonl
from trace_rl.infra.config import load_config
from trace_rl.planning.metrics import UnsolvedTally, agreeing_budget
from trace_rl.report.plots import find_runs, plot_contrasts, plot_metrics
from trace_rl.research.compare import CompareConfig, summarise, summary_table
from trace_rl.research.reproduce import code_at, train_with
from trace_rl.research.stage2_probe import probe_run
from trace_rl.research.study import (
    CLOCK_FILE,
    STRONGEST,
    corrected_runs,
    read_pauses,
    run_clocks,
    study,
    study_markdown,
)
from trace_rl.storage.rundir import (
    PACKED_FILES,
    START,
    RunDir,
    pack_runs,
    read_metrics,
    read_run_file,
    run_file_exists,
    seed_runs,
)

REPO = Path(__file__).resolve().parents[1]


def export(run_dir: Path, dest: Path, config_path: Path, pauses: Path | None = None, plots: bool = True) -> dict:
    """Copy the comparison in `run_dir` (made with the compare config at `config_path`) to `dest`.
    With `pauses` (a log of when the runs were paused, `trace_rl.research.study.read_pauses`) the runs'
    step and evaluation times with those pauses taken out go to `dest/clock.json`, from the live runs'
    tree files (which the copy leaves out); the wall-clock plots draw them. `plots=False` for a phase of
    a study whose page draws every row of it (`study --out`): its own plots would repeat a subset."""
    config = load_config(CompareConfig, config_path)
    dest.mkdir(parents=True, exist_ok=True)
    if not (dest / "compare.yaml").exists() or not (dest / "compare.yaml").samefile(config_path):  # re-exporting from the copy
        shutil.copyfile(config_path, dest / "compare.yaml")
    if not (dest / "command.txt").exists():  # once written (and often annotated: commits, seeds run apart), it is the record
        (dest / "command.txt").write_text(f"trace-rl compare --config {config_path.as_posix()} --out {run_dir.as_posix()}\n")
    for run in seed_runs(run_dir):
        target = dest / run.relative_to(run_dir)
        target.mkdir(parents=True, exist_ok=True)
        for name in PACKED_FILES:
            source, copy = run / name, target / name
            if copy.exists() and source.exists() and copy.samefile(source):  # re-exporting from the copy itself
                continue
            if run_file_exists(source):  # a run of a packed folder comes out of its runs.tar.xz
                copy.write_bytes(read_run_file(source))
    if pauses is not None:
        (dest / CLOCK_FILE).write_text(json.dumps(run_clocks([run_dir], read_pauses(pauses)), indent=1, sort_keys=True) + "\n")
    summary = summarise(dest, config)  # from the copies: the committed files reproduce the table
    (dest / "summary.json").write_text(json.dumps(summary, indent=1))
    (dest / "summary.md").write_text(summary_table(summary))
    if plots:
        plot_metrics(corrected_runs([dest]), dest / "plots")
    pack(dest)
    return summary


def pack(folder: Path) -> dict:
    """Make a results folder lean, losing no number: its runs' `metrics.jsonl`, `code.json` and
    `config.yaml`, and the per-step clock `export --pauses` wrote, go into `runs.tar.xz`
    (`trace_rl.storage.rundir.pack_runs`) and its plots become 256-colour PNGs (`shrink_plots`).
    Packing a packed folder changes nothing; the same runs give the same bytes. Returns what was done."""
    archive = pack_runs(folder, extra=(CLOCK_FILE,))
    return {"folder": str(folder), "archive": str(archive) if archive else None, "plots": [str(p) for p in shrink_plots(folder)]}


STUDY_PLOTS = "study_plots"
"""Where `study --out` draws every row of a study (all its folders); the results page shows them."""


def shrink_plots(folder: Path) -> list[Path]:
    """Re-encode the PNGs in `folder/plots` (and a study's `folder/study_plots`) with a palette of 256
    colours (Pillow's octree, no dithering): a third of the bytes of matplotlib's 8-bit RGBA, the lines
    and bands drawn the same (the curves are noise to a PNG's compression; the numbers behind them are
    in the run logs, and `plot_path` draws them again). A plot already in a palette is left as it is;
    returns those re-encoded."""
    from PIL import Image

    changed = []
    for path in sorted([*(folder / "plots").glob("*.png"), *(folder / STUDY_PLOTS).glob("*.png")]):
        with Image.open(path) as image:
            if image.mode == "P":
                continue
            image = image.convert("RGBA")
            opaque = image.getchannel("A").getextrema() == (255, 255)
            small = (image.convert("RGB") if opaque else image).quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
        buffer = io.BytesIO()
        small.save(buffer, "PNG", optimize=True)
        path.write_bytes(buffer.getvalue())
        changed.append(path)
    return changed


WALL_CLOCK = "timing_s/"
"""Keys under this prefix are wall-clock times, never the same twice; `reproduce` leaves them out."""


def reproduce(run: Path, steps: int, commit: str | None = None, overrides: Sequence[str] = ()) -> dict:
    """Rerun the first `steps` training steps of the run folder `run` with its own config and the code
    it was made with (`commit`, default its `code.json`), in a temporary folder, and compare every
    numeric metric of each step with what the run recorded (wall-clock times left out). On CPU the same
    code, config and seed give the same numbers, so `reproduced` means every value is equal (up to
    1e-9, the JSON round trip). The rerun skips evaluation, which draws from the run's random state,
    so only steps before the run's first evaluation can be compared. `overrides` (dotted key=value)
    are for rerunning on later code: a config.yaml holds only the fields its code had, and a field
    added since takes its default (e.g. `sft.packing=false` keeps an older run's warm start).
    `resumed_within`: the run's resumes (`code.json`) before the last compared step, each with the
    commit it continued with: steps after one made by other code are not that commit's to reproduce."""
    recorded = {int(r["step"]): r for r in read_metrics(run / "metrics.jsonl")}
    code = run / "code.json"
    started = json.loads(read_run_file(code)) if run_file_exists(code) else {}
    resumed = [r for r in started.get("resumes", []) if int(r["step"]) < steps]
    if commit is None:
        if not run_file_exists(code):
            raise ValueError(f"{run} has no code.json: name the commit it was made with (--commit)")
        commit = started["commit"]
        if not commit:
            raise ValueError(f"{code} records no commit (the run was made outside a git checkout): pass --commit")
        if commit.endswith("+dirty"):
            raise ValueError(f"{code} says the run was made from uncommitted changes to {commit[:-6]}: git does not hold that code (pass --commit to try a commit anyway)")
    eval_every = int((RunDir(run).read_config().get("train") or {}).get("eval_every", 0) or 0)
    if eval_every and steps >= eval_every:
        raise ValueError(f"steps must be below the run's first evaluation (train.eval_every = {eval_every}), got {steps}")
    missing = [step for step in range(1, steps + 1) if step not in recorded]
    if missing:
        raise ValueError(f"{run} recorded no step {missing[0]}")
    with code_at(commit) as tree, tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "config.yaml"
        config.write_bytes(read_run_file(run / "config.yaml"))  # packed with the logs in a committed result
        records = train_with(tree / "src", config, [f"train.steps={steps}", "train.eval_every=0", *overrides])
    rerun = {int(r["step"]): r for r in records}
    compared, mismatches = compare_steps(recorded, rerun, steps)
    # Float rounding (another batch layout, another machine) moves values by ~1e-7; a real change by far more.
    worst = max((abs(m["rerun"] - m["recorded"]) / max(abs(m["recorded"]), 1e-12) for m in mismatches), default=0.0)
    return {"run": str(run), "commit": commit, "overrides": list(overrides), "steps": steps, "resumed_within": resumed, "values_compared": compared,
            "mismatches": mismatches, "max_relative_difference": worst, "reproduced": not mismatches and compared > 0}


def compare_steps(recorded: dict[int, dict], rerun: dict[int, dict], steps: int) -> tuple[int, list[dict]]:
    """How many numeric values of steps 1..`steps` both hold (wall-clock times left out), and each that
    differs beyond the JSON round trip: {step, key, recorded, rerun}."""
    mismatches, compared = [], 0
    for step in range(1, steps + 1):
        for key, value in rerun[step].items():
            if key.startswith(WALL_CLOCK) or isinstance(value, bool) or not isinstance(value, (int, float)) or key not in recorded[step]:
                continue
            compared += 1
            if not math.isclose(value, recorded[step][key], rel_tol=1e-9, abs_tol=1e-12):
                mismatches.append({"step": step, "key": key, "recorded": recorded[step][key], "rerun": value})
    return compared, mismatches


def _run_signal(run: Path, start: Path, steps: int, budget: int) -> dict | None:
    """One run's held-out gain over its start and its allocation figures (means over its training
    steps); None for a run not finished to `steps`, without a start, or that spent other than `budget`
    rollouts a step (DAPO's redraws: the comparison is at an equal budget)."""
    lines = list(read_metrics(run / "metrics.jsonl"))
    final = [r["val/accuracy_sampled"] for r in lines if r.get("step") == steps and "val/accuracy_sampled" in r]
    first = [r["val/accuracy_sampled"] for r in read_metrics(start) if "val/accuracy_sampled" in r] if run_file_exists(start) else []
    train = [r for r in lines if "tree/effective_ratio" in r and "tree/prompts_sampled" in r and "tree/leaves" in r]
    spent = [r["rollout/rollouts_total"] for r in lines if r.get("step") == steps and "rollout/rollouts_total" in r]
    if not final or not first or not train or spent[-1:] != [budget * steps]:
        return None
    ratio, share = np.array([r["tree/effective_ratio"] for r in train]), np.array([r["tree/mixed_budget_share"] for r in train])
    sampled, leaves = np.array([r["tree/prompts_sampled"] for r in train]), np.array([r["tree/leaves"] for r in train])
    mixed = ratio * sampled  # prompts with a success and a failure, a step
    figures = {"effective_ratio": ratio.mean(), "mixed_budget_share": share.mean(), "prompts_sampled": sampled.mean(),
               "mixed_prompts": mixed.mean(), "samples_per_mixed_prompt": (share * leaves).mean() / max(mixed.mean(), 1e-12)}
    return {"gain": final[-1] - first[0], **{k: float(v) for k, v in figures.items()}}


def _correlation(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Pearson's r; None where either side does not vary (no ranking to compare)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def signal(results: Path) -> dict:
    """Which figure of the allocation goes with held-out gain, over every comparison under `results`.

    A regime is one budget within a folder (how many candidates a step offers is the method's choice,
    as `grpo_8x8`'s 8 against 32); folders that share a run (a run copied into another comparison,
    identical metrics) are one regime, and a shared run counts once. Within each regime with two or more
    methods, each figure and the gain are taken relative to the regime's mean, over method means (seeds
    averaged) and over single runs, and pooled: the Pearson correlation of the two says how well the
    figure ranks methods by what they learned, free of each regime's own level. Regimes with three or
    more methods also get their own correlation over method means.
    """
    runs: dict[str, dict] = {}  # by method, seed and the metrics file's hash
    parent: dict[str, str] = {}

    def root(folder: str) -> str:
        while parent.setdefault(folder, folder) != folder:
            folder = parent[folder]
        return folder

    for folder in sorted(p for p in results.iterdir() if (p / "summary.json").is_file()):
        steps = int(json.loads((folder / "summary.json").read_text())["config"]["run"]["train"]["steps"])
        for run in seed_runs(folder):
            if run.parent.name == START:
                continue
            key = f"{run.parent.name}/{run.name}/{hashlib.sha256(read_run_file(run / 'metrics.jsonl')).hexdigest()}"
            if key in runs:
                parent[root(folder.name)] = root(runs[key]["folder"])
                continue
            budget = int((RunDir(run).read_config().get("rollout") or {}).get("budget", 0))
            found = _run_signal(run, folder / "react" / run.name / "metrics.jsonl", steps, budget)
            if found is None:
                continue
            runs[key] = {"folder": folder.name, "budget": budget, "method": run.parent.name, **found}
    joined: dict[str, list[str]] = {}  # each group of folders, named by its root
    for folder in sorted({run["folder"] for run in runs.values()}):
        joined.setdefault(root(folder), []).append(folder)
    regimes: dict[str, dict[str, list[dict]]] = {}
    for run in runs.values():
        name = f"{' + '.join(joined[root(run['folder'])])} (budget {run['budget']})"
        regimes.setdefault(name, {}).setdefault(run["method"], []).append(run)
    figures = [k for k in next(iter(runs.values()), {}) if k not in ("folder", "budget", "method", "gain")]
    pooled = {level: {k: [] for k in ["gain", *figures]} for level in ("methods", "runs")}
    table, within = {}, {}
    for name, methods in sorted(regimes.items()):
        if len(methods) < 2:
            continue
        means = {m: {k: float(np.mean([r[k] for r in rs])) for k in ["gain", *figures]} | {"seeds": len(rs)} for m, rs in methods.items()}
        table[name] = means
        if len(methods) >= 3:  # enough methods for a regime's own ranking to say something
            gains = [means[m]["gain"] for m in methods]
            within[name] = {k: _correlation([means[m][k] for m in methods], gains) for k in figures}
        every = [r for rs in methods.values() for r in rs]
        for k in ["gain", *figures]:
            level = np.array([means[m][k] for m in methods])
            pooled["methods"][k] += list(level - level.mean())
            single = np.array([r[k] for r in every])
            pooled["runs"][k] += list(single - single.mean())
    correlation = {level: {k: _correlation(v[k], v["gain"]) for k in figures} for level, v in pooled.items()}
    return {"regimes": table, "points": {level: len(v["gain"]) for level, v in pooled.items()}, "correlation_with_gain": correlation,
            "correlation_within_regime": within}


UNMIXED = ("failed_budget_share", "solved_budget_share", "most_leaves_unmixed")
"""The budget that cannot teach (`trace_rl.planning.metrics.agreeing_budget`, logged as `tree/<name>`), what `trees` recomputes."""


def tree_figures(run: Path, warmup: int, at_least: int) -> dict | None:
    """A run's `UNMIXED` figures from its saved trees, means over the steps after `warmup`; also the
    largest `most_leaves_unmixed`, on how many steps some prompt got `at_least` rollouts without
    mixing, and `rollout/unsolved_share` as the trainer logs it (the trainer's `UnsolvedTally`: the tally runs
    over every step, the mean is over those after `warmup`). None for a run without saved trees after
    the warm-up."""
    figures, unsolved = [], []
    tally = UnsolvedTally()
    for step, path in sorted(RunDir(run).tree_files().items()):  # one step's trees in memory at a time
        batch = read_jsonl(path)
        if step > warmup:
            figures.append(agreeing_budget(batch))
            unsolved.append(tally.share(batch))
        tally.add(batch)
    steps = np.array(figures, dtype=np.float64).reshape(-1, len(UNMIXED))
    if not steps.size:
        return None
    most = steps[:, 2]
    return {"steps": len(steps), **{k: float(v) for k, v in zip(UNMIXED, steps.mean(axis=0))},
            "most_leaves_unmixed_max": float(most.max()), f"steps_with_{at_least}_or_more_unmixed": int((most >= at_least).sum()),
            "unsolved_share": float(np.mean(unsolved))}


def with_seed_means(rows: dict[str, dict]) -> dict[str, dict]:
    """`rows` (row -> {"seeds": {seed: figures}}) with each row's "mean": every numeric figure averaged
    over its seeds (`trees.json` and `probe.json` hold them so)."""
    for figures in rows.values():
        numbers = [{k: v for k, v in seed.items() if isinstance(v, (int, float))} for seed in figures["seeds"].values()]
        figures["mean"] = {k: float(np.mean([n[k] for n in numbers])) for k in numbers[0]}
    return rows


def trees(run_dir: Path, warmup: int = 5, at_least: int = 12) -> dict:
    """`tree_figures` of every finished run of a comparison folder that kept its trees (one whose metrics
    reached its config's `train.steps`), by method and seed, with each method's mean over its seeds;
    runs still going are listed apart."""
    found: dict[str, dict] = {}
    unfinished = []
    for run in (run for method, runs in find_runs(run_dir).items() if method != START for run in runs):
        steps = int((RunDir(run).read_config().get("train") or {}).get("steps", 0))
        if RunDir(run).finished_steps() < steps:
            unfinished.append(f"{run.parent.name}/{run.name}")
            continue
        figures = tree_figures(run, warmup, at_least)
        if figures is not None:
            found.setdefault(run.parent.name, {"seeds": {}})["seeds"][run.name] = figures
    return {"warmup": warmup, "at_least": at_least, "methods": with_seed_means(found), "unfinished": unfinished}


def probe(folders: Sequence[Path], rows: Sequence[str] = (), warmup: int = 5) -> dict:
    """`trace_rl.research.stage2_probe.probe_run` on every run (with saved trees and a Stage 2) of the
    folders, by row and seed, with each row's mean over its seeds."""
    found: dict[str, dict] = {}
    for folder in folders:
        for row, runs in find_runs(folder).items():
            if rows and row not in rows:
                continue
            for run in runs:
                if not RunDir(run).tree_files():
                    continue
                result = probe_run(run, warmup=warmup)
                if result.get("prefixes"):
                    found.setdefault(row, {"seeds": {}})["seeds"][run.name] = result
    return {"warmup": warmup, "rows": with_seed_means(found)}


def _print_json(data: dict, out: Path | None) -> int:
    """Print `data` as indented JSON, and write it to `out` too when given."""
    text = json.dumps(data, indent=1)
    if out:
        out.write_text(text + "\n")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    exporting = commands.add_parser("export", help="copy a comparison's runs, summary and plots to a results folder")
    exporting.add_argument("run_dir", type=Path)
    exporting.add_argument("dest", type=Path)
    exporting.add_argument("--config", type=Path, required=True, help="the compare config the runs were made with")
    exporting.add_argument("--pauses", type=Path, help="a log of when the runs were paused: their clock without those pauses goes to clock.json")
    exporting.add_argument("--no-plots", dest="plots", action="store_false", help="no plots/ (a study's phase: `study --out` draws every row)")
    studying = commands.add_parser("study", help="a pre-registered study over several comparison folders: rows by seed, paired contrasts")
    studying.add_argument("folders", nargs="+", type=Path, help="the comparison folders of the study's phases (live or exported)")
    studying.add_argument("--steps", type=int, required=True, help="a run counts once its log reaches this step")
    studying.add_argument("--reference", help="every row is also paired against this row (e.g. grpo)")
    studying.add_argument("--contrast", action="append", default=[], metavar="A:B",
                          help=f"a paired contrast A - B (repeatable); B may be {STRONGEST}, the row the plan's rule chose")
    studying.add_argument("--candidates", nargs="*", default=[], help="the rows the strongest baseline is chosen among, in the plan's order")
    studying.add_argument("--baseline-seeds", nargs="*", type=int, default=[], help="the seeds it is chosen on")
    studying.add_argument("--order", nargs="*", default=[], help="rows in this order in the table (others after)")
    studying.add_argument("--pauses", type=Path, help="a log of pauses, taken out of live runs' wall-clock")
    studying.add_argument("--out", type=Path, help=f"write study.json, study.md and plots ({STUDY_PLOTS}/) here")
    again = commands.add_parser("reproduce", help="rerun a run folder's first steps with its own code and compare their metrics")
    again.add_argument("run_dir", type=Path)
    again.add_argument("--steps", type=int, default=2)
    again.add_argument("--commit", help="the commit the run was made with (default: its code.json)")
    again.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                       help="a dotted override, for a field the run's config predates (repeatable)")
    signals = commands.add_parser("signal", help="which allocation figure goes with held-out gain, over every results folder")
    signals.add_argument("--results", type=Path, default=REPO / "docs" / "results")
    saved = commands.add_parser("trees", help="where the budget went, recomputed from a comparison's saved trees (unmixed groups, rollouts on prompts shown unsolved)")
    saved.add_argument("run_dir", type=Path)
    saved.add_argument("--warmup", type=int, default=5, help="steps left out at the start (default 5)")
    saved.add_argument("--at-least", type=int, default=12, help="count steps where a prompt got this many rollouts without mixing")
    saved.add_argument("--out", type=Path, help="also write the JSON here")
    probing = commands.add_parser("probe", help="what Stage 2 bought: predicted flips against the flips seen, the advantage mass on continuations")
    probing.add_argument("folders", nargs="+", type=Path, help="run folders or comparison folders with their saved trees")
    probing.add_argument("--rows", nargs="*", default=[], help="only these rows of a comparison (default: every row that has trees)")
    probing.add_argument("--warmup", type=int, default=5, help="steps left out at the start (default 5)")
    probing.add_argument("--out", type=Path, help="also write the JSON here")
    packing = commands.add_parser("pack", help="pack results folders: run logs into runs.tar.xz, plots as 256-colour PNGs")
    packing.add_argument("folders", nargs="*", type=Path, help="results folders (default: every folder under docs/results)")
    args = parser.parse_args(argv)
    try:
        _check_inputs(args)
        return _run(args)
    except (OSError, ValueError, KeyError, EOFError, tarfile.TarError, lzma.LZMAError, zipfile.BadZipFile) as exc:
        if os.environ.get("TRACE_RL_TRACEBACK"):
            raise
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"results.py {args.command}: {type(exc).__name__}: {text} (TRACE_RL_TRACEBACK=1 shows where)", file=sys.stderr)
        return 2


def _check_inputs(args: argparse.Namespace) -> None:
    """The paths a subcommand reads exist and are what it reads (a folder, a file), and its numbers are
    in range: one line (exit 2) before any work, not a traceback from the middle of it."""
    folders = {"export": ["run_dir"], "study": ["folders"], "reproduce": ["run_dir"], "trees": ["run_dir"],
               "probe": ["folders"], "pack": ["folders"], "signal": ["results"]}[args.command]
    files = {"export": ["config", "pauses"], "study": ["pauses"]}.get(args.command, [])
    for name in folders:
        for path in (lambda v: v if isinstance(v, list) else [v])(getattr(args, name)):
            if not path.is_dir():
                raise NotADirectoryError(f"{path} is not a folder" + ("" if path.exists() else " (it does not exist)"))
    for name in files:
        path = getattr(args, name)
        if path is not None and not path.is_file():
            raise FileNotFoundError(f"--{name} {path} is not a file" + ("" if path.exists() else " (it does not exist)"))
    if args.command == "reproduce" and not (args.run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{args.run_dir} has no config.yaml: give a run folder (ROW/seed_K of a comparison)")
    for name in ("steps", "warmup", "at_least"):
        value = getattr(args, name, None)
        if value is not None and value < (1 if name == "steps" else 0):
            raise ValueError(f"--{name.replace('_', '-')} must be {'>= 1' if name == 'steps' else '>= 0'}, got {value}")


def _run(args: argparse.Namespace) -> int:
    if args.command == "pack":
        folders = args.folders or sorted(p for p in (REPO / "docs" / "results").iterdir() if p.is_dir())
        for folder in folders:
            done = pack(folder)
            if done["archive"] or done["plots"]:
                size = f"{Path(done['archive']).stat().st_size / 1024:.0f} KiB" if done["archive"] else "no"
                print(f"{folder}: {size} runs.tar.xz, {len(done['plots'])} plots re-encoded")
        return 0
    if args.command == "trees":
        return _print_json(trees(args.run_dir, args.warmup, args.at_least), args.out)
    if args.command == "study":
        pauses = read_pauses(args.pauses) if args.pauses else None
        result = study(args.folders, steps=args.steps, contrasts=args.contrast, reference=args.reference, candidates=args.candidates,
                       baseline_seeds=args.baseline_seeds, pauses=pauses, order=args.order)
        text = study_markdown(result)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "study.json").write_text(json.dumps(result, indent=1) + "\n")
            (args.out / "study.md").write_text(text)
            plot_metrics(corrected_runs(args.folders, pauses), args.out / STUDY_PLOTS)
            plot_contrasts(result, args.out / STUDY_PLOTS / "contrasts.png")
            shrink_plots(args.out)
        print(text)
        return 0
    if args.command == "probe":
        return _print_json(probe(args.folders, args.rows, args.warmup), args.out)
    if args.command == "signal":
        print(json.dumps(signal(args.results), indent=1))
        return 0
    if args.command == "reproduce":
        result = reproduce(args.run_dir, args.steps, args.commit, args.overrides)
        print(json.dumps(result))
        return 0 if result["reproduced"] else 1
    summary = export(args.run_dir, args.dest, args.config, args.pauses, args.plots)
    print(summary_table(summary), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
