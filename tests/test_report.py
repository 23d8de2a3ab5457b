"""Reports: plots from run and comparison folders, the tree viewer's data, and report.html."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from trace_rl.core.tree import RolloutTree, read_jsonl, write_jsonl
from trace_rl.report import (
    ViewerLimits,
    build_report,
    find_runs,
    load_run,
    plot_runs,
    viewer_data,
    write_report,
    write_viewer,
)
from trace_rl.report.viewer import embed_json

EVIL = "</script><script>alert(1)</script>"
EVIL_OBSERVATION = "<img src=x onerror=alert(2)> <!-- & \u2028 </SCRIPT >"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- a fake but real run folder


def make_tree(rng: np.random.Generator, task_id: str, question: str, *, bare: int = 3, expand: int = 2) -> RolloutTree:
    """A TRACE-shaped tree: `bare` rollouts of three turns, then `expand` continuations from one prefix."""
    tree = RolloutTree.new(task_id, question, prompt_token_ids=range(12), meta={"source": "multihop"})
    tree.root.predicted, tree.root.budget = 0.4, bare + expand
    first_turns = []
    for j in range(bare):
        a = tree.add_turn(
            0,
            thought=f"I should look up the bridge entity, try {j}.",
            action=f'search("entity {task_id} {j}")',
            observation=f"[1] Document {j} about entity {task_id}: it was founded in 18{j}0.",
            token_ids=range(20),
            mask=[1] * 12 + [0] * 8,
            info={"finish_reason": "stop"},
        )
        first_turns.append(a)
        b = tree.add_turn(a, thought="Now answer.", action=f'answer("18{j}0")', reward=float(rng.random() < 0.5))
        del b
    anchor = first_turns[0]
    tree.nodes[anchor].predicted, tree.nodes[anchor].budget = 0.55, expand
    for k in range(expand):
        tree.add_turn(anchor, thought=f"Check once more ({k}).", action=f'answer("alt {k}")', reward=float(k % 2))
    return tree


def write_run(
    run_dir: Path,
    *,
    method: str = "trace",
    steps: int = 3,
    trees_per_step: int = 4,
    seed: int = 0,
    predictor: bool = True,
    evil: bool = True,
) -> Path:
    """A run folder as the trainer writes it: config.yaml, metrics.jsonl (train and eval lines), trees/."""
    rng = np.random.default_rng(seed)
    (run_dir / "trees").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"seed: {seed}\nrollout:\n  method: {method}\n  budget: 20\n")
    lines = [{"step": 0, "method": method, "val/accuracy_greedy": 0.2, "val/accuracy_sampled": 0.15}]
    for step in range(1, steps + 1):
        trees = [
            make_tree(rng, f"mh-{step}-{i}", f"Which year was entity {i} founded?", bare=2 + i % 3)
            for i in range(trees_per_step)
        ]
        if evil and step == 1:
            node = trees[0].nodes[1]
            node.thought, node.observation = f"thinking {EVIL}", EVIL_OBSERVATION
            trees[0].prompt = f"Question with {EVIL} inside"
        write_jsonl(trees, run_dir / "trees" / f"step_{step:04d}.jsonl")
        line = {
            "step": step,
            "method": method,
            "critic/score/mean": float(rng.random()),
            "tree/effective_ratio": 0.3 + 0.1 * step,
            "tree/mixed_budget_share": 0.4 + 0.05 * step,
            "rollout/rollouts_total": 20 * step,
            "timing_s/step": 1.5,
            "actor/pg_loss": -0.01 * step,
        }
        if predictor:
            line |= {"predictor/brier": 0.25 - 0.01 * step, "predictor/ece": 0.1}
        lines.append(line)
    lines.append({"step": steps, "method": method, "val/accuracy_greedy": 0.5, "val/accuracy_sampled": 0.45})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run_dir


def write_comparison(folder: Path, methods: tuple[str, ...] = ("grpo", "trace"), seeds: int = 2) -> Path:
    for method in methods:
        for seed in range(seeds):
            write_run(folder / method / f"seed_{seed}", method=method, seed=seed, steps=2, predictor=method != "grpo")
    summary = {
        "methods": {
            m: {
                "effective_ratio": 0.3 + 0.3 * (m == "trace"),
                "mixed_budget_share": 0.5,
                "final_accuracy": 0.4,
                "final_accuracy_std": 0.02,
                "rollouts": 40,
                "tokens": 12345,
            }
            for m in methods
        },
        "config": {"budget": 20, "note": EVIL},
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def embedded_data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="tv-data">(.*?)</script>', page, re.S)
    assert match, "viewer data script not found"
    return json.loads(match.group(1))


# ---------------------------------------------------------------- plots


def test_plot_runs_writes_valid_pngs_for_every_panel_with_data(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    written = plot_runs({"trace": [run]}, tmp_path / "plots")
    names = [p.stem for p in written]
    assert names == [
        "reward",
        "accuracy",
        "accuracy_vs_rollouts",
        "accuracy_vs_minutes",
        "effective_ratio",
        "mixed_budget_share",
        "calibration",
    ]
    for path in written:
        width, height = png_size(path)
        assert width > 300 and height > 200
    from matplotlib.image import imread

    assert imread(written[0]).ndim == 3  # decodes as an image, not just a header


def test_plots_skip_missing_keys_without_failing(tmp_path: Path) -> None:
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\n{"step": 2, "critic/score/mean": NaN}\n')
    assert [p.stem for p in plot_runs({"old": [old]}, tmp_path / "a")] == ["reward"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert plot_runs({"empty": [empty]}, tmp_path / "b") == []
    no_predictor = write_run(tmp_path / "grpo", method="grpo", predictor=False)
    stems = [p.stem for p in plot_runs({"grpo": [no_predictor]}, tmp_path / "c")]
    assert "calibration" not in stems and "effective_ratio" in stems


def test_comparison_plots_aggregate_seeds_per_method(tmp_path: Path) -> None:
    folder = write_comparison(tmp_path / "cmp")
    runs = find_runs(folder)
    assert list(runs) == ["grpo", "trace"]  # DESIGN.md's order
    assert [p.name for p in runs["trace"]] == ["seed_0", "seed_1"]
    written = plot_runs(runs, tmp_path / "out")
    assert "calibration" in [p.stem for p in written]  # only trace has a predictor: still drawn


def test_a_long_method_name_is_wrapped_at_its_underscores_to_fit_the_legend_margin() -> None:
    from trace_rl.report.plots import _LEGEND_WIDTH, _wrap_name

    wrapped = _wrap_name("trace_prompt_evidence_32x6")
    assert wrapped == "trace_prompt_\nevidence_32x6"
    assert _wrap_name("grpo") == "grpo"
    long_part = _wrap_name("x" * 45)
    assert all(len(line) <= _LEGEND_WIDTH for line in long_part.split("\n"))
    assert long_part.replace("\n", "") == "x" * 45


def test_every_row_of_a_figure_has_its_own_colour_and_a_variant_its_methods_when_free() -> None:
    from trace_rl.report.plots import METHOD_COLORS, method_colors

    rows = ["grpo", "grpo_4", "grpo_8", "dapo_8x4", "knapsack", "pcl", "knapsack_16", "brace", "trace_stage1", "trace", "trace_expected"]
    colors = method_colors(rows)
    assert list(colors) == rows and len(set(colors.values())) == len(rows)  # 11 rows once shared 5 spare colours
    assert all(colors[m] == METHOD_COLORS[m] for m in rows if m in METHOD_COLORS)
    assert colors["dapo_8x4"] == METHOD_COLORS["dapo"]  # dapo itself is not in the figure
    assert method_colors(["trace", "trace_stage1_x"])["trace_stage1_x"] == METHOD_COLORS["trace_stage1"]  # the longest name it extends
    many = method_colors([f"row_{i}" for i in range(len(METHOD_COLORS) + 16)])
    assert len(set(many.values())) == 16  # past the spare palette colours repeat, nothing fails


def test_a_token_axis_is_labelled_in_thousands_and_a_step_axis_as_it_is() -> None:
    from trace_rl.report.plots import _thousands

    formatter = _thousands(320_000.0)
    assert [formatter(x) for x in (0, 40_000, 120_000, 1_200_000)] == ["0", "40k", "120k", "1.2M"]
    assert _thousands(100.0) is None and _thousands(9_999.0) is None


def test_a_single_run_shows_each_evaluations_95_percent_interval_and_several_runs_their_spread(tmp_path: Path) -> None:
    from trace_rl.report.plots import Z95, curve

    lines = [
        {"step": 5, "val/accuracy_sampled": 0.50, "val/accuracy_sampled_se": 0.033, "val/accuracy_greedy": 0.7},
        {"step": 10, "val/accuracy_sampled": 0.41, "val/accuracy_sampled_se": 0.031, "val/accuracy_greedy": 0.6},
        {"step": 15, "val/accuracy_sampled": 0.44},  # an older run's line without an SE
    ]
    for seed in (0, 1):
        (tmp_path / f"seed_{seed}").mkdir()
        (tmp_path / f"seed_{seed}" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    one = [load_run(tmp_path / "seed_0")]
    sampled = curve(one, "val/accuracy_sampled")
    assert sampled is not None and sampled.interval is not None
    np.testing.assert_allclose(sampled.interval[:2], [Z95 * 0.033, Z95 * 0.031])
    assert np.isnan(sampled.interval[2])
    greedy = curve(one, "val/accuracy_greedy")
    assert greedy is not None and greedy.interval is None  # greedy decoding logs no SE
    both = curve(one + [load_run(tmp_path / "seed_1")], "val/accuracy_sampled")
    assert both is not None and both.runs == 2 and both.interval is None
    written = plot_runs({"trace": [tmp_path / "seed_0"]}, tmp_path / "out")
    assert "accuracy" in [p.stem for p in written]


def test_a_panels_title_says_what_its_bars_are_the_interval_of() -> None:
    from trace_rl.report.plots import PANELS, panel_title

    panels = {panel.name: panel for panel in PANELS}
    assert panel_title(panels["accuracy"], 1, True).endswith("bars: 95% interval of each evaluation's own sampling noise")
    assert panel_title(panels["calibration"], 1, True).endswith("bars: 95% interval of each step's Brier over its prompts")
    assert panel_title(panels["calibration"], 3, True).endswith("mean over seeds (up to 3), band: min–max")
    assert panel_title(panels["calibration"], 1, False) == panels["calibration"].title
    assert panel_title(panels["calibration"], 3, True, 10).endswith("band: min–max, 10-step moving average")
    assert panel_title(panels["calibration"], 1, False, 10) == panels["calibration"].title + "\n10-step moving average"


def test_a_long_curve_is_drawn_as_its_trailing_moving_average_and_a_short_one_as_it_is() -> None:
    from trace_rl.report.plots import Curve, smoothed

    x = np.arange(1.0, 21.0)
    long = Curve(x=x, mean=x - 1, low=x - 2, high=x, runs=2, interval=np.ones(20))
    drawn = smoothed(long)  # 20 points: a window of 2, the first point its own mean
    assert drawn.window == 2 and drawn.interval is None and list(drawn.x) == list(x)
    assert list(drawn.mean) == [0.0] + [k + 0.5 for k in range(19)]
    assert list(drawn.low) == [-1.0] + [k - 0.5 for k in range(19)]
    short = Curve(x=x[:19], mean=x[:19], low=x[:19], high=x[:19], runs=1)
    assert smoothed(short) is short


def test_a_packed_comparison_reads_and_plots_as_the_plain_one(tmp_path: Path) -> None:
    """A committed result keeps its run logs in `runs.tar.xz` (`trace_rl.storage.rundir.pack_runs`): the same
    runs, rows and report as before packing."""
    from trace_rl.storage.rundir import pack_runs

    folder = write_comparison(tmp_path / "cmp")
    runs = find_runs(folder)
    rows = {m: [load_run(p).rows for p in paths] for m, paths in runs.items()}
    page = write_report(folder).read_text()
    pack_runs(folder)
    assert not list(folder.rglob("metrics.jsonl")) and not list(folder.rglob("config.yaml"))
    assert (folder / "trace" / "seed_0" / "trees").is_dir()  # what is not packed keeps its run's folder
    assert find_runs(folder) == runs and find_runs(folder / "trace" / "seed_1") == {"trace": [folder / "trace" / "seed_1"]}
    assert {m: [load_run(p).rows for p in paths] for m, paths in runs.items()} == rows
    assert write_report(folder).read_text() == page


def test_load_run_merges_lines_by_step_and_drops_a_cut_last_line(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "method": "trace", "a": 1.0, "b": "text", "c": true}\n'
        '{"step": 1, "a": 2.0, "val/accuracy_greedy": 0.5}\n'
        '{"step": 2, "a": 3'
    )
    metrics = load_run(run)
    assert metrics.method == "trace"
    assert metrics.rows == {1: {"a": 2.0, "val/accuracy_greedy": 0.5}}
    (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        load_run(run)


def test_find_runs_names_what_it_expected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="holds no run"):
        find_runs(tmp_path)


# ---------------------------------------------------------------- viewer data


def test_viewer_data_embeds_backup_values_budgets_and_predictions(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    data = viewer_data([("trace", run)])
    (only,) = data["runs"]
    assert [s["step"] for s in only["steps"]] == [1, 2, 3]
    (tree_data,) = [t for t in only["steps"][1]["trees"] if t["index"] == 1]
    tree = read_jsonl(run / "trees" / "step_0002.jsonl")[1]
    assert tree_data["task_id"] == tree.task_id
    backup = tree.backup()
    nodes = tree_data["nodes"]
    assert nodes["value"] == pytest.approx([round(v, 4) for v in backup.values])
    assert nodes["leaves"] == backup.counts.tolist()
    assert nodes["budget"][0] == 5 and nodes["budget"][1] == 2
    assert nodes["predicted"][0] == 0.4 and nodes["predicted"][1] == 0.55
    assert nodes["parent"][0] == -1 and nodes["reward"][0] is None
    assert tree_data["leaves"] == 5 and tree_data["mixed"] == tree.is_mixed()
    assert nodes["tokens"][1] == 20 and nodes["trained_tokens"][1] == 12
    mixed = [i for i, flag in enumerate(nodes["mixed_anchor"]) if flag]
    assert 1 in mixed  # node 1 has continuations with rewards 0 and 1 below it


def test_viewer_data_stays_within_its_limits(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", steps=12, trees_per_step=6)
    path = run / "trees" / "step_0005.jsonl"
    trees = [make_tree(np.random.default_rng(1), "long", "q" * 50_000)]
    trees[0].nodes[1].observation = "x" * 200_000
    write_jsonl(trees, path)
    limits = ViewerLimits(max_steps=4, max_trees_per_step=3, max_nodes_per_tree=5, max_text_chars=500, max_bytes=60_000)
    data = viewer_data([("trace", run)], limits)
    steps = data["runs"][0]["steps"]
    assert len(steps) == 4 and steps[0]["step"] == 1 and steps[-1]["step"] == 12
    assert all(len(s["trees"]) <= 3 for s in steps)
    assert all(len(t["nodes"]["parent"]) <= 5 for s in steps for t in s["trees"])
    assert any(t["nodes_total"] > 5 for s in steps for t in s["trees"])
    assert len(embed_json(data)) < 80_000
    five = next(s for s in steps if s["step"] == 5)
    assert five["trees_total"] == five["trees_sampled"] == 1
    assert "more characters]" in five["trees"][0]["nodes"]["observation"][1]
    assert len(five["trees"][0]["prompt"]) < 600


def test_viewer_offers_mixed_trees_first_then_sampled_ones_then_prompts_without_rollouts(tmp_path: Path) -> None:
    def tree(task_id: str, rewards: list[float]) -> RolloutTree:
        made = RolloutTree.new(task_id, f"question {task_id}")
        for reward in rewards:
            made.add_turn(0, thought="t", action='answer("x")', reward=reward)
        return made

    trees = [tree("empty-a", []), tree("agree-2", [0.0, 0.0]), tree("mixed-2", [1.0, 0.0]), tree("empty-b", []),
             tree("agree-4", [1.0] * 4), tree("mixed-5", [0.0, 1.0, 0.0, 0.0, 1.0]), tree("mixed-2b", [0.0, 1.0])]
    run = write_run(tmp_path / "run", steps=1, evil=False)
    write_jsonl(trees, run / "trees" / "step_0001.jsonl")
    step = viewer_data([("trace", run)], ViewerLimits(max_trees_per_step=6))["runs"][0]["steps"][0]
    shown = [t["task_id"] for t in step["trees"]]
    assert shown == ["mixed-5", "mixed-2", "mixed-2b", "agree-4", "agree-2", "empty-a"]
    assert [t["index"] for t in step["trees"]] == [5, 2, 6, 4, 1, 0]
    assert step["trees_total"] == 7 and step["trees_sampled"] == 5


def test_viewer_reports_an_unreadable_step_file_and_keeps_the_rest(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    (run / "trees" / "step_0002.jsonl").write_text('{"task_id": "x"}\n')
    data = viewer_data([("trace", run)])
    steps = data["runs"][0]["steps"]
    assert steps[1]["error"] and steps[1]["trees"] == []
    assert len(steps[0]["trees"]) == 4 and len(steps[2]["trees"]) == 4
    assert any("step 2" in w for w in data["warnings"])


def test_write_viewer_makes_a_standalone_page(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    page = write_viewer(run).read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.count("<script") == 2
    assert len(embedded_data(page)["runs"][0]["steps"]) == 3


def test_embed_json_cannot_close_the_script_element() -> None:
    text = embed_json({"t": EVIL + EVIL_OBSERVATION})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"t": EVIL + EVIL_OBSERVATION}


# ---------------------------------------------------------------- report.html


def test_write_report_is_self_contained_and_escapes_model_text(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    report = build_report(run)
    assert report.html == run / "report.html"
    assert [p.parent for p in report.plots] == [run] * 7
    page = report.html.read_text(encoding="utf-8")
    assert page.count("<script") == 2  # the data and the viewer code, nothing from the trees
    assert "alert(1)</script>" not in page and "<img src=x" not in page
    assert not re.search(r"<(link|iframe)\b|src=\"http|href=\"http|@import", page)
    assert page.count('src="data:image/png;base64,') == 7
    data = embedded_data(page)
    (step1,) = [t for t in data["runs"][0]["steps"][0]["trees"] if t["index"] == 0]
    assert step1["nodes"]["thought"][1] == f"thinking {EVIL}"  # round-trips exactly
    assert step1["nodes"]["observation"][1] == EVIL_OBSERVATION
    assert "critic/score/mean" in page and "config.yaml" in page and "seed: 0" in page
    assert "innerHTML" not in page
    assert "method <b>trace</b> (budget: 20) ·" in page  # the rollout settings that differ from the defaults


def test_a_runs_report_names_its_rollout_options_and_none_for_the_defaults(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    (run / "config.yaml").write_text("rollout:\n  method: trace\n  stage2_objective: prompt\n  stage2_evidence: true\n")
    assert "method <b>trace</b> (stage2_objective: prompt, stage2_evidence: true) ·" in build_report(run).html.read_text()
    (run / "config.yaml").write_text("rollout:\n  method: trace\n  stage2_objective: anchor\n")
    assert "method <b>trace</b> ·" in build_report(run).html.read_text()
    (run / "config.yaml").write_text("- not: a mapping\n")
    assert "method <b>trace</b> ·" in build_report(run).html.read_text()


def test_write_report_for_a_comparison_folder(tmp_path: Path) -> None:
    folder = write_comparison(tmp_path / "cmp")
    out = write_report(folder)
    page = out.read_text(encoding="utf-8")
    assert "<b>0.600</b>" in page  # trace's effective ratio, best in bold
    assert "0.400 ± 0.020" in page
    assert "alert(1)</script>" not in page  # summary.json's config is escaped too
    data = embedded_data(page)
    assert [r["label"] for r in data["runs"]] == ["grpo · seed_0", "trace · seed_0"]
    assert (folder / "effective_ratio.png").is_file()


def test_report_of_a_run_without_trees_or_eval(tmp_path: Path) -> None:
    run = tmp_path / "bare"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "method": "grpo", "critic/score/mean": 0.25}\n')
    page = write_report(run).read_text(encoding="utf-8")
    assert embedded_data(page)["runs"][0]["steps"] == []
    assert page.count('src="data:image/png;base64,') == 1


def test_report_command_prints_path_then_a_json_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trace_rl.cli import main

    run = write_run(tmp_path / "run")
    assert main(["report", str(run)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == str(run / "report.html")
    result = json.loads(lines[-1])
    assert result["report"] == str(run / "report.html")
    assert len(result["plots"]) == 7 and all(Path(p).is_file() for p in result["plots"])
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
