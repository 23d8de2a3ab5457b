"""Results as data: export a finished comparison into docs/results/<name>/, and write the README's
results section from those files.

    python scripts/results.py export runs/paper_main docs/results/paper_main --config configs/paper_main.yaml
    python scripts/results.py readme            # rewrites README.md between the results markers

An exported folder holds what it takes to check or redo every number: the compare config and the
command, `summary.json` / `summary.md` as `trace-rl compare` wrote them (recomputed from the copied
runs), each run's `config.yaml`, `metrics.jsonl` and `code.json` at `<method>/seed_<k>/` (no checkpoints, no
trees), and the plots. The README's tables are `trace_rl.compare.summary_table` of each
`summary.json`, so a table can only say what the files say.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from trace_rl.compare import CompareConfig, summarise, summary_table
from trace_rl.config import load_config
from trace_rl.report.plots import plot_path

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- results:begin (scripts/results.py readme) -->", "<!-- results:end -->"


def export(run_dir: Path, dest: Path, config_path: Path) -> dict:
    """Copy the comparison in `run_dir` (made with the compare config at `config_path`) to `dest`."""
    config = load_config(CompareConfig, config_path)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config_path, dest / "compare.yaml")
    command = f"trace-rl compare --config {config_path.as_posix()} --out {run_dir.as_posix()}"
    (dest / "command.txt").write_text(command + "\n")
    for run in sorted(run_dir.glob("*/seed_*")):
        if not (run / "metrics.jsonl").is_file():
            continue
        target = dest / run.relative_to(run_dir)
        target.mkdir(parents=True, exist_ok=True)
        for name in ("config.yaml", "metrics.jsonl", "code.json"):
            if (run / name).is_file():
                shutil.copyfile(run / name, target / name)
    summary = summarise(dest, config)  # from the copies: the committed files reproduce the table
    (dest / "summary.json").write_text(json.dumps(summary, indent=1))
    (dest / "summary.md").write_text(summary_table(summary))
    plot_path(dest, dest / "plots")
    return summary


def readme_section(results: Path, repo: Path = REPO) -> str:
    """One subsection per exported comparison: its config's opening comment, its command, its table."""
    parts = [BEGIN, ""]
    for folder in sorted(p for p in results.iterdir() if (p / "summary.json").is_file()):
        summary = json.loads((folder / "summary.json").read_text())
        comment = [line[1:].strip() for line in (folder / "compare.yaml").read_text().splitlines() if line.startswith("#")]
        about = " ".join(line for line in comment if line and not line.startswith(("trace-rl ", "python ")))
        steps = summary["config"]["run"]["train"]["steps"]
        parts += [
            f"### {folder.name}",
            "",
            about,
            "",
            f"`{(folder / 'command.txt').read_text().splitlines()[0]}` ({steps} steps; files: `{folder.relative_to(repo).as_posix()}/`)",
            "",
            summary_table(summary),
        ]
    parts.append(END)
    return "\n".join(parts)


def write_readme(readme: Path, results: Path, repo: Path = REPO) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no results markers: add the lines\n{BEGIN}\n{END}\nwhere the section goes")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + readme_section(results, repo) + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    exporting = commands.add_parser("export", help="copy a comparison's runs, summary and plots to a results folder")
    exporting.add_argument("run_dir", type=Path)
    exporting.add_argument("dest", type=Path)
    exporting.add_argument("--config", type=Path, required=True, help="the compare config the runs were made with")
    readme = commands.add_parser("readme", help="rewrite README.md's results section from docs/results/")
    readme.add_argument("--results", type=Path, default=REPO / "docs" / "results")
    readme.add_argument("--readme", type=Path, default=REPO / "README.md")
    args = parser.parse_args(argv)
    if args.command == "export":
        summary = export(args.run_dir, args.dest, args.config)
        print(summary_table(summary), file=sys.stderr)
    else:
        write_readme(args.readme, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
