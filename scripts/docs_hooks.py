"""MkDocs hooks (mkdocs.yml `hooks:`): one results page per committed comparison, made at build time.

Each `docs/results/<name>/` exported by `scripts/results.py export` holds `summary.json` (what
`trace-rl compare` wrote, recomputed from the copied runs), `compare.yaml` (whose opening comment says
what the comparison asks and what it found), `command.txt` and `plots/`. The page for it is generated
from those files alone, `results/<name>.md`, and added to the nav under "Results", so a page can only
say what the committed files say and never drifts from them.
"""

from __future__ import annotations

import json
from pathlib import Path

from trace_rl.planning.metrics import UNSOLVED_AFTER
from trace_rl.report.plots import PANELS
from trace_rl.research.compare import summary_table
from trace_rl.research.stage2_probe import probe_markdown

ORDER = {"contrasts": -1, **{panel.name: i for i, panel in enumerate(PANELS)}}
TITLES = {"contrasts": "Paired differences (the study's analysis)", **{panel.name: panel.title for panel in PANELS}}
"""A plot's place and heading on its page: the order and titles `plot_metrics` draws them with."""


def comparisons(docs_dir: Path) -> list[Path]:
    """The exported comparisons under docs/results, by name."""
    return sorted(p.parent for p in (docs_dir / "results").glob("*/summary.json"))


def about(compare_yaml: Path) -> list[str]:
    """The paragraphs of a compare config's opening comment (its commands left out: the page shows them)."""
    paragraphs, current = [], []
    for line in compare_yaml.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        if text.startswith(("trace-rl ", "python ")):
            continue
        if text.startswith("- ") and current:  # a list item starts its own paragraph
            paragraphs.append(" ".join(current))
            current = []
        if text:
            current.append(text)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return paragraphs


TREE_COLUMNS = (
    ("failed_budget_share", "budget in groups that all failed", ".3f"),
    ("solved_budget_share", "that all succeeded", ".3f"),
    ("unsolved_share", "on prompts the run had shown unsolved", ".3f"),
    ("most_leaves_unmixed_max", "most rollouts one prompt got unmixed", ".1f"),
)


def trees_markdown(result: dict) -> str:
    """The table of `scripts/results.py trees` (`trees.json`): each method's means over its seeds."""
    at_least = result.get("at_least", 12)
    columns = (*TREE_COLUMNS, (f"steps_with_{at_least}_or_more_unmixed", f"steps with a prompt at {at_least} or more unmixed", ".1f"))
    lines = ["| method | seeds | " + " | ".join(title for _, title, _ in columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for method, figures in result["methods"].items():
        mean = figures["mean"]
        lines.append(f"| {method} | {len(figures['seeds'])} | " + " | ".join(format(mean[key], spec) if key in mean else "—" for key, _, spec in columns) + " |")
    lines += ["", (f"From the runs' saved trees (`trees.json`, `scripts/results.py trees`), over the steps after the first "
                   f"{result['warmup']}. A prompt counts as shown unsolved once {UNSOLVED_AFTER} or more of its earlier rollouts "
                   "had all failed (`rollout/unsolved_share`); the last two columns are the most rollouts a prompt got in one step with "
                   f"no success and failure among them, over a run's steps, and on how many steps some prompt got {at_least} or more that way.")]
    if result.get("unfinished"):
        lines += ["", "Not counted (unfinished): " + ", ".join(result["unfinished"]) + "."]
    if result.get("from_saved_figures"):
        lines += ["", "Figures of " + ", ".join(result["from_saved_figures"]) + " as saved when each run finished (its trees are not kept)."]
    return "\n".join(lines) + "\n"


def page(folder: Path) -> str:
    """The Markdown of one comparison's page, from its committed files."""
    summary = json.loads((folder / "summary.json").read_text())
    steps = summary["config"]["run"]["train"]["steps"]
    commands = (folder / "command.txt").read_text().strip()
    parts = [f"# {folder.name}", "", *[p + "\n" for p in about(folder / "compare.yaml")]]
    parts += ["## Command", "", "```bash", commands, "```", "",
              (f"{steps} training steps a run. The files, with every run's config and per-step log: "
               f"`docs/results/{folder.name}/` in the repository; `python scripts/results.py reproduce` reruns a run's first steps."),
              "", "## Table", "", summary_table(summary), ""]
    if (folder / "study.md").exists():  # a pre-registered study over this and other folders (`scripts/results.py study`)
        plan = " Its plan: [plan.md](" + f"{folder.name}/plan.md)." if (folder / "plan.md").exists() else ""
        parts += ["## The pre-registered analysis", "",
                  (f"Every row of the study, over all its phases' folders, and the contrasts its plan names, paired by seed "
                   f"(`study.json`, made by the command in `command.txt`).{plan}"), "", (folder / "study.md").read_text(), ""]
    if (folder / "trees.json").exists():  # `scripts/results.py trees` on this folder's live runs
        parts += ["## Where the budget went", "", trees_markdown(json.loads((folder / "trees.json").read_text())), ""]
    if (folder / "probe.json").exists():  # `scripts/results.py probe` on the study's runs with a Stage 2
        parts += ["## What Stage 2 bought", "",
                  ("Per prefix Stage 2 continued: the chance its value gave that a continuation flips the outcome of the rollout "
                   "it came from, against what the continuations did; and the update's side, the share of the advantage mass "
                   "on the continuations' tokens (`probe.json`, `scripts/results.py probe`)."), "",
                  probe_markdown(json.loads((folder / "probe.json").read_text())), ""]
    plots = list((folder / "study_plots").glob("*.png")) or list((folder / "plots").glob("*.png"))
    plots.sort(key=lambda plot: (ORDER.get(plot.stem, len(ORDER)), plot.stem))
    if plots:
        parts += ["## Plots", ""]
        if plots[0].parent.name == "study_plots":  # every row of the study, over all its folders
            alone = "; this folder's rows alone: `plots/`" if (folder / "plots").is_dir() else ""
            parts += [f"Every row of the study, over all its folders (`study_plots/`{alone}).", ""]
        for plot in plots:
            title = TITLES.get(plot.stem, plot.stem.replace("_", " "))
            parts += [f"### {title}", "", f"![{title}]({folder.name}/{plot.parent.name}/{plot.name})", ""]
    return "\n".join(parts)


def on_config(config):
    """List the generated pages in the nav, under "Results", after the hand-written ones."""
    docs = Path(config["docs_dir"])
    entries = [{folder.name: f"results/{folder.name}.md"} for folder in comparisons(docs)]
    for section in config["nav"]:
        if isinstance(section, dict) and "Results" in section:
            section["Results"] = [*section["Results"], {"Comparisons": entries}]
            return config
    raise ValueError("mkdocs.yml's nav has no 'Results' section for the generated comparison pages")


def on_files(files, config):
    # Only the site build needs mkdocs; the page functions above do not (the tests call them without it).
    from mkdocs.structure.files import File

    docs = Path(config["docs_dir"])
    for folder in comparisons(docs):
        files.append(File.generated(config, f"results/{folder.name}.md", content=page(folder)))
    return files
